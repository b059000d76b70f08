"""The Qwen3 dense family (Llama's blocks with per-head query/key norms and heads of their own
size): presets and refusals; Hugging Face interop against transformers' Qwen3ForCausalLM
(logits at tp 1, tp 2 and pp 2, import then export bitwise, greedy generation with the
key/value cache); the head norms' gradients under tp and sp; loss trajectories at tp 2 x dp 2,
pp 2, cp 2 and 2d equal to one process's."""

import dataclasses
import json
import math

import pytest
import torch
import transformers
from harness import run_on_ranks, worker_mesh
from hf_models import (
    IDS,
    TINY,
    assert_exports_bitwise,
    assert_generates_as_transformers,
    assert_import_refused,
    imported_fixture,
    logits_at,
    max_difference,
    move_head_norms,
    reference,
    saved_fixture,
    train_and_export,
)

import meshtrain
from meshtrain.checkpointing.checkpoint import checkpoint_config, resolve_checkpoint
from meshtrain.config.run_config import build_config
from meshtrain.errors import SettingError
from meshtrain.interop.hf_io import HFModelDirectory, hf_mapping
from meshtrain.interop.hf_qwen3 import MAPPING
from meshtrain.models import get_family, preset
from meshtrain.models.qwen3 import Qwen3Config
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

SMALL = TINY | dict(head_dim=16)
"""Heads of 16 on a hidden size of 32 / 4 heads = 8: the head size is not hidden / heads."""
CONFIGS = {
    "qwen3": transformers.Qwen3Config(**SMALL),
    "qwen3_tied": transformers.Qwen3Config(**SMALL, tie_word_embeddings=True,
                                           rope_parameters={"rope_type": "default",
                                                            "rope_theta": 1e6}),
}


def test_presets_have_the_published_shapes():
    small = preset("qwen3-0.6b")
    assert (small.num_layers, small.hidden_size, small.num_heads, small.kv_heads,
            small.head_dim, small.ffn_size, small.vocab_size, small.tie_embeddings,
            small.qk_norm, small.qkv_bias) == (28, 1024, 16, 8, 128, 3072, 151936, True, True,
                                               False)
    # Qwen3-0.6B: 0.6B parameters, 0.44B without the embedding
    assert 0.59e9 < small.num_parameters() < 0.60e9
    assert 0.43e9 < small.num_parameters() - 151936 * 1024 < 0.45e9
    assert 8.1e9 < preset("qwen3-8b").num_parameters() < 8.3e9  # Qwen3-8B: 8.2B
    assert get_family("qwen3").config is Qwen3Config
    tiny = preset("qwen3-tiny")
    shapes = tiny.parameter_shapes()
    assert shapes["layers.0.attn.q_norm.weight"] == shapes["layers.0.attn.k_norm.weight"] == (16,)
    assert shapes["layers.0.attn.qkv.q.weight"] == (8 * 16, 64)
    assert sum(math.prod(s) for s in shapes.values()) == tiny.num_parameters()
    model = build_model(tiny, meshtrain.ParallelMesh.local())
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes


def test_qk_norm_off_and_gpt_head_settings_are_refused():
    for name, fields, setting in (("qwen3-tiny", {"qk_norm": False}, "qk_norm"),
                                  ("tiny", {"qk_norm": True}, "qk_norm"),
                                  ("tiny", {"head_size": 16}, "head_size"),
                                  ("llama-tiny", {"head_size": 0}, "head_size")):
        with pytest.raises(SettingError) as refused:
            dataclasses.replace(preset(name), **fields)
        assert refused.value.settings[0] == setting


hf = saved_fixture(CONFIGS, move_head_norms)
"""Each variant saved by transformers, its head norms moved off their initial ones."""
imported = imported_fixture()


