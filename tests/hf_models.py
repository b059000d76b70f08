"""Tiny random Hugging Face models and their comparison with transformers, shared by every
family's interop tests: building and saving them offline from configs, importing them,
transformers' logits and chosen experts, ours at a parallel layout, export round trips, greedy
generation, refused configs and training an imported run."""

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
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
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model, pipeline_stage

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.1)
"""A Llama-shaped config's fields; the initializer range is larger than the default so that
rotary errors show in logits."""


def save_models(root: Path, configs: dict, adjust=None) -> dict[str, Path]:
    """Each config's model built by transformers from seed i (its order), passed to
    `adjust(name, model)` if given, and saved under root/name."""
    paths = {}
    for seed, (name, config) in enumerate(configs.items()):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if adjust:
            adjust(name, model)
        paths[name] = root / name
        model.save_pretrained(paths[name])
    return paths


def saved_fixture(configs: dict, adjust=None):
    """A module fixture `hf`: the configs' models saved by `save_models`."""
    @pytest.fixture(scope="module")
    def hf(tmp_path_factory) -> dict[str, Path]:
        return save_models(tmp_path_factory.mktemp("hf"), configs, adjust)
    return hf


def imported_fixture():
    """A module fixture `imported`: each directory of the module's `hf` fixture imported."""
    @pytest.fixture(scope="module")
    def imported(hf, tmp_path_factory) -> dict[str, Path]:
        return import_all(hf, tmp_path_factory.mktemp("runs"))
    return imported


def move_head_norms(_name: str, model) -> None:
    """Moves the query/key head norms off their initial ones (all 1), so that they count."""
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(("q_norm.weight", "k_norm.weight")):
                param.add_(0.3 * torch.randn_like(param))


def import_all(hf: dict[str, Path], root: Path) -> dict[str, Path]:
    """Each Hugging Face directory imported by the command line into root/name."""
    for name, path in hf.items():
        assert main(["import-hf", str(path), "--out", str(root / name)]) == 0
    return {name: root / name for name in hf}


def reference(path: Path):
    """transformers' model of a Hugging Face directory, in eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def max_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours - theirs).abs().max().item()


def theirs_with_experts(path: Path, routers: tuple) -> tuple[torch.Tensor, dict]:
    """transformers' logits of IDS and each MoE layer's chosen experts [T, k] (the third output
    of its router modules, of the `routers` classes)."""
    model = reference(path)
    chosen, hooks = {}, []
    for name, module in model.named_modules():
        if isinstance(module, routers):
            layer = int(name.split(".")[2])
            hooks.append(module.register_forward_hook(
                lambda _m, _a, out, layer=layer: chosen.__setitem__(layer, out[2])))
    with torch.no_grad():
        logits = model(IDS).logits
    for hook in hooks:
        hook.remove()
    return logits, chosen


@contextmanager
def recorded(model):
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


def assert_same(logits, chosen, expected, expected_chosen, where) -> None:
    """Logits within fp32 1e-5 and, on the layers recorded (some), the same experts."""
    assert max_difference(logits, expected) < 1e-5, where
    assert chosen.keys() <= expected_chosen.keys() and chosen, where
    for layer, experts in chosen.items():
        assert torch.equal(experts, expected_chosen[layer]), (where, layer)


def assert_chooses_as_transformers(source: Path, run: Path, routers: tuple) -> None:
    """`meshtrain.load_model` of the imported run and of the Hugging Face directory (fp32):
    transformers' logits and, on every MoE layer, its experts for every token."""
    expected, expected_chosen = theirs_with_experts(source, routers)
    for path in (run, source):
        model = meshtrain.load_model(path)
        with torch.no_grad(), recorded(model) as chosen:
            logits = model(IDS)
        assert_same(logits, chosen, expected, expected_chosen, path)


EXPERT_LAYOUTS = {"tp2": {"tp": 2}, "ep2": {"dp": 2, "ep": 2}, "pp2": {"pp": 2}}
"""The 2-rank layouts an MoE family's imported logits and choices are compared at."""


def expert_layout_cases(configs: dict, default: str) -> list:
    """(variant, layout) cases: `default` at ep 2 in the default tier, the others extended."""
    return [(default, "ep2"), *(pytest.param(v, name, marks=pytest.mark.extended)
                                for v in configs for name in EXPERT_LAYOUTS
                                if (v, name) != (default, "ep2"))]


