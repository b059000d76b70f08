"""2D, 2.5D and 3D tensor parallelism in whole training runs: loss trajectories equal the 1D
run's, with data and pipeline parallelism and ZeRO; checkpoints move between schemes; model
states and activations per rank are the schemes' fractions of one process's; bad grids are
refused with the fix; `export` writes the same tensors from every scheme. Layer- and
model-level fp64 parity and byte counts are in test_tp_summa.py (2d, 2.5d) and
test_tp_cube.py (3d).

Eight-rank runs are the slow part: this file keeps them to one trajectory call per model; the
2.5d checkpoint and memory cases are marked `extended` (run with `pytest -m extended`)."""

from pathlib import Path

import pytest
import torch
from harness import LLAMA, raises_as_flags, run_cli, run_on_ranks, worker_mesh
from safetensors.torch import load_file

from meshtrain.checkpointing.model_files import export_safetensors
from meshtrain.checkpointing.verify import resolve_checkpoint
from meshtrain.cli.main import _train_config, main
from meshtrain.cli.parsers import build_parser
from meshtrain.config.run_config import build_config
from meshtrain.memory import saved_activation_bytes
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.training.trainer import Trainer

STEPS = 4
GRIDS = {"2d": dict(tp=4, tp_scheme="2d"), "2.5d": dict(tp=8, tp_scheme="2.5d", tp_depth=2),
         "3d": dict(tp=8, tp_scheme="3d")}


def _config(corpus, out, model=None, **parallel):
    return build_config({}, {
        "model": {"num_layers": 2} | (model or {}),
        "train": {"steps": 20, "global_batch": 8, "micro_batch": 4, "seq_len": 16, "seed": 1,
                  "lr": 3e-3, "warmup_steps": 1, "eval_every": 0},
        "parallel": {"device": "cpu"} | parallel, "data": {"data": corpus},
        "checkpoint": {"out": out}})


def _trainer(corpus, out, model, layout):
    mesh_degrees = {k: v for k, v in layout.items() if k not in ("zero", "pp_schedule")}
    settings = {k: v for k, v in layout.items() if k not in ("dp",)}
    return Trainer.build(_config(corpus, out, model, **settings), worker_mesh(**mesh_degrees))


def _losses(corpus, out, model, layouts):
    """Each layout's first STEPS losses, run one after another on the same ranks."""
    result = []
    for layout in layouts:
        trainer = _trainer(corpus, out, model, layout)
        result.append([trainer.train_step(step)["loss"] for step in range(STEPS)])
    return result


@pytest.mark.parametrize("model", [
    None,
    # Llama on the grids: its whole-model fp64 parity (test_tp_summa, test_tp_cube) and its
    # fp64 step at 2d x dp 2 (test_train) run by default
    pytest.param(LLAMA | {"num_kv_heads": 2}, marks=pytest.mark.extended)], ids=["gpt", "llama"])
def test_trajectories_equal_the_1d_run(corpus, tmp_path, model):
    """fp32 losses of 2d (with pp 2 and ZeRO-1), 2.5d and 3d equal 1D tp 2's at every step
    (2d's gradient parity alone, with dp 2 and with pp 2: test_tp_summa.py, test_train.py,
    test_pipeline.py)."""
    reference = run_on_ranks(2, _losses, corpus, str(tmp_path), model, [{"tp": 2}])[0][0]
    layouts = [GRIDS["2d"] | {"pp": 2, "zero": 1}, GRIDS["2.5d"], GRIDS["3d"]]
    runs = run_on_ranks(8, _losses, corpus, str(tmp_path), model, layouts)[0]
    for layout, losses in zip(layouts, runs, strict=True):
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        assert rel < 1e-4, (layout, losses, reference)


def _save_and_go_on(corpus, out, layout):
    """Three steps' losses at `layout`, with a checkpoint after the second."""
    trainer = _trainer(corpus, out, None, layout)
    losses = [trainer.train_step(step)["loss"] for step in range(2)]
    trainer.save(Path(out), 2)
    losses.append(trainer.train_step(2)["loss"])
    return losses


def _resume(corpus, out, layout, again):
    """Resume `out` at `layout`, save the loaded weights again into `again`, take one step."""
    trainer = _trainer(corpus, out, None, layout)
    assert trainer.resume(Path(out)) == 2
    trainer.save(Path(again), 2)
    return trainer.train_step(2)["loss"]


def _exported(run: Path, out: Path) -> dict:
    export_safetensors(resolve_checkpoint(run), out)
    return load_file(out)


@pytest.mark.parametrize("saved,resumed", [
    ("3d", "1d"), pytest.param("2.5d", "1d", marks=pytest.mark.extended), ("2d", "3d")])