def test_import_maps_the_head_size_and_norms(hf, imported):
    cfg = HFModelDirectory(hf["qwen3"]).cfg
    assert (cfg.head_size, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == (16, 16, True, False)
    assert checkpoint_config(resolve_checkpoint(str(imported["qwen3"]))) == cfg
    with torch.no_grad():
        for variant in CONFIGS:
            expected = reference(hf[variant])(IDS).logits
            for source in (imported[variant], hf[variant]):
                assert max_difference(meshtrain.load_model(source)(IDS), expected) < 1e-5


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_import_then_export_is_bitwise(hf, imported, variant, tmp_path):
    out = tmp_path / "hf"
    assert_exports_bitwise(imported[variant], hf[variant], out)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["head_dim"]) == (["Qwen3ForCausalLM"], 16)


@pytest.mark.parametrize("degrees", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_logits_equal_transformers_at_tp2_and_pp2(hf, imported, degrees):
    with torch.no_grad():
        expected = reference(hf["qwen3"])(IDS).logits
    results = run_on_ranks(2, logits_at, str(imported["qwen3"]), IDS, degrees)
    for logits in (r for r in results if r is not None):
        assert max_difference(logits, expected) < 1e-5


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_greedy_generation_equals_transformers(hf, variant):
    """`generate` runs with the key/value cache: keys enter it normalised and rotated."""
    assert_generates_as_transformers(hf[variant])


def test_llama_reads_a_head_dim_apart_from_hidden_over_heads(tmp_path):
    """Llama's mapping (and so Mistral's, Qwen2's) reads "head_dim" as `head_size` (Mistral
    NeMo: 32 heads of 128 on a hidden size of 5120), and writes it back."""
    torch.manual_seed(0)
    llama = SMALL | {"head_dim": 16}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama)).save_pretrained(tmp_path)
    assert HFModelDirectory(tmp_path).cfg.head_size == 16
    with torch.no_grad():
        assert max_difference(meshtrain.load_model(tmp_path)(IDS),
                               reference(tmp_path)(IDS).logits) < 1e-5


def test_exports_write_head_dim_where_transformers_reads_it():
    """Qwen2's config.json leaves "head_dim" out unless `head_size` sets it; Qwen3's always has
    it (its default is 128, not hidden / heads); a Llama of head norms is refused."""
    assert "head_dim" not in hf_mapping("qwen2").config_to_hf(preset("qwen2-tiny"))
    assert hf_mapping("qwen2").config_to_hf(preset("qwen2-tiny", head_size=16))["head_dim"] == 16
    assert "head_dim" not in hf_mapping("qwen2_moe").config_to_hf(preset("qwen2-moe-tiny"))
    wide = preset("qwen2-moe-tiny", head_size=32)
    assert hf_mapping("qwen2_moe").config_to_hf(wide)["head_dim"] == 32
    assert hf_mapping("qwen3").config_to_hf(preset("qwen3-0.6b"))["head_dim"] == 128
    with pytest.raises(SettingError, match="`qk_norm`: LlamaForCausalLM has no query and key"):
        hf_mapping("llama").config_to_hf(preset("llama-tiny", qk_norm=True))


@pytest.mark.extended  # 4 ranks; importing then training at tp 2 x dp 2 is the point
def test_training_an_imported_qwen3_at_tp2_dp2_exports_to_transformers(imported, corpus,
                                                                         tmp_path):
    run = imported["qwen3"]
    trained, _, _ = train_and_export(run, tmp_path, corpus, "--tp", "2")
    norms = {n: p for n, p in trained.lm.named_parameters() if n.endswith("q_norm.weight")}
    first = meshtrain.load_model(run).lm.get_parameter("layers.0.attn.q_norm.weight")
    assert not torch.equal(norms["layers.0.attn.q_norm.weight"], first)  # the norms trained


@pytest.mark.parametrize("fields,named", [
    ({"attention_bias": True}, '"attention_bias"'),
    ({"hidden_act": "gelu"}, '"hidden_act"'),
    ({"head_dim": 0}, '"head_dim": 0'),
    ({"use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention"]}, '"layer_types"'),
    ({"layer_types": ["full_attention", "linear_attention"]}, '"layer_types"'),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
], ids=["attention_bias", "hidden_act", "head_dim", "interleaved", "unknown_type", "yarn"])
def test_unsupported_configs_are_one_line_errors(fields, named, tmp_path, capsys):
    assert_import_refused(CONFIGS["qwen3"].to_dict() | fields, named, tmp_path, capsys)