def assert_chooses_as_transformers_at(layout: str, source: Path, run: Path,
                                      routers: tuple) -> None:
    """The imported run on 2 ranks at this layout: the logits where a rank has them, and every
    MoE layer's experts (each seen on some rank), as transformers'."""
    expected, expected_chosen = theirs_with_experts(source, routers)
    results = run_on_ranks(2, logits_and_experts_at, str(run), IDS, EXPERT_LAYOUTS[layout])
    seen = set()
    for rank, (logits, chosen) in enumerate(results):
        if logits is not None:
            assert max_difference(logits, expected) < 1e-5, (layout, rank)
        for layer, experts in chosen.items():
            assert torch.equal(experts, expected_chosen[layer]), (layout, rank, layer)
        seen |= chosen.keys()
    assert seen == expected_chosen.keys()


def _loaded_stage(run: str, degrees: dict):
    """This rank's stage of the run's model at this layout, loaded."""
    mesh = worker_mesh(**degrees)
    path = resolve_checkpoint(run)
    cfg = checkpoint_config(path)
    stage = pipeline_stage(cfg.num_layers, ParallelPlan(**degrees), mesh)
    model = build_model(cfg, mesh, stage=stage).eval()
    load_checkpoint(path, model=model, mesh=mesh)
    return model, stage, mesh, cfg.hidden_size


def _stage_logits(model, stage, mesh, hidden_size: int, ids: torch.Tensor):
    """The whole model's logits (at the last of at most two pipeline stages; the first: None)."""
    if stage.has_embedding and stage.has_head:
        return model.full_logits(model(ids))
    if stage.has_embedding:
        comm.send(model(ids), mesh.pp, 1).wait()
        return None
    hidden = torch.empty(*ids.shape, hidden_size)
    comm.recv(hidden, mesh.pp, 0)
    return model.full_logits(model(hidden, torch.arange(ids.shape[1])))


def logits_at(run: str, ids: torch.Tensor, degrees: dict) -> torch.Tensor | None:
    """The whole model's logits at this layout (the last pipeline stage returns them)."""
    model, *placement = _loaded_stage(run, degrees)
    with torch.no_grad():
        return _stage_logits(model, *placement, ids)


def logits_and_experts_at(run: str, ids: torch.Tensor, degrees: dict):
    """`logits_at`, and this rank's chosen experts by MoE layer."""
    model, *placement = _loaded_stage(run, degrees)
    with torch.no_grad(), recorded(model) as chosen:
        return _stage_logits(model, *placement, ids), chosen


def assert_exports_bitwise(run: Path, source: Path, out: Path) -> dict[str, torch.Tensor]:
    """The run exported to `out` holds the tensors of `source`'s model.safetensors bitwise
    under their names, and transformers loads it with no key missing, unexpected or
    mismatched, to the logits of `source`. Returns the exported tensors."""
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    original, exported = (load_file(d / "model.safetensors") for d in (source, out))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[key], original[key]) for key in original)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    with torch.no_grad():
        assert max_difference(theirs.eval()(IDS).logits, reference(source)(IDS).logits) < 1e-5
    return exported


def greedy_of_transformers(path: Path, prompt: torch.Tensor, tokens: int = 12) -> torch.Tensor:
    """transformers' greedy continuation of `prompt` by `tokens` tokens."""
    return reference(path).generate(prompt, attention_mask=torch.ones_like(prompt),
                                    max_new_tokens=tokens, do_sample=False)


def assert_generates_as_transformers(path: Path) -> None:
    """`load_model(path).generate` continues IDS' first 6 tokens greedily as transformers."""
    prompt = IDS[:, :6]
    assert torch.equal(meshtrain.load_model(path).generate(prompt, 12),
                       greedy_of_transformers(path, prompt))


def assert_import_refused(config: dict, named: str, tmp_path: Path, capsys) -> None:
    """import-hf of a directory holding only this config.json fails in one line naming
    `named`, writing no run."""
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", str(source), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def train_and_export(run: Path, tmp_path: Path, corpus: str, *layout: str):
    """3 steps of training from an imported run on 4 cpu ranks at `layout` (command flags) into
    tmp_path/run, exported to tmp_path/hf: transformers loads the export with no key missing,
    unexpected or mismatched, to the trained logits, which moved. Returns the trained model and
    the two directories."""
    out, exported = tmp_path / "run", tmp_path / "hf"
    run_cli("train", "--init-from", str(run), "--nproc", "4", *layout, "--device", "cpu",
            "--data", corpus, "--seq-len", "16", "--global-batch", "4", "--micro-batch", "1",
            "--steps", "3", "--warmup-steps", "0", "--lr", "1e-2", "--eval-every", "0",
            "--out", str(out))
    assert main(["export", str(out), "--format", "hf", "--out", str(exported)]) == 0
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(exported,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    trained = meshtrain.load_model(out)
    with torch.no_grad():
        ours = trained(IDS)
        assert max_difference(ours, theirs.eval()(IDS).logits) < 1e-5
        assert max_difference(ours, meshtrain.load_model(run)(IDS)) > 1e-3  # it trained
    return trained, out, exported
