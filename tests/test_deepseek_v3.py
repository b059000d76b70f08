"""DeepSeek-V3 (multi-head latent attention, sigmoid routing with a trained choice bias, a
shared expert, a dense first layer) against transformers' DeepseekV3ForCausalLM: logits at tp 1
(default) and tp 2, ep 2, pp 2 (extended) within 1e-5 in fp32, import then export bitwise,
greedy generation token for token with and without the latent cache; training parity of
deepseek-v3-tiny at several layouts, etp 1 among them (test_moe_layouts' machinery:
trajectory and every routing choice); bad MLA settings refused in one line; the presets
against the published configs. Tiny random models are built offline."""

import json

import pytest
import torch
import transformers
from harness import run_on_ranks, worker_mesh
from safetensors.torch import load_file, save_file
from test_moe_layouts import MODEL as MOE_MODEL
from test_moe_layouts import (
    _assert_same_choices,
    _assert_same_trajectory,
    _reference,
    _run,
    _world,
)

import meshtrain
import meshtrain.parallel.layers.expert as expert_layer
from meshtrain.checkpointing.checkpoint import (
    checkpoint_config,
    load_checkpoint,
    resolve_checkpoint,
)
from meshtrain.cli.main import main
from meshtrain.errors import SettingError
from meshtrain.inference.generate import generate
from meshtrain.mesh import ParallelMesh
from meshtrain.models import preset
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model, pipeline_stage

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
HF = transformers.DeepseekV3Config(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
    routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=12, max_position_embeddings=64, initializer_range=0.1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 0.7},
    bos_token_id=None, eos_token_id=None)
"""Query latent, value heads wider than query heads, YaRN with both magnitude corrections."""


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A random DeepseekV3ForCausalLM saved as Hugging Face files, with norms away from 1 and
    a nonzero correction bias (so both are seen), and its import as a run directory."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(HF).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name or "e_score_correction_bias" in name:
                tensor.add_(0.1 * torch.randn_like(tensor))
    root = tmp_path_factory.mktemp("deepseek")
    model.save_pretrained(root / "hf")
    _add_multi_token_prediction(root / "hf")
    assert main(["import-hf", str(root / "hf"), "--out", str(root / "run")]) == 0
    return model, root / "hf", root / "run"


MTP = {"model.layers.3.eh_proj.weight": (64, 128), "model.layers.3.enorm.weight": (64,),
       "model.layers.3.self_attn.kv_a_layernorm.weight": (16,)}
"""Some of a multi-token-prediction layer's tensors (transformers builds none of them)."""


def _add_multi_token_prediction(path) -> None:
    """The checkpoint as DeepSeek releases it: one MTP layer after the model's layers."""
    tensors = load_file(path / "model.safetensors") | {
        name: torch.randn(shape) for name, shape in MTP.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))


def test_logits_equal_transformers_and_export_is_bitwise(hf, tmp_path):
    """Also the multi-token-prediction tensors, kept by the import and written back."""
    model, hf_dir, run = hf
    with torch.no_grad():
        expected = model(IDS).logits
        assert (meshtrain.load_model(run)(IDS) - expected).abs().max() < 1e-5
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "out")]) == 0
    original, exported = load_file(hf_dir / "model.safetensors"), \
        load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == original.keys() and set(MTP) <= original.keys()
    assert all(torch.equal(exported[key], original[key]) for key in original)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (theirs(IDS).logits - expected).abs().max() < 1e-5


def test_every_token_chooses_the_experts_transformers_chooses(hf, monkeypatch):
    """Each MoE layer's chosen experts per token (as sets: both pick the top k unsorted)."""
    model, _, run = hf
    theirs, ours = [], []
    for layer in model.model.layers[HF.first_k_dense_replace:]:
        layer.mlp.gate.register_forward_hook(
            lambda _m, _args, out: theirs.append(out[2].sort(dim=-1).values))
    route = expert_layer.route

    def recorded(*args, **kwargs):
        routing = route(*args, **kwargs)
        ours.append(routing.experts.sort(dim=-1).values)
        return routing

    monkeypatch.setattr(expert_layer, "route", recorded)
    with torch.no_grad():
        model(IDS)
        meshtrain.load_model(run)(IDS)
    assert len(ours) == len(theirs) == HF.num_hidden_layers - HF.first_k_dense_replace
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_greedy_generation_equals_transformers_with_and_without_the_cache(hf):
    model, _, run = hf
    ours = meshtrain.load_model(run).lm
    prompt = IDS[:, :6]
    theirs = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                            do_sample=False, min_new_tokens=12)
    assert len(theirs[:, 6:].unique()) > 3  # not one token repeated: the test can tell
    for use_cache in (True, False):
        assert torch.equal(generate(ours, prompt, max_new_tokens=12, use_cache=use_cache),
                           theirs), use_cache


