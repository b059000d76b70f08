"""Generation with a key/value cache against generation without one (every step recomputing the
whole context): the same tokens, greedy and sampled, for GPT and Llama (grouped-query, and one
key/value head shared by both tp ranks) at tp 1 and 2, batch 3, past `max_seq_len`; the cached
logits themselves, also for prompts fed in pieces and the eager core; each rank caching only its
own heads; and the layouts and modes that cannot cache, refused."""

import pytest
import torch
from harness import run_on_ranks, worker_mesh

from meshtrain import ParallelMesh, ParallelPlan, preset
from meshtrain.contracts import StageSpec
from meshtrain.inference.generate import generate
from meshtrain.parallelize import build_model

MAX_SEQ_LEN = 16
PROMPT = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(4))  # batch 3
CASES = {
    "gpt": ("tiny", {}),
    "llama_gqa": ("llama-tiny", {}),  # 8 query heads over 4 key/value heads
    "llama_shared_kv": ("llama-tiny", {"num_kv_heads": 1}),  # tp 2: both ranks hold the one
    "moe": ("tiny", {"moe_experts": 4, "moe_top_k": 2, "moe_capacity_factor": 0.0}),  # dropless
}
SAMPLED = {"top_k": 8, "temperature": 0.8, "seed": 3}


def _model(case: str, mesh: ParallelMesh, plan: ParallelPlan | None = None, **overrides):
    """A tiny model whose larger weights make its logits far from ties (init_std 0.2)."""
    name, fields = CASES[case]
    cfg = preset(name, max_seq_len=MAX_SEQ_LEN, init_std=0.2, **fields, **overrides)
    return build_model(cfg, mesh, plan=plan, seed=0)


def _mesh(tp: int) -> ParallelMesh:
    return worker_mesh(tp=tp) if tp > 1 else ParallelMesh.local()


def _check_generation(case: str, tp: int) -> torch.Tensor:
    """Cached == uncached, greedy and sampled, from a prompt through the sliding window and
    from a prompt longer than the window; returns the greedy tokens."""
    model = _model(case, _mesh(tp))
    new = 2 * MAX_SEQ_LEN  # the sequence outgrows max_seq_len after 11 new tokens
    for prompt in (PROMPT, torch.cat([PROMPT] * 4, dim=1)):  # 5 and 20 tokens
        for kwargs in ({}, SAMPLED):
            cached = generate(model, prompt, max_new_tokens=new, **kwargs)
            reference = generate(model, prompt, max_new_tokens=new, use_cache=False, **kwargs)
            assert cached.shape == (3, prompt.shape[1] + new)
            assert torch.equal(cached, reference), (case, tp, prompt.shape, kwargs)
    greedy = generate(model, PROMPT, max_new_tokens=new)
    assert len(greedy[:, 5:].unique()) > 3  # not one token repeated: the test can tell
    return greedy


# At tp 2 the one-KV-head Llama runs by default (both ranks hold its one head); the others'
# per-rank caches are checked at tp 2 by test_cached_logits_equal_one_forward.
_TP2_DEFAULT = "llama_shared_kv"


@pytest.mark.parametrize("case,tp", [
    *(pytest.param(case, 1, marks=pytest.mark.extended if case == "moe" else ())
      for case in CASES),  # (moe: test_dropless_moe_models_generate_with_the_cache)
    *(pytest.param(case, 2, marks=() if case == _TP2_DEFAULT else pytest.mark.extended)
      for case in CASES)])
def test_cached_generation_equals_uncached(case, tp):
    if tp == 1:
        _check_generation(case, 1)
        return
    first, second = run_on_ranks(2, _check_generation, case, 2)
    assert torch.equal(first, second)  # every rank picks the same tokens


def _check_cached_logits(case: str, tp: int, attention: str) -> None:
    """Logits of the prompt fed in pieces (5 tokens, 3, then one at a time) through one cache
    equal one forward over all of them; each rank caches its own key/value heads only."""
    model = _model(case, _mesh(tp), attention=attention).eval()
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids)
        cache = model.kv_cache(MAX_SEQ_LEN)
        pieces = [model(ids[:, a:b], cache=cache) for a, b in
                  [(0, 5), (5, 8), *((i, i + 1) for i in range(8, 12))]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-5, atol=1e-5)
    cfg = model.cfg
    local_kv = max(getattr(cfg, "kv_heads", cfg.num_heads) // tp, 1)
    assert cache.length == 12
    assert cache[0].keys.shape == (3, local_kv, MAX_SEQ_LEN, cfg.head_dim)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("case", CASES)
def test_cached_logits_equal_one_forward(case, attention):
    _check_cached_logits(case, 1, attention)
    run_on_ranks(2, _check_cached_logits, case, 2, attention)


def test_moe_models_with_a_capacity_generate_without_the_cache():
    model = _model("gpt", ParallelMesh.local(), moe_experts=2)
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        model.kv_cache(MAX_SEQ_LEN)
    assert torch.equal(generate(model, PROMPT, max_new_tokens=6),
                       generate(model, PROMPT, max_new_tokens=6, use_cache=False))


def test_dropless_moe_models_generate_with_the_cache(monkeypatch):
    """Dropless routing is per token: the cached tokens are the uncached ones (the `moe` case
    of the tests above checks them through the sliding window), and the cache is made."""
    model = _model("moe", ParallelMesh.local())
    made = []
    monkeypatch.setattr(model, "kv_cache", lambda n: made.append(n) or type(model).kv_cache(
        model, n))
    assert torch.equal(generate(model, PROMPT, max_new_tokens=6),
                       generate(model, PROMPT, max_new_tokens=6, use_cache=False))
    assert made == [11]


def test_cache_refuses_training_mode_pipeline_stages_and_overflow():
    model = _model("llama_gqa", ParallelMesh.local())
    with pytest.raises(ValueError, match="max_seq_len"):
        model.kv_cache(MAX_SEQ_LEN + 1)
    cache = model.kv_cache(6)
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        model.train()(PROMPT, cache=cache)
    model.eval()(PROMPT, cache=cache)
    with pytest.raises(ValueError, match="holds 6 tokens, 7 were asked"):
        model(PROMPT[:, :2], cache=cache)
    cfg = model.cfg
    stage = build_model(cfg, ParallelMesh.local(),
                                 stage=StageSpec((range(2),), has_head=False))
    with pytest.raises(ValueError, match="pipeline stage"):
        stage.kv_cache(MAX_SEQ_LEN)


def _check_split_sequences_refused() -> None:
    for mesh, plan in ((worker_mesh(tp=2), ParallelPlan(sequence_parallel=True)),
                       (worker_mesh(cp=2), ParallelPlan())):
        model = _model("gpt", mesh, plan=plan)
        with pytest.raises(ValueError, match="sequence and context parallelism"):
            generate(model, PROMPT, max_new_tokens=2)


def test_sequence_and_context_parallel_models_are_refused():
    run_on_ranks(2, _check_split_sequences_refused)
