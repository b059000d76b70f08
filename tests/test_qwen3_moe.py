"""The Qwen3-MoE family (Qwen3's attention, narrow experts, no shared expert): presets with the
published sizes; Hugging Face interop against transformers' Qwen3MoeForCausalLM (logits and every
token's chosen experts at tp 1, ep 2, tp 2 and pp 2, import then export bitwise under the files'
per-expert names, greedy generation, refused fields); the 5-step trajectory and every token's
experts of one process at ep 2 x dp 2, tp 2 x ep 2, pp 2 x ep 2 and ZeRO-3 x ep 2 (the harness of
test_moe_layouts.py)."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from harness import run_cli, run_on_ranks
from safetensors.torch import load_file
from test_hf_moe import _assert_same, _logits_at, _recorded
from test_moe_layouts import (
    STEPS,
    _assert_same_choices,
    _assert_same_trajectory,
    _reference,
    _run,
    _world,
)

import meshtrain
from meshtrain.cli.main import main
from meshtrain.interop.hf_io import HFModelDirectory
from meshtrain.models import preset

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
BASE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.1, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16)
CONFIGS = {
    # heads of 16 on hidden 32 / 4 heads (the class has no "head_dim": read from the file),
    # top 2 renormalised on every layer, as the published models
    "qwen3_moe": transformers.Qwen3MoeConfig(**BASE, head_dim=16, norm_topk_prob=True),
    # no "head_dim" (hidden / heads), layer 0 dense, top 2 as they are
    "qwen3_moe_dense0": transformers.Qwen3MoeConfig(**BASE, mlp_only_layers=[0]),
}
ROUTER = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter


def test_presets_have_the_published_sizes():
    a3b, a22b = preset("qwen3-30b-a3b"), preset("qwen3-235b-a22b")
    assert (a3b.num_layers, a3b.hidden_size, a3b.num_heads, a3b.kv_heads, a3b.head_dim,
            a3b.moe_experts, a3b.moe_top_k, a3b.expert_ffn_size, a3b.moe_shared_ffn_size,
            a3b.moe_norm_topk_prob, a3b.qk_norm) == (48, 2048, 32, 4, 128, 128, 8, 768, 0,
                                                     True, True)
    embedding = 151936 * 2048  # the input table: a lookup, not multiplied with
    assert 30.4e9 < a3b.num_parameters() < 30.6e9  # Qwen3-30B-A3B: 30.5B, 3.3B activated
    assert 3.2e9 < a3b.matmul_parameters_per_token() + embedding < 3.4e9
    assert 234e9 < a22b.num_parameters() < 236e9  # Qwen3-235B-A22B: 235B, 22B activated
    assert 21.5e9 < a22b.matmul_parameters_per_token() + 151936 * 4096 < 22.5e9


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    for seed, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # head norms off their initial ones
            for param_name, param in model.named_parameters():
                if param_name.endswith(("q_norm.weight", "k_norm.weight")):
                    param.add_(0.3 * torch.randn_like(param))
        model.save_pretrained(root / name)
    return {name: root / name for name in CONFIGS}


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    for name, path in hf.items():
        assert main(["import-hf", str(path), "--out", str(root / name)]) == 0
    return {name: root / name for name in hf}


def _theirs(path: Path) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """transformers' logits of IDS and each MoE layer's chosen experts [T, k]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    chosen, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, ROUTER):
            layer = int(name.split(".")[2])
            hooks.append(module.register_forward_hook(
                lambda _m, _a, out, layer=layer: chosen.__setitem__(layer, out[2])))
    with torch.no_grad():
        logits = model(IDS).logits
    for hook in hooks:
        hook.remove()
    return logits, chosen


def test_configs_import_as_the_family_settings(hf):
    cfg = HFModelDirectory(hf["qwen3_moe"]).cfg
    assert (cfg.head_dim, cfg.qk_norm, cfg.moe_experts, cfg.moe_top_k, cfg.moe_norm_topk_prob,
            cfg.expert_ffn_size, cfg.moe_layer_indices(), cfg.moe_capacity_factor) == \
        (16, True, 4, 2, True, 16, (0, 1), 0.0)
    dense0 = HFModelDirectory(hf["qwen3_moe_dense0"]).cfg
    assert (dense0.head_dim, dense0.moe_layer_indices(), dense0.moe_norm_topk_prob,
            dense0.ffn_size) == (8, (1,), False, 64)


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_logits_and_chosen_experts_equal_transformers(hf, imported, variant):
    expected, expected_chosen = _theirs(hf[variant])
    for source in (imported[variant], hf[variant]):
        model = meshtrain.load_model(source)
        with torch.no_grad(), _recorded(model) as chosen:
            logits = model(IDS)
        _assert_same(logits, chosen, expected, expected_chosen, source)


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_import_then_export_is_bitwise_and_loads_cleanly(hf, imported, variant, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(imported[variant]), "--format", "hf", "--out", str(out)]) == 0
    original, exported = (load_file(d / "model.safetensors") for d in (hf[variant], out))
    assert exported.keys() == original.keys()
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in exported  # per-expert names
    assert all(torch.equal(exported[key], original[key]) for key in original)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert HFModelDirectory(out).cfg == HFModelDirectory(hf[variant]).cfg
    with torch.no_grad():
        assert (theirs.eval()(IDS).logits - _theirs(hf[variant])[0]).abs().max() < 1e-5


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_greedy_generation_equals_transformers(hf, variant):
    prompt = IDS[:, :6]
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf[variant]).eval()
    theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt),
                                max_new_tokens=12, do_sample=False)
    assert torch.equal(meshtrain.load_model(hf[variant]).generate(prompt, 12), theirs)