def test_a_window_from_one_layer_on_imports_and_exports():
    cfg = Qwen3Config(num_layers=2, hidden_size=32, num_heads=4, head_size=16, vocab_size=256)
    hf = CONFIGS["qwen3"].to_dict() | {"use_sliding_window": True, "sliding_window": 8,
                                       "max_window_layers": 1, "layer_types": None}
    windowed = MAPPING.config_from_hf(hf)
    assert (windowed.sliding_window, windowed.window_start_layer) == (8, 1)
    assert MAPPING.window_to_hf(cfg)["layer_types"] == ["full_attention"] * 2


QWEN = {"model": "qwen3-tiny"}


def _losses(corpus, steps: int, degrees: dict, plan: dict) -> tuple[list[float], dict]:
    """Losses of `steps` steps, and the sums of this rank's trained head norm weights (they
    decide the losses only through small differences)."""
    cfg = build_config({}, {"model": QWEN, "train": {
        "steps": steps, "global_batch": 8, "micro_batch": 2, "seq_len": 32, "seed": 5,
        "eval_every": 0, "warmup_steps": 0}, "parallel": {"device": "cpu"} | {
            key: value for key, value in plan.items() if key in ("cp", "cp_mode")},
        "data": {"data": corpus}, "checkpoint": {"out": "/nonexistent"}})
    cfg.plan = dataclasses.replace(cfg.plan, **plan)
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    losses = [trainer.train_step(step)["loss"] for step in range(steps)]
    values, _, _ = trainer.sync.export()
    return losses, {n: v.sum().item() for n, v in values.items()
                    if n.endswith(("q_norm.weight", "k_norm.weight"))}


STEPS = 4


@pytest.fixture(scope="module")
def one_process(corpus) -> tuple[list[float], dict]:
    return run_on_ranks(1, _losses, corpus, STEPS, {"dp": 1}, {})[0]


def _check_parity(corpus, one_process, degrees, plan):
    ranks = math.prod(degrees.get(axis, 1) for axis in ("tp", "pp", "dp", "cp"))
    results = run_on_ranks(ranks, _losses, corpus, STEPS, degrees, plan)
    losses = results[-1][0]  # the last rank holds the last pipeline stage
    norms = {name: value for _, held in results for name, value in held.items()}
    assert norms.keys() == one_process[1].keys()
    rel = max(abs(a - b) / abs(b) for a, b in zip(
        losses + [norms[n] for n in sorted(norms)],
        one_process[0] + [one_process[1][n] for n in sorted(norms)], strict=True))
    assert rel < 1e-5, rel


def test_tp2_x_dp2_trains_as_one_process(corpus, one_process):
    """The head norms are whole on each rank, which normalises its own heads: their gradients
    are summed over tp (checked through their trained weights)."""
    _check_parity(corpus, one_process, {"tp": 2, "dp": 2}, {})


@pytest.mark.extended
@pytest.mark.parametrize("degrees,plan", [
    ({"tp": 2, "dp": 1}, {"sequence_parallel": True}),
    ({"tp": 2, "dp": 1}, {"recompute": "full"}),
    ({"tp": 2, "dp": 1}, {"recompute": "selective", "zero": 3}),
    ({"pp": 2, "dp": 1}, {}),
    ({"cp": 2, "dp": 1}, {"cp": 2, "cp_mode": "ring"}),
    ({"tp": 4, "dp": 1, "tp_scheme": "2d"}, {"tp_scheme": "2d"}),
], ids=["tp2-sp", "tp2-full-recompute", "tp2-selective-zero3", "pp2", "cp2", "2d"])
def test_loss_trajectory_equals_one_process(corpus, one_process, degrees, plan):
    _check_parity(corpus, one_process, degrees, plan)