def test_checkpoints_move_between_schemes(corpus, tmp_path, saved, resumed):
    """A checkpoint saved at one scheme resumes at another and continues the trajectory, and
    `export` of it writes the same tensors as an export of those weights saved at the other."""
    layout, again = GRIDS[saved], tmp_path / "again"
    whole = run_on_ranks(layout["tp"], _save_and_go_on, corpus, str(tmp_path), layout)[0]
    target = GRIDS.get(resumed, {"tp": 2})
    loss = run_on_ranks(target["tp"], _resume, corpus, str(tmp_path), target, str(again))[0]
    assert abs(loss - whole[2]) / whole[2] < 1e-4
    exported = _exported(tmp_path, tmp_path / "saved.safetensors")
    reference = _exported(again, tmp_path / "again.safetensors")
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[name], reference[name]) for name in reference)


def _memory(corpus, out, layout):
    trainer = _trainer(corpus, out, LLAMA, layout)
    model = trainer.model
    inputs, targets = trainer.train_data.micro_batches(0, dp_rank=0, dp_size=1)[0]
    saved, _ = saved_activation_bytes(lambda: model.loss(model(inputs), targets),
                                      model.parameters())
    trainer.train_step(0)
    return trainer.sync.memory_report(), saved


@pytest.mark.parametrize("scheme,states_split,activations_split",
                         [("2d", 4, 4), pytest.param("2.5d", 4, 8, marks=pytest.mark.extended),
                          pytest.param("3d", 8, 8, marks=pytest.mark.extended)])
def test_model_states_and_activations_per_rank(corpus, tmp_path, scheme, states_split,
                                               activations_split):
    """Parameters, gradients and Adam states per rank are 1/q^2 (2d, 2.5d: replicated over
    depth) or 1/q^3 (3d) of one process's, and the activations saved for backward 1/q^2,
    1/(d q^2) and 1/q^3, within 10% (Llama: every weight is a matrix or the small norms;
    GPT's learned position table and biases are split q ways only)."""
    layout = GRIDS[scheme]
    dense_states, dense_saved = run_on_ranks(1, _memory, corpus, str(tmp_path), {})[0]
    states, saved = run_on_ranks(layout["tp"], _memory, corpus, str(tmp_path), layout)[0]
    for kind, value in states.items():
        assert value == pytest.approx(dense_states[kind] / states_split, rel=0.1), kind
    assert saved == pytest.approx(dense_saved / activations_split, rel=0.1)


def test_grids_that_do_not_fit_are_refused_with_the_fix():
    model = _config("unused", "unused").model_config(256)
    with raises_as_flags(r"--tp-scheme 2d arranges tp as a q\^2 grid: --tp 8 is not one"):
        ParallelPlan(tp=8, tp_scheme="2d").validate(model, world_size=8, global_batch=8,
                                                    seq_len=16)
    with raises_as_flags(r"--micro-batch 2 must be divisible by 4: --tp-scheme 3d"):
        ParallelPlan(tp=8, tp_scheme="3d", micro_batch=2).validate(
            model, world_size=8, global_batch=8, seq_len=16)
    with raises_as_flags("--tp-scheme 2d does not combine with --sequence-parallel"):
        ParallelPlan(tp=4, tp_scheme="2d", sequence_parallel=True, micro_batch=2).validate(
            model, world_size=4, global_batch=8, seq_len=16)
    with raises_as_flags("--tp-depth applies to --tp-scheme 2.5d only"):
        ParallelPlan(tp=4, tp_scheme="2d", tp_depth=1).validate(model, world_size=4,
                                                                global_batch=8, seq_len=16)


@pytest.mark.extended
def test_command_line_trains_at_2d_and_exports(corpus, tmp_path):
    """The flags end to end on four launched ranks (eight-rank runs of the CLI cost a minute
    here). Extended: the default run trains every scheme through the same Trainer
    (`test_trajectories_equal_the_1d_run`), launches ranks in test_cli.py, and parses these
    flags below."""
    out = tmp_path / "run"
    run = run_cli("train", "--nproc", "4", "--tp", "4", "--tp-scheme", "2d", "--model",
                  "llama-tiny", "--num-layers", "1", "--device", "cpu", "--data", corpus,
                  "--seq-len", "16", "--global-batch", "4", "--micro-batch", "4", "--steps",
                  "2", "--eval-every", "0", "--out", str(out))
    assert run.returncode == 0
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert sum('"loss"' in row for row in rows) == 2
    assert main(["export", str(out), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert (tmp_path / "model.safetensors").stat().st_size > 0


def test_command_line_takes_the_scheme_flags(corpus, tmp_path, capsys):
    flags = ["train", "--tp", "4", "--tp-scheme", "2.5d", "--tp-depth", "1", "--device", "cpu",
             "--data", corpus, "--out", str(tmp_path / "run")]
    plan = _train_config(build_parser().parse_args(flags)).plan
    assert (plan.tp, plan.tp_scheme, plan.tp_depth) == (4, "2.5d", 1)
    assert main(["train", "--nproc", "8", "--tp", "8", "--tp-scheme", "2d", "--device", "cpu",
                 "--data", corpus, "--out", str(tmp_path / "bad")]) == 2  # before any rank
    err = capsys.readouterr().err
    assert "--tp-scheme 2d arranges tp as a q^2 grid" in err and len(err.splitlines()) == 1
