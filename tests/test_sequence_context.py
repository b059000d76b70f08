"""Sequence parallelism, context parallelism (ring and all2all) and recomputation against the
single-process model."""

import dataclasses
import re

import pytest
import torch
from harness import LLAMA, dense_reference, run_on_ranks, worker_mesh
from torch.testing import assert_close

from meshtrain import ParallelMesh, preset
from meshtrain.cli.flags import as_flags
from meshtrain.config.run_config import build_config
from meshtrain.parallel import CommRecorder, named_full_tensors
from meshtrain.parallel.layers.context_parallel import context_parallel_positions
from meshtrain.parallel.runtime.optim import clip_grad_norm_
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

TOL = {"rtol": 1e-5, "atol": 1e-6}


def _cfg(corpus, parallel, dropout=0.0, model=None):
    return build_config({}, {
        "model": {"dropout": dropout} | (model or {}),
        "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "seq_len": 32, "seed": 6,
                  "clip_grad": 0.0},
        "parallel": {"device": "cpu", **parallel}, "data": {"data": corpus},
        "checkpoint": {"out": "/nonexistent"}})


def _check_layout(corpus, tp, cp, parallel, model=None):
    world = torch.distributed.get_world_size()
    mesh = worker_mesh(tp=tp, cp=cp, dp=world // (tp * cp))
    cfg = _cfg(corpus, parallel, model=model)
    trainer = Trainer.build(cfg, mesh)
    reference = dense_reference(cfg)
    batches = trainer.train_data.micro_batches(0, dp_rank=0, dp_size=1)
    ref_loss = 0.0
    for inputs, targets in batches:
        loss = reference.loss(reference(inputs), targets) / len(batches)
        loss.backward()
        ref_loss += loss.item()
    row = trainer.train_step(0)
    assert row["loss"] == pytest.approx(ref_loss, rel=1e-5)
    ref_norm = clip_grad_norm_(reference, ParallelMesh.local()).item()
    assert row["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)  # each parameter once
    ref_grads = dict(named_full_tensors(reference, grads=True))
    for name, grad in named_full_tensors(trainer.model, grads=True):
        assert_close(grad, ref_grads[name], **TOL, msg=name)


@pytest.mark.parametrize("tp,cp,world,parallel", [
    (2, 1, 2, {"sequence_parallel": True}),
    (4, 1, 4, {"sequence_parallel": True}),
    (1, 2, 2, {"cp_mode": "ring"}),
    (1, 4, 4, {"cp_mode": "ring"}),
    (1, 2, 2, {"cp_mode": "all2all"}),
    (1, 2, 4, {"cp_mode": "ring"}),  # cp2 x dp2
    (2, 2, 4, {"cp_mode": "ring"}),
    (2, 2, 4, {"cp_mode": "all2all"}),
    (2, 2, 4, {"cp_mode": "ring", "sequence_parallel": True}),
    (2, 1, 2, {"recompute": "selective"}),
    (2, 1, 2, {"recompute": "full"}),
    (2, 2, 4, {"recompute": "full", "recompute_layers": 2, "sequence_parallel": True}),
], ids=lambda v: str(v))
@pytest.mark.parametrize("model", [None, LLAMA], ids=["gpt", "llama"])
def test_layout_matches_single_process(corpus, tp, cp, world, parallel, model):
    run_on_ranks(world, _check_layout, corpus, tp, cp, parallel, model)


@pytest.mark.parametrize("tp,cp,world,parallel", [
    (4, 1, 4, {}), (4, 1, 4, {"sequence_parallel": True, "recompute": "selective"}),
    (2, 2, 4, {"cp_mode": "all2all"})], ids=lambda v: str(v))
def test_key_value_heads_shared_by_tp_ranks_match_single_process(corpus, tp, cp, world,
                                                                 parallel):
    """Llama with 2 key/value heads: at tp 4 each is replicated on 2 ranks, whose partial
    weight gradients are summed; at tp 2 x cp 2 the Ulysses path repeats them per head."""
    run_on_ranks(world, _check_layout, corpus, tp, cp, parallel, LLAMA | {"num_kv_heads": 2})


def _losses_with_dropout(corpus, recompute):
    mesh = worker_mesh(tp=2)
    trainer = Trainer.build(_cfg(corpus, {"recompute": recompute, "sequence_parallel": True},
                                 dropout=0.2), mesh)
    rows = [trainer.train_step(step) for step in range(3)]
    return [(r["loss"], r["grad_norm"]) for r in rows]


def test_recompute_replays_dropout_masks_bitwise(corpus):
    plain = run_on_ranks(2, _losses_with_dropout, corpus, "none")[0]
    for mode in ("selective", "full"):
        assert run_on_ranks(2, _losses_with_dropout, corpus, mode)[0] == plain, mode


def _check_sp_comm(tp):
    """SP moves TP's bytes (all-reduce = reduce-scatter + all-gather) plus one all-gather per
    column-parallel input in backward."""
    mesh = worker_mesh(tp=tp)
    cfg = preset("tiny", vocab_size=64)
    model = build_model(cfg, mesh, seed=0, plan=ParallelPlan(sequence_parallel=True))
    b, s, h = 2, 16, cfg.hidden_size
    ids = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(0))
    with CommRecorder() as fwd:
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
    with CommRecorder() as bwd:
        loss.backward()
    full = b * s * h * 4  # payload of each gather / scatter: the full [b, s, h]
    layers = cfg.num_layers
    assert [r.payload_bytes for r in fwd.select("all_gather", "tp")] == [full] * (2 * layers + 1)
    assert [r.payload_bytes for r in fwd.select("reduce_scatter", "tp")] == \
        [full] * (2 * layers + 1)
    assert fwd.count("all_reduce", "tp") == 2  # the loss's O(b*s) statistics only
    # backward: conjugates (2 reduce-scatters + 2 all-gathers per layer, head and embedding)
    # plus the extra all-gather of each column-parallel input (2 per layer)
    assert bwd.count("all_gather", "tp") == 4 * layers + 1
    assert bwd.count("reduce_scatter", "tp") == 2 * layers + 1
    assert bwd.count("all_reduce") == 0
    tp_ring = sum(r.ring_bytes for r in fwd.select(axis="tp") + bwd.select(axis="tp")
                  if r.op != "all_reduce")
    # = TP's 2(t-1)/t * bsh per all-reduce (4 per layer + embedding + head) + the extra gathers
    expected = (4 * layers + 2) * 2 * (tp - 1) / tp * full + 2 * layers * (tp - 1) / tp * full
    assert tp_ring == pytest.approx(expected)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_communication(tp):
    run_on_ranks(tp, _check_sp_comm, tp)


def test_load_balanced_positions():
    parts = [context_parallel_positions(16, 2, r).tolist() for r in range(2)]
    assert parts == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    union = sorted(p for r in range(4) for p in context_parallel_positions(32, 4, r).tolist())
    assert union == list(range(32))


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 1, "plan": ParallelPlan(sequence_parallel=True)}, "--sequence-parallel needs --tp"),
    ({"tp": 4, "seq_len": 30, "plan": ParallelPlan(sequence_parallel=True)},
     r"--seq-len 30 / cp \(1\) = 30 tokens per rank must be divisible by tp \(4\)"),
    ({"cp": 2, "seq_len": 30}, r"--seq-len 30 must be divisible by 2 x cp = 4"),
    ({"cp": 2, "tp": 4, "seq_len": 36, "plan": ParallelPlan(sequence_parallel=True)},
     r"36 / cp \(2\) = 18 tokens per rank must be divisible by tp \(4\)"),
    ({"plan": ParallelPlan(recompute="selective", recompute_layers=2)},
     "--recompute-layers applies to --recompute full only"),
    ({"cp": 2, "dropout": 0.1}, "attention dropout with --cp > 1"),
    ({"cp": 4, "tp": 2, "plan": ParallelPlan(cp_mode="all2all")},
     r"heads per TP rank \(2\) divisible by --cp 4"),
    ({"plan": ParallelPlan(recompute="some")}, "--recompute must be none, selective or full"),
])
def test_bad_plans(kwargs, match):
    args = {"tp": 1, "cp": 1, "seq_len": 64, "dropout": 0.0, "plan": ParallelPlan()} | kwargs
    plan = dataclasses.replace(args["plan"], tp=args["tp"], cp=args["cp"], micro_batch=2)
    model = preset("tiny", dropout=args["dropout"])
    with pytest.raises(ValueError) as error:
        plan.validate(model, world_size=args["tp"] * args["cp"], global_batch=2,
                      seq_len=args["seq_len"])
    assert re.search(match, as_flags(str(error.value))), error.value  # as the CLI shows it


def _ring_bf16():
    """Ring attention in bf16 keeps its running max/sum in fp32: as accurate as SDPA in bf16."""
    from meshtrain.parallel.layers.context_parallel import ring_attention

    mesh = worker_mesh(cp=2)
    torch.manual_seed(0)
    s, d = 64, 16
    full = [torch.randn(1, 2, s, d, dtype=torch.float64) for _ in range(3)]
    reference = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=True)
    positions = context_parallel_positions(s, 2, mesh.cp.rank)
    local = [t[:, :, positions].to(torch.bfloat16).requires_grad_() for t in full]
    out = ring_attention(*local, mesh.cp, s)
    assert out.dtype == torch.bfloat16
    error = (out.double() - reference[:, :, positions]).abs().max().item()
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(t.to(torch.bfloat16) for t in full), is_causal=True)[:, :, positions]
    sdpa_error = (sdpa.double() - reference[:, :, positions]).abs().max().item()
    out.sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 for t in local)
    assert error <= 1.5 * sdpa_error + 1e-3, (error, sdpa_error)


def test_ring_attention_accumulates_in_fp32_for_bf16_inputs():
    run_on_ranks(2, _ring_bf16)
