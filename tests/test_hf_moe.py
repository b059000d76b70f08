"""Hugging Face MoE families against transformers itself: Mixtral and Qwen2-MoE imported, their
logits and every token's chosen experts equal to transformers' at tp 1, tp 2, ep 2 and pp 2,
import then export bitwise under the files' per-expert names, greedy generation token for
token, refused config fields, and training after import then export loading in transformers.
Tiny random models are built offline from configs."""

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from harness import run_cli, run_on_ranks, worker_mesh
from safetensors.torch import load_file

import meshtrain
import meshtrain.parallel.layers.expert as expert_layer
from meshtrain.checkpointing.checkpoint import (
    checkpoint_config,
    load_checkpoint,
    resolve_checkpoint,
)
from meshtrain.cli.main import main
from meshtrain.interop.hf_io import HFModelDirectory, hf_mapping
from meshtrain.models import preset
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model, pipeline_stage

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
BASE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.1)
QWEN = BASE | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                   shared_expert_intermediate_size=48)
CONFIGS = {
    # Mixtral: 4 full-width experts, top 2 renormalised, every layer; a window of 8
    "mixtral": transformers.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2,
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
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for seed, (name, config) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed)
        paths[name] = root / name
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(paths[name])
    (paths["mixtral"] / "tokenizer.json").write_text(_numbered_tokenizer())
    return paths


def _numbered_tokenizer() -> str:
    """A tokenizer.json whose token i is the word `t{i}`: text names ids exactly."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"t{i}": i for i in range(256)}, unk_token="t0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return tokenizer.to_str()


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
        if isinstance(module, ROUTERS):
            layer = int(name.split(".")[2])
            hooks.append(module.register_forward_hook(
                lambda _m, _a, out, layer=layer: chosen.__setitem__(layer, out[2])))
    with torch.no_grad():
        logits = model(IDS).logits
    for hook in hooks:
        hook.remove()
    return logits, chosen


@contextmanager
def _recorded(model):
    """Each MoE layer's chosen experts [T, k] while in the block, by model layer index."""
    chosen, current = {}, {}
    hooks = [module.register_forward_pre_hook(
        lambda m, _args: current.__setitem__("layer", m.layer))
        for module in model.modules() if isinstance(module, MoE)]
    route = expert_layer.route

    def recording(logits, rule, **kwargs):
        routing = route(logits, rule, **kwargs)
        chosen[current["layer"]] = routing.experts
        return routing

    expert_layer.route = recording
    try:
        yield chosen
    finally:
        expert_layer.route = route
        for hook in hooks:
            hook.remove()


def _assert_same(logits, chosen, expected, expected_chosen, where) -> None:
    assert (logits - expected).abs().max().item() < 1e-5, where
    assert chosen.keys() <= expected_chosen.keys() and chosen, where
    for layer, experts in chosen.items():
        assert torch.equal(experts, expected_chosen[layer]), (where, layer)


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


@pytest.mark.extended  # a 2-rank command: `load_model().generate` above is the default case
def test_sample_command_is_greedy_generation_of_transformers_at_tp2(hf, imported):
    prompt = IDS[:1, :6]
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf["mixtral"]).eval()
    theirs = reference.generate(prompt, attention_mask=torch.ones_like(prompt),
                                max_new_tokens=12, do_sample=False)
    sample = run_cli("sample", str(imported["mixtral"]), "--prompt",
                     " ".join(f"t{i}" for i in prompt[0].tolist()), "--top-k", "0",
                     "--max-new-tokens", "12", "--nproc", "2", "--tp", "2", "--device", "cpu")
    assert [int(word[1:]) for word in sample.stdout.split()] == theirs[0].tolist()


def _logits_at(run: str, ids: torch.Tensor, degrees: dict):
    """The whole model's logits at this layout (the last pipeline stage returns them; the
    first None) and this rank's chosen experts."""
    mesh = worker_mesh(**degrees)
    path = resolve_checkpoint(run)
    cfg = checkpoint_config(path)
    stage = pipeline_stage(cfg.num_layers, ParallelPlan(**degrees), mesh)
    model = build_model(cfg, mesh, stage=stage).eval()
    load_checkpoint(path, model=model, mesh=mesh)
    with torch.no_grad(), _recorded(model) as chosen:
        if stage.has_embedding and stage.has_head:
            return model.full_logits(model(ids)), chosen
        if stage.has_embedding:
            comm.send(model(ids), mesh.pp, 1).wait()
            return None, chosen
        hidden = torch.empty(*ids.shape, cfg.hidden_size)
        comm.recv(hidden, mesh.pp, 0)
        return model.full_logits(model(hidden, torch.arange(ids.shape[1]))), chosen


LAYOUTS = {"tp2": {"tp": 2}, "ep2": {"dp": 2, "ep": 2}, "pp2": {"pp": 2}}


@pytest.mark.parametrize("variant,layout", [
    ("qwen2_moe", "ep2"),  # the default tier's case
    *(pytest.param(v, name, marks=pytest.mark.extended) for v in CONFIGS for name in LAYOUTS
      if (v, name) != ("qwen2_moe", "ep2"))])
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


def _hf_config(base: str, **fields) -> dict:
    return CONFIGS[base].to_dict() | fields


@pytest.mark.parametrize("base,fields,named", [
    ("mixtral", {"router_jitter_noise": 0.1}, '"router_jitter_noise": 0.1'),
    ("mixtral", {"num_experts_per_tok": 5}, '"num_experts_per_tok" 5 exceeds'),
    ("mixtral", {"num_local_experts": 0}, '"num_local_experts": 0'),
    ("mixtral", {"head_dim": 16}, '"head_dim": 16'),
    ("qwen2_moe", {"use_sliding_window": True}, '"use_sliding_window": True'),
    ("qwen2_moe", {"layer_types": ["sliding_attention", "full_attention"]}, '"layer_types"'),
    ("qwen2_moe", {"mlp_only_layers": [0, 1]}, '"mlp_only_layers" [0, 1] leave no MoE layer'),
    ("qwen2_moe", {"mlp_only_layers": "0"}, '"mlp_only_layers": \'0\''),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, '"shared_expert_intermediate_size"'),
    ("qwen2_moe", {"norm_topk_prob": "yes"}, '"norm_topk_prob"'),
    ("qwen2_moe", {"output_router_logits": 1}, '"output_router_logits"'),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_configs_are_one_line_errors(base, fields, named, tmp_path, capsys):
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(_hf_config(base, **fields)))
    assert main(["import-hf", str(source), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


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
    run, out, exported = imported["qwen2_moe"], tmp_path / "run", tmp_path / "hf"
    run_cli("train", "--init-from", str(run), "--nproc", "4", "--tp", "2", "--device", "cpu",
            "--data", corpus, "--seq-len", "16", "--global-batch", "4", "--micro-batch", "1",
            "--steps", "3", "--warmup-steps", "0", "--lr", "1e-2", "--eval-every", "0",
            "--out", str(out))
    assert main(["export", str(out), "--format", "hf", "--out", str(exported)]) == 0
    _, info = transformers.AutoModelForCausalLM.from_pretrained(exported,
                                                               output_loading_info=True)
    assert not any(info.values()), info
    trained = meshtrain.load_model(out)
    with torch.no_grad(), _recorded(trained) as chosen:
        ours = trained(IDS)
    expected, expected_chosen = _theirs(exported)
    _assert_same(ours, chosen, expected, expected_chosen, "trained")
    with torch.no_grad():
        assert (ours - meshtrain.load_model(run)(IDS)).abs().max() > 1e-3  # it trained