def _logits_at(run: str, ids: torch.Tensor, degrees: dict) -> torch.Tensor | None:
    """The whole model's logits at this layout (the last pipeline stage returns them)."""
    mesh = worker_mesh(**degrees)
    path = resolve_checkpoint(run)
    cfg = checkpoint_config(path)
    stage = pipeline_stage(cfg.num_layers, ParallelPlan(**degrees), mesh)
    model = build_model(cfg, mesh, stage=stage).eval()
    load_checkpoint(path, model=model, mesh=mesh)
    with torch.no_grad():
        if stage.has_embedding and stage.has_head:
            return model.full_logits(model(ids))
        if stage.has_embedding:
            comm.send(model(ids), mesh.pp, 1).wait()
            return None
        hidden = torch.empty(*ids.shape, cfg.hidden_size)
        comm.recv(hidden, mesh.pp, 0)
        return model.full_logits(model(hidden, torch.arange(ids.shape[1])))


@pytest.mark.extended
@pytest.mark.parametrize("degrees", [{"tp": 2}, {"dp": 2, "ep": 2}, {"pp": 2}],
                         ids=["tp2", "ep2", "pp2"])
def test_logits_equal_transformers_at_other_layouts(hf, degrees):
    model, _, run = hf
    with torch.no_grad():
        expected = model(IDS).logits
    for logits in run_on_ranks(2, _logits_at, str(run), IDS, degrees):
        if logits is not None:
            assert (logits - expected).abs().max() < 1e-5, degrees


_TINY = preset("deepseek-v3-tiny")
MODEL = {"model": "deepseek-v3-tiny", **{name: getattr(_TINY, name) for name in MOE_MODEL}}
"""deepseek-v3-tiny as its preset has it (over test_moe_layouts' settings): dropless sigmoid
top-2 of 8 from the better of 2 groups, the choice bias updated after every step (rate 0.001), a
shared expert added, layer 0 dense."""
LAYOUTS = {  # name: (degrees, plan settings)
    "cp2-ring": ({"cp": 2}, {"cp_mode": "ring"}),
    "tp2xep2": ({"tp": 2, "dp": 2, "ep": 2}, {}),
    "tp2xep2-etp1": ({"tp": 2, "ep": 2, "etp": 1}, {}),  # whole experts over the tp ranks
    "sp-tp2xep2": ({"tp": 2, "dp": 2, "ep": 2}, {"sequence_parallel": True}),
    "pp2xep2": ({"pp": 2, "dp": 2, "ep": 2}, {}),
    "cp2-all2all": ({"cp": 2}, {"cp_mode": "all2all"}),
    "zero3-ep2xdp2": ({"dp": 2, "ep": 2}, {"zero": 3}),
    "tp2-selective": ({"tp": 2}, {"recompute": "selective"}),  # (full recompute replays
    # routing, which the choice recorder would count as the next micro-batch)
}
DEFAULT = "cp2-ring"  # the default tier's case: ring attention over unequal key/value widths


@pytest.fixture(scope="module")
def reference(corpus):
    return _reference(corpus, MODEL)


@pytest.mark.parametrize("layout,steps", [
    (DEFAULT, 2),
    *(pytest.param(name, 5, marks=pytest.mark.extended) for name in LAYOUTS)])
def test_layout_trains_one_process_trajectory_and_choices(corpus, reference, layout, steps):
    degrees, parallel = LAYOUTS[layout]
    results = run_on_ranks(_world(degrees), _run, corpus, degrees, parallel, stop=steps,
                           model=MODEL, timeout=300)
    rows, choices = reference
    _assert_same_trajectory(layout, results[0][0], rows[:steps])
    _assert_same_choices(layout, [c for _, c in results],
                         {key: value for key, value in choices.items() if key[0] < steps})


@pytest.mark.extended
def test_resume_at_another_layout_continues_the_trajectory(corpus, reference, tmp_path):
    """Saved after 3 steps at pp 2 x ep 2 (the choice bias in the checkpoint), resumed at
    tp 2 x ep 2 with sequence parallelism."""
    first = run_on_ranks(4, _run, corpus, *LAYOUTS["pp2xep2"], stop=3, save=tmp_path,
                         model=MODEL, timeout=300)
    second = run_on_ranks(4, _run, corpus, *LAYOUTS["sp-tp2xep2"], resume=tmp_path,
                          model=MODEL, timeout=300)
    _assert_same_trajectory("resumed", first[0][0] + second[0][0], reference[0])
    _assert_same_choices("resumed", [a[1] | b[1] for a, b in zip(first, second, strict=True)],
                         reference[1])


def test_latent_cache_is_smaller_than_grouped_query_attention():
    """Per token and layer: the latent and the rotary key (576 numbers in DeepSeek-V3), against
    the keys and values of 8 grouped heads (8 x (192 + 128)); benchmarks/bench_mla_cache.py."""
    cfg = preset("deepseek-v3")
    assert cfg.cached_bytes_per_token(2) == 61 * 576 * 2
    assert 61 * 8 * (192 + 128) * 2 / cfg.cached_bytes_per_token(2) == pytest.approx(4.44, 0.01)
    assert cfg.num_parameters() == 671_026_404_352  # without the multi-token-prediction layer


