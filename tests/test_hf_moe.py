"""Hugging Face MoE families against transformers itself: Mixtral and Qwen2-MoE imported, their
logits and every token's chosen experts equal to transformers' at tp 1, tp 2, ep 2 and pp 2,
import then export bitwise under the files' per-expert names, greedy generation token for
token, refused config fields, and training after import then export loading in transformers.
Tiny random models are built offline from configs."""

from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from harness import run_cli
from hf_models import (
    IDS,
    TINY,
    assert_chooses_as_transformers,
    assert_chooses_as_transformers_at,
    assert_exports_bitwise,
    assert_generates_as_transformers,
    assert_import_refused,
    assert_same,
    expert_layout_cases,
    greedy_of_transformers,
    imported_fixture,
    recorded,
    save_models,
    theirs_with_experts,
    train_and_export,
)

from meshtrain.interop.hf_io import HFModelDirectory, hf_mapping
from meshtrain.models import preset

QWEN = TINY | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=48)
CONFIGS = {
    # Mixtral: 4 full-width experts, top 2 renormalised, every layer; a window of 8
    "mixtral": transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=8),
    # Qwen2-MoE: narrow experts, a gated shared expert, layer 0 dense; weights as they are
    "qwen2_moe": transformers.Qwen2MoeConfig(**QWEN, mlp_only_layers=[0]),
    # ... and top 3 renormalised on every second layer (decoder_sparse_step)
    "qwen2_moe_step": transformers.Qwen2MoeConfig(**QWEN | {"num_experts_per_tok": 3},
                                                  norm_topk_prob=True, decoder_sparse_step=2),
}
ROUTERS = (transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter,
           transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    paths = save_models(tmp_path_factory.mktemp("hf"), CONFIGS)
    (paths["mixtral"] / "tokenizer.json").write_text(_numbered_tokenizer())
    return paths


def _numbered_tokenizer() -> str:
    """A tokenizer.json whose token i is the word `t{i}`: text names ids exactly."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(256)}, unk_token="t0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return tokenizer.to_str()


imported = imported_fixture()


def _theirs(path: Path) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    return theirs_with_experts(path, ROUTERS)


def test_configs_import_as_the_family_settings(hf):
    mixtral = HFModelDirectory(hf["mixtral"]).cfg
    assert (mixtral.moe_experts, mixtral.moe_top_k, mixtral.moe_norm_topk_prob,
            mixtral.num_moe_layers(), mixtral.sliding_window, mixtral.moe_capacity_factor) == \
        (4, 2, True, 2, 8, 0.0)
    qwen = HFModelDirectory(hf["qwen2_moe"]).cfg
    assert (qwen.moe_layer_indices(), qwen.expert_ffn_size, qwen.moe_shared_ffn_size,
            qwen.moe_shared_gate, qwen.moe_norm_topk_prob, qwen.qkv_bias, qwen.ffn_size) == \
        ((1,), 16, 48, "sigmoid", False, True, 64)
    step = HFModelDirectory(hf["qwen2_moe_step"]).cfg
    assert (step.moe_every, step.moe_layer_indices(), step.moe_top_k) == (2, (1,), 3)
    assert qwen.moe_aux_loss_coef == 0.0  # transformers adds none without output_router_logits
    unbiased = hf_mapping("qwen2_moe").config_from_hf(_hf_config("qwen2_moe", qkv_bias=False))
    assert not unbiased.qkv_bias and hf_mapping("qwen2_moe").config_to_hf(unbiased)["qkv_bias"] \
        is False


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_logits_and_chosen_experts_equal_transformers(hf, imported, variant):
    """`meshtrain.load_model` of the run and of the Hugging Face directory (fp32)."""
    assert_chooses_as_transformers(hf[variant], imported[variant], ROUTERS)


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_import_then_export_is_bitwise_and_loads_cleanly(hf, imported, variant, tmp_path):
    out = tmp_path / "hf"
    assert_exports_bitwise(imported[variant], hf[variant], out)
    assert HFModelDirectory(out).cfg == HFModelDirectory(hf[variant]).cfg


@pytest.mark.parametrize("variant", list(CONFIGS))
def test_greedy_generation_equals_transformers(hf, variant):
    assert_generates_as_transformers(hf[variant])


@pytest.mark.extended  # a 2-rank command: `load_model().generate` above is the default case
def test_sample_command_is_greedy_generation_of_transformers_at_tp2(hf, imported):
    prompt = IDS[:1, :6]
    theirs = greedy_of_transformers(hf["mixtral"], prompt)
    sample = run_cli("sample", str(imported["mixtral"]), "--prompt",
                     " ".join(f"t{i}" for i in prompt[0].tolist()), "--top-k", "0",
                     "--max-new-tokens", "12", "--nproc", "2", "--tp", "2", "--device", "cpu")
    assert [int(word[1:]) for word in sample.stdout.split()] == theirs[0].tolist()


@pytest.mark.parametrize("variant,layout", expert_layout_cases(CONFIGS, "qwen2_moe"))
def test_logits_and_chosen_experts_equal_transformers_across_ranks(hf, imported, variant,
                                                                  layout):
    assert_chooses_as_transformers_at(layout, hf[variant], imported[variant], ROUTERS)


def _hf_config(base: str, **fields) -> dict:
    return CONFIGS[base].to_dict() | fields


@pytest.mark.parametrize("base,fields,named", [
    ("mixtral", {"router_jitter_noise": 0.1}, '"router_jitter_noise": 0.1'),
    ("mixtral", {"num_experts_per_tok": 5}, '"num_experts_per_tok" 5 exceeds'),
    ("mixtral", {"num_local_experts": 0}, '"num_local_experts": 0'),
    ("mixtral", {"head_dim": 0}, '"head_dim": 0'),  # (16 imports as `head_size`)
    ("qwen2_moe", {"use_sliding_window": True}, '"use_sliding_window": True'),
    ("qwen2_moe", {"layer_types": ["sliding_attention", "full_attention"]}, '"layer_types"'),
    ("qwen2_moe", {"mlp_only_layers": [0, 1]}, '"mlp_only_layers" [0, 1] leave no MoE layer'),
    ("qwen2_moe", {"mlp_only_layers": "0"}, '"mlp_only_layers": \'0\''),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, '"shared_expert_intermediate_size"'),
    ("qwen2_moe", {"norm_topk_prob": "yes"}, '"norm_topk_prob"'),
    ("qwen2_moe", {"output_router_logits": 1}, '"output_router_logits"'),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_configs_are_one_line_errors(base, fields, named, tmp_path, capsys):
    assert_import_refused(_hf_config(base, **fields), named, tmp_path, capsys)


def test_the_balancing_loss_coefficient_and_what_cannot_be_exported(hf, tmp_path):
    """transformers' pooled loss weighs "router_aux_loss_coef" x k / MoE layers per layer; an
    export writes it back. Routing transformers does not compute is not exported."""
    config = _hf_config("qwen2_moe_step", output_router_logits=True, router_aux_loss_coef=0.02)
    mapping = hf_mapping("qwen2_moe")
    cfg = mapping.config_from_hf(config)
    assert cfg.moe_aux_loss_coef == pytest.approx(0.02 * 3 / 1)
    assert mapping.config_to_hf(cfg)["router_aux_loss_coef"] == pytest.approx(0.02)
    for family, name, fields, named in (
            ("mixtral", "mixtral-tiny", {"moe_layers": (1, 3)}, "a dense layer"),
            ("mixtral", "mixtral-tiny", {"moe_norm_topk_prob": False}, "unnormalised"),
            ("mixtral", "mixtral-tiny", {"moe_score": "sigmoid"}, "`moe_score` 'sigmoid'"),
            ("qwen2_moe", "qwen2-moe-tiny", {"moe_bias_rate": 0.01}, "`moe_bias_rate` 0.01"),
            ("qwen2_moe", "qwen2-moe-tiny", {"moe_shared_ffn_size": 0, "moe_shared_gate": None},
             "no sigmoid-gated shared expert")):
        with pytest.raises(ValueError, match=named):
            hf_mapping(family).config_to_hf(preset(name, **fields))


def test_presets_have_the_published_shapes():
    big = preset("mixtral-8x7b")
    assert round(big.num_parameters() / 1e9, 1) == 46.7  # Mixtral's published total
    active = big.matmul_parameters_per_token() + big.vocab_size * big.hidden_size
    assert round(active / 1e9, 1) == 12.9  # active, the embedding counted as Mistral does
    qwen = preset("qwen1.5-moe-a2.7b")
    assert round(qwen.num_parameters() / 1e9, 1) == 14.3  # Qwen's published total
    assert qwen.moe_layer_indices() == tuple(range(24)) and qwen.qkv_bias


@pytest.mark.extended  # 4 ranks training: the import, training and export paths at once
def test_training_after_import_at_tp2_dp2_exports_to_transformers(imported, corpus, tmp_path):
    trained, _, exported = train_and_export(imported["qwen2_moe"], tmp_path, corpus, "--tp", "2")
    with torch.no_grad(), recorded(trained) as chosen:
        ours = trained(IDS)
    expected, expected_chosen = _theirs(exported)
    assert_same(ours, chosen, expected, expected_chosen, "trained")