LAYOUTS = {"tp2": {"tp": 2}, "ep2": {"dp": 2, "ep": 2}, "pp2": {"pp": 2}}


@pytest.mark.parametrize("variant,layout", [
    ("qwen3_moe", "ep2"),  # the default tier's case
    *(pytest.param(v, name, marks=pytest.mark.extended) for v in CONFIGS for name in LAYOUTS
      if (v, name) != ("qwen3_moe", "ep2"))])
def test_logits_and_chosen_experts_equal_transformers_across_ranks(hf, imported, variant,
                                                                  layout):
    expected, expected_chosen = _theirs(hf[variant])
    results = run_on_ranks(2, _logits_at, str(imported[variant]), IDS, LAYOUTS[layout])
    seen = set()
    for rank, (logits, chosen) in enumerate(results):
        if logits is not None:
            assert (logits - expected).abs().max().item() < 1e-5, (layout, rank)
        for layer, experts in chosen.items():
            assert torch.equal(experts, expected_chosen[layer]), (layout, rank, layer)
        seen |= chosen.keys()
    assert seen == expected_chosen.keys()


@pytest.mark.extended  # 4 ranks: the import, the layouts and the export are default cases
def test_training_an_imported_qwen3_moe_at_tp2_dp2_ep2_exports_to_transformers(imported, corpus,
                                                                               tmp_path):
    run, out, exported = imported["qwen3_moe"], tmp_path / "run", tmp_path / "hf"
    run_cli("train", "--init-from", str(run), "--nproc", "4", "--tp", "2", "--ep", "2",
            "--device", "cpu", "--data", corpus, "--seq-len", "16", "--global-batch", "4",
            "--micro-batch", "1", "--steps", "3", "--warmup-steps", "0", "--lr", "1e-2",
            "--eval-every", "0", "--out", str(out))
    assert main(["export", str(out), "--format", "hf", "--out", str(exported)]) == 0
    trained = meshtrain.load_model(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    with torch.no_grad():
        ours = trained(IDS)
        assert (ours - theirs(IDS).logits).abs().max() < 1e-5
        assert (ours - meshtrain.load_model(run)(IDS)).abs().max() > 1e-3  # it trained


@pytest.mark.parametrize("fields,named", [
    ({"attention_bias": True}, '"attention_bias"'),
    ({"layer_types": ["full_attention", "full_attention"]}, '"layer_types"'),
    ({"num_experts": 8}, '"num_experts" 8 and "num_local_experts" 4 differ'),
    ({"num_experts_per_tok": 5}, '"num_experts_per_tok" 5 exceeds'),
    ({"mlp_only_layers": [0, 1]}, '"mlp_only_layers" [0, 1] leave no MoE layer'),
    ({"head_dim": 0}, '"head_dim": 0'),
    ({"hidden_act": "gelu"}, '"hidden_act"'),
], ids=["attention_bias", "layer_types", "two_counts", "top_k", "no_moe_layer", "head_dim",
        "hidden_act"])
def test_unsupported_configs_are_one_line_errors(fields, named, tmp_path, capsys):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(CONFIGS["qwen3_moe"].to_dict() | fields))
    assert main(["import-hf", str(source), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


MODEL = {"model": "qwen3-moe-tiny", "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}
TRAINING = {  # name: (degrees, plan settings)
    "ep2": ({"dp": 2, "ep": 2}, {}),
    "ep2xdp2": ({"dp": 4, "ep": 2}, {}),
    "tp2xep2": ({"tp": 2, "dp": 2, "ep": 2}, {}),
    "pp2xep2": ({"pp": 2, "dp": 2, "ep": 2}, {}),
    "zero3xep2": ({"dp": 4, "ep": 2}, {"zero": 3}),
}


@pytest.fixture(scope="module")
def reference(corpus):
    return _reference(corpus, MODEL)


@pytest.mark.parametrize("layout,steps", [
    ("ep2", 2),  # the default tier's one case: 2 ranks, 2 steps (the others, 5)
    *(pytest.param(name, STEPS, marks=pytest.mark.extended) for name in TRAINING
      if name != "ep2")])
def test_qwen3_moe_trains_one_process_trajectory_and_choices(corpus, reference, layout, steps):
    degrees, parallel = TRAINING[layout]
    results = run_on_ranks(_world(degrees), _run, corpus, degrees, parallel, stop=steps,
                           model=MODEL, timeout=300)
    rows, choices = reference
    _assert_same_trajectory(layout, results[0][0], rows[:steps])
    _assert_same_choices(layout, [choices for _, choices in results],
                         {key: value for key, value in choices.items() if key[0] < steps})
