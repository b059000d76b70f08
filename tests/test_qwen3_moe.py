"""The Qwen3-MoE family (Qwen3's attention, narrow experts, no shared expert): presets with the
published sizes; Hugging Face interop against transformers' Qwen3MoeForCausalLM (logits and every
token's chosen experts at tp 1, ep 2, tp 2 and pp 2, import then export bitwise under the files'
per-expert names, greedy generation, refused fields); the 5-step trajectory and every token's
experts of one process at ep 2 x dp 2, tp 2 x ep 2, pp 2 x ep 2 and ZeRO-3 x ep 2 (the harness of
test_moe_layouts.py)."""

from pathlib import Path

import pytest
import torch
import transformers
from hf_models import (
    TINY,
    assert_chooses_as_transformers,
    assert_chooses_as_transformers_at,
    assert_exports_bitwise,
    assert_generates_as_transformers,
    assert_import_refused,
    expert_layout_cases,
    imported_fixture,
    move_head_norms,
    saved_fixture,
    theirs_with_experts,
    train_and_export,
)
from test_moe_layouts import (
    FAMILY_CASES,
    FAMILY_LAYOUTS,
    _reference,
    assert_trains_as_one_process,
    family_model,
)

from meshtrain.interop.hf_io import HFModelDirectory
from meshtrain.models import preset

BASE = TINY | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
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


hf = saved_fixture(CONFIGS, move_head_norms)


imported = imported_fixture()


def _theirs(path: Path) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    return theirs_with_experts(path, (ROUTER,))


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
    assert_chooses_as_transformers(hf[variant], imported[variant], (ROUTER,))


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_import_then_export_is_bitwise_and_loads_cleanly(hf, imported, variant, tmp_path):
    out = tmp_path / "hf"
    exported = assert_exports_bitwise(imported[variant], hf[variant], out)
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in exported  # per-expert names
    assert HFModelDirectory(out).cfg == HFModelDirectory(hf[variant]).cfg


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_greedy_generation_equals_transformers(hf, variant):
    assert_generates_as_transformers(hf[variant])


@pytest.mark.parametrize("variant,layout", expert_layout_cases(CONFIGS, "qwen3_moe"))
def test_logits_and_chosen_experts_equal_transformers_across_ranks(hf, imported, variant,
                                                                  layout):
    assert_chooses_as_transformers_at(layout, hf[variant], imported[variant], (ROUTER,))


@pytest.mark.extended  # 4 ranks: the import, the layouts and the export are default cases
def test_training_an_imported_qwen3_moe_at_tp2_dp2_ep2_exports_to_transformers(imported, corpus,
                                                                               tmp_path):
    train_and_export(imported["qwen3_moe"], tmp_path, corpus, "--tp", "2", "--ep", "2")


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
    assert_import_refused(CONFIGS["qwen3_moe"].to_dict() | fields, named, tmp_path, capsys)


MODEL = family_model("qwen3-moe-tiny")


@pytest.fixture(scope="module")
def reference_run(corpus):
    return _reference(corpus, MODEL)


@pytest.mark.parametrize("layout,steps", FAMILY_CASES)
def test_qwen3_moe_trains_one_process_trajectory_and_choices(corpus, reference_run, layout,
                                                            steps):
    assert_trains_as_one_process(corpus, reference_run, layout, *FAMILY_LAYOUTS[layout], steps,
                                 MODEL)