PUBLISHED = {  # preset: its config.json's fields as this preset's settings
    # deepseek-ai/DeepSeek-V3 config.json (as quoted whole in EasyDeL's model tests and by
    # Megatron-Bridge's deepseek_v3.yaml): n_group 8, topk_group 4, yarn factor 40 from 4096.
    "deepseek-v3": dict(
        num_layers=61, hidden_size=7168, num_heads=128, ffn_hidden_size=18432,
        vocab_size=129280, max_seq_len=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, moe_experts=256, moe_top_k=8, moe_ffn_size=2048,
        moe_shared_ffn_size=2048, moe_first_dense=3, moe_groups=8, moe_topk_groups=4,
        moe_routed_scaling=2.5, moe_score="sigmoid", moe_norm_topk_prob=True,
        rope_scaling="yarn", rope_factor=40.0, rope_original_max_positions=4096,
        rope_beta_fast=32.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        tie_word_embeddings=False),
    # moonshotai/Moonlight-16B-A3B config.json (as quoted whole in a public Rust loader's
    # tests): no query latent, 2 shared experts, one group, no rope scaling.
    "moonlight-16b-a3b": dict(
        num_layers=27, hidden_size=2048, num_heads=16, ffn_hidden_size=11264,
        vocab_size=163840, max_seq_len=8192, rms_norm_eps=1e-5, rope_theta=50000.0,
        q_lora_rank=0, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, moe_experts=64, moe_top_k=6, moe_ffn_size=1408,
        moe_shared_ffn_size=2 * 1408, moe_first_dense=1, moe_groups=1, moe_topk_groups=1,
        moe_routed_scaling=2.446, moe_score="sigmoid", moe_norm_topk_prob=True,
        rope_scaling=None, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_configs(name):
    cfg = preset(name)
    assert {key: getattr(cfg, key) for key in PUBLISHED[name]} == PUBLISHED[name]


@pytest.mark.parametrize("flag,value,named", [
    ("--kv-lora-rank", "0", "kv_lora_rank"), ("--v-head-dim", "0", "v_head_dim"),
    ("--qk-rope-head-dim", "0", "qk_rope_head_dim")])
def test_bad_latent_settings_are_refused_in_one_line(capsys, flag, value, named):
    assert main(["train", "--model", "deepseek-v3-tiny", flag, value, "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named.replace("_", "-") in err[0], err


def test_an_unsupported_rope_scaling_is_refused():
    with pytest.raises(SettingError, match="rope_scaling"):
        preset("deepseek-v3-tiny", rope_scaling="llama3")
    with pytest.raises(SettingError, match="kv_lora_rank"):
        preset("llama-tiny", kv_lora_rank=16)


@pytest.mark.parametrize("fields,named", [
    ({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
     "DeepseekV2ForCausalLM"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
    ({"topk_group": 5}, "topk_group")])
def test_bad_configs_are_refused_in_one_line(hf, tmp_path, capsys, fields, named):
    """DeepSeek-V2 (softmax scores, greedy routing), an unsupported rotary type, a latent of 0
    and more groups chosen than there are: exit 2, one line naming the field, nothing written."""
    _, hf_dir, _ = hf
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | fields))
    assert main(["import-hf", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not (tmp_path / "run").exists()


def _cached_pieces(tp: int) -> torch.Tensor:
    """deepseek-v3-tiny's logits of a prompt fed through one cache in pieces (5 tokens, 3, then
    one at a time) against one forward, each rank caching the whole latent and rotary key;
    then greedy generation with the cache against without it. Returns the generated tokens."""
    mesh = worker_mesh(tp=tp) if tp > 1 else ParallelMesh.local()
    cfg = preset("deepseek-v3-tiny", max_seq_len=16, init_std=0.2)
    model = build_model(cfg, mesh, seed=0).eval()
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids)
        cache = model.kv_cache(16)
        pieces = [model(ids[:, a:b], cache=cache) for a, b in
                  [(0, 5), (5, 8), *((i, i + 1) for i in range(8, 12))]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-5, atol=1e-5)
    assert cache[0].keys.shape == (3, 1, 16, cfg.kv_lora_rank)
    assert cache[0].values.shape == (3, 1, 16, cfg.qk_rope_head_dim)
    tokens = generate(model, ids[:, :5], max_new_tokens=20)
    assert torch.equal(tokens, generate(model, ids[:, :5], max_new_tokens=20, use_cache=False))
    return tokens


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_the_latent_cache_gives_the_uncached_logits_and_tokens(tp):
    if tp == 1:
        _cached_pieces(1)
        return
    first, second = run_on_ranks(2, _cached_pieces, 2)
    assert torch.equal(first, second)
