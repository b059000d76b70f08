"""Runs that cannot go on end with one line and a documented exit code: a non-finite loss or
gradient norm (caught on every rank together, nothing non-finite saved), input that is not
text or tokens, an `out` that cannot be written, a damaged metrics file on resume."""

import math
import signal
import time

import numpy as np
import pytest
import torch
from harness import run_cli, run_on_ranks, start_cli, worker_mesh
from safetensors.torch import load_file

from meshtrain.checkpointing.checkpoint import latest_checkpoint
from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.config.settings import LoggingSettings
from meshtrain.operations.failures import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_NONFINITE, RunFailure
from meshtrain.training.metrics import MetricsLog, metric_sinks, read_metrics
from meshtrain.training.trainer import Trainer

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "16",
        "--global-batch", "4", "--micro-batch", "4", "--eval-every", "0", "--log-every", "1"]
# AdamW at this rate blows the weights up in one step: step 2's loss is NaN.
DIVERGING = ["--lr", "1e6", "--warmup-steps", "0", "--steps", "6", "--save-every", "1"]


def _one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert lines and "Traceback" not in result.stderr, result.stderr
    return lines[-1]


def _refused(capsys, *args: str) -> str:
    """The one line `meshtrain ARGS` refuses with, before any rank starts (run in this process:
    what it checks happens before the launcher; the command-line tests cover the process)."""
    capsys.readouterr()
    assert main(list(args)) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def _all_finite(checkpoint) -> bool:
    return all(torch.isfinite(t).all() for f in checkpoint.glob("rank_*.safetensors")
               for t in load_file(str(f)).values() if t.is_floating_point())


def test_a_nonfinite_step_stops_the_run_unsaved_and_names_the_last_good_checkpoint(
        corpus, tmp_path):
    out = tmp_path / "run"
    result = run_cli("train", *TINY, *DIVERGING, "--data", corpus, "--out", str(out),
                     check=False)
    assert result.returncode == EXIT_NONFINITE, result.stderr
    line = _one_line(result)
    assert line.startswith("meshtrain: step 2: loss nan") and "step_00000001" in line, line
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert _all_finite(latest_checkpoint(out / "checkpoints"))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["nonfinite"] == 1


def test_a_stop_inside_a_nonfinite_streak_saves_nothing(corpus, tmp_path):
    """SIGTERM (a real signal, to a real process) while every step is non-finite and skipped:
    exit 3, one line naming the checkpoint saved before the streak; nothing saved inside it
    although `--save-every 1` and a stop would each save."""
    out = tmp_path / "run"
    proc = start_cli("train", *TINY, *DIVERGING, "--steps", "100000", "--max-nonfinite-steps",
                     "100000", "--data", corpus, "--out", str(out))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
        if sum(r.get("nonfinite", 0) for r in rows) >= 3:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert proc.returncode == 3 and "Traceback" not in err, err
    assert "inside" in lines[-1] and "non-finite step(s) in a row, without saving" in lines[-1]
    rows = read_metrics(out / "metrics.jsonl")
    good = max(r["step"] for r in rows if not r.get("nonfinite"))  # the step before the streak
    assert all(r.get("nonfinite") for r in rows if r["step"] > good) and rows[-1]["step"] > good
    last = out / "checkpoints" / f"step_{good:08d}"
    assert lines[-1].endswith(f"the last good checkpoint is {last}"), lines[-1]
    assert max(p.name for p in (out / "checkpoints").glob("step_*")) == last.name


def _in_process(capsys, *args: str) -> tuple[int, str]:
    """`meshtrain ARGS` of one rank run in this process: its exit code and stderr (the case
    above runs a failing run as a process)."""
    capsys.readouterr()
    code = main(list(args))
    return code, capsys.readouterr().err


def test_allowed_nonfinite_steps_are_skipped_and_never_saved(capsys, corpus, tmp_path):
    out = tmp_path / "run"
    code, err = _in_process(capsys, "train", *TINY, *DIVERGING, "--max-nonfinite-steps", "3",
                            "--data", corpus, "--out", str(out))
    assert code == EXIT_NONFINITE and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("meshtrain: step 4: loss nan")
    rows = read_metrics(out / "metrics.jsonl")
    assert [(r["step"], r["skipped"], r.get("nonfinite", 0)) for r in rows] == [
        (1, 0, 0), (2, 1, 1), (3, 1, 1), (4, 1, 1)]
    # `--save-every 1` saves nothing inside the streak: the last good checkpoint named is the
    # last one saved before it began
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == ["step_00000001"] and _all_finite(saved[0])
    assert f"the last good checkpoint is {saved[0]}." in line, line


def test_a_streak_reaching_the_last_step_is_not_saved(capsys, corpus, tmp_path):
    """Fewer non-finite steps than allowed, but the run ends inside them: no final checkpoint
    of a step in the streak; exit 5 names the one saved before it."""
    out = tmp_path / "run"
    code, err = _in_process(capsys, "train", *TINY, *DIVERGING, "--steps", "3",
                            "--max-nonfinite-steps", "5", "--data", corpus, "--out", str(out))
    line = err.strip().splitlines()[-1]
    assert code == EXIT_NONFINITE and line.startswith("meshtrain: step 3: loss nan"), err
    assert f"the last good checkpoint is {out / 'checkpoints' / 'step_00000001'}." in line
    assert [p.name for p in (out / "checkpoints").glob("step_*")] == ["step_00000001"]


def _steps_with_poison(cfg, degrees: dict, poisoned_rank: int) -> list[tuple]:
    """Two steps; in the second, one parameter's gradient on `poisoned_rank` turns NaN. Returns
    per step (nonfinite flag, skipped flag, whether this rank's weights are unchanged)."""
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    param = next(trainer.model.parameters())
    rows = []
    for step in (0, 1):
        if step == 1 and trainer.mesh.rank == poisoned_rank:
            param.register_hook(lambda grad: torch.full_like(grad, math.nan))
        before = [p.detach().clone() for p in trainer.model.parameters()]
        row = trainer.train_step(step)
        same = all(torch.equal(b, p) for b, p in zip(before, trainer.model.parameters(),
                                                     strict=True))
        rows.append((row.get("nonfinite", 0), row["skipped"], same))
    return rows


@pytest.mark.parametrize("degrees", [{"dp": 2}, {"tp": 2}, {"pp": 2}], ids=["dp2", "tp2", "pp2"])
def test_every_rank_sees_a_nan_that_one_rank_made(corpus, degrees):
    cfg = build_config({}, {
        "model": {"model": "tiny", "num_layers": 2, "hidden_size": 32, "num_heads": 4},
        "train": {"steps": 2, "global_batch": 4, "micro_batch": 2, "seq_len": 16,
                  "max_nonfinite_steps": 2},
        "parallel": {"device": "cpu"}, "data": {"data": corpus},
        "checkpoint": {"out": "/nonexistent"}})
    for rows in run_on_ranks(2, _steps_with_poison, cfg, degrees, poisoned_rank=1):
        assert rows == [(0, 0, False), (1, 1, True)], rows


@pytest.mark.parametrize("flags,line", [
    (["--lr", "inf"], "--lr must be a finite number (an fp32 one, at most 3.4e+38), got inf"),
    (["--lr", "1e308"], "--lr must be a finite number (an fp32 one, at most 3.4e+38), got"
                        " 1e+308"),  # finite in Python, inf as the optimizer's fp32
    (["--moe-experts", "2", "--moe-capacity-factor", "nan"],
     "--moe-capacity-factor must be a finite number, got nan"),
    (["--bucket-mb", "nan"], "--bucket-mb must be positive, got nan"),
    (["--bucket-mb", "inf"], "--bucket-mb must be positive, got inf"),
    (["--num-layers", str(10**9)], "the model's weights, gradients and AdamW states need at"
                                   " least 189,304.4 GiB for this machine's 1 rank(s)"
                                   " (12,704,000,0"),  # and the MemAvailable it exceeds
    (["--global-batch", str(2**40)], f"--global-batch {2**40} and --micro-batch 4 are sequences"
                                     " per step: past any run at more than 16777216; lower them"),
], ids=["lr-inf", "lr-overflows-fp32", "capacity-nan", "bucket-nan", "bucket-inf", "layers",
        "batch"])
def test_numbers_no_run_can_use_are_refused_before_training(corpus, tmp_path, capsys, flags,
                                                             line):
    refused = _refused(capsys, "train", *TINY, *flags, "--data", corpus,
                       "--out", str(tmp_path / "run"))
    assert refused.startswith(f"meshtrain: error: {line}") and not (tmp_path / "run").exists()


def test_an_empty_out_is_refused_not_taken_for_the_current_directory(corpus, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, "train", *TINY, "--data", corpus, "--out", "")
    assert line.startswith("meshtrain: error: --out is empty, which would write the run into the"
                           " current directory") and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name,content,problem", [
    ("image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "binary content (a NUL byte"),
    ("latin1.txt", "caf\xe9 au lait".encode("latin-1"), "not UTF-8 text"),
    ("array.npy", None, "a NumPy array is not text nor a token file"),
])
def test_data_that_is_neither_text_nor_tokens_is_refused(tmp_path, name, content, problem,
                                                        capsys):
    path = tmp_path / name
    if content is None:
        np.save(path, np.arange(1000))
    else:
        path.write_bytes(content * 100)
    line = _refused(capsys, "train", *TINY, "--data", str(path), "--out", str(tmp_path / "run"))
    assert f"--data {path}: {problem}" in line and "meshtrain prepare" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_an_out_that_cannot_be_a_directory_is_refused(corpus, tmp_path, kind, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    out = blocker if kind == "file" else blocker / "run"
    line = _refused(capsys, "train", *TINY, "--steps", "1", "--data", corpus, "--out", str(out))
    expected = "is a file, not a directory" if kind == "file" else "cannot be created"
    assert expected in line and "--out" in line


def test_a_damaged_metrics_line_is_dropped_on_resume(capsys, corpus, tmp_path):
    out = tmp_path / "run"
    flags = ["train", *TINY, "--steps", "4", "--data", corpus, "--out", str(out)]
    assert _in_process(capsys, *flags, "--stop-at", "2")[0] == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.')  # a write cut short
    code, err = _in_process(capsys, *flags, "--resume")
    assert code == 0 and "dropped 1 damaged line(s)" in err, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_full_disk_while_writing_metrics_is_one_line(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 1, "loss": 1.0})

    class FullDisk:
        def write(self, _):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(log, "_file", FullDisk())
    with pytest.raises(RunFailure) as failure:
        log.flush()
    assert failure.value.exit_code == EXIT_FAILED
    assert str(failure.value).startswith(f"writing {tmp_path / 'metrics.jsonl'} failed (No space"
                                         " left on device)")
    # the advice names no checkpoint where none was saved (it used to name "the last one")
    assert str(failure.value).endswith("no checkpoint of this run was saved: train again")
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # the row was never half-written


def test_tensorboard_forgets_the_steps_after_the_resumed_one(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")  # an optional dependency
    def sinks(resume_step):
        return metric_sinks(tmp_path, LoggingSettings(run_name="r"), resume_step=resume_step,
                            config={})

    log = MetricsLog(tmp_path / "metrics.jsonl", sinks=sinks(None))
    for step in range(1, 5):
        log.write({"step": step, "loss": float(step)})
    log.close()
    log = MetricsLog(tmp_path / "metrics.jsonl", resume_step=2, sinks=sinks(2))  # 3, 4 again
    for step in (3, 4):
        log.write({"step": step, "loss": 10.0 * step})
    log.close()
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "r"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


@pytest.mark.parametrize("flags", [["--temperature", "nan"], ["--temperature", "inf"],
                                   ["--temperature", "0"], ["--top-k", "-1"]])
def test_sample_refuses_settings_that_sample_nothing_before_reading(capsys, tmp_path, flags):
    line = _refused(capsys, "sample", str(tmp_path / "no-run"), *flags)
    assert line == ("meshtrain: error: --max-new-tokens must be positive, --top-k >= 0 and"
                    " --temperature a finite number > 0")  # before the checkpoint is looked for


@pytest.mark.parametrize("precision,per", [("fp32", 16), ("bf16", 18), ("fp64", 32)])
def test_model_states_are_checked_against_the_machine_before_anything_is_built(
        monkeypatch, precision, per):
    """A lower bound: every parameter's weight, gradient and AdamW states once over the world;
    this machine holds its ranks' share (MemAvailable), a process one rank's (RLIMIT_AS)."""
    from meshtrain import machine_fit
    from meshtrain.errors import Code, SettingError

    assert machine_fit.state_bytes_per_parameter(precision) == per
    gib = 2**30
    monkeypatch.setattr(machine_fit, "available_host_bytes", lambda: 10 * gib)
    monkeypatch.setattr(machine_fit, "process_limit_bytes", lambda: None)
    params = 10 * gib // per  # exactly 10 GiB of states
    machine_fit.check_states_fit(params, precision, world=1, ranks_here=1, device_type="cpu")
    with pytest.raises(SettingError, match="need at least 10.0 GiB for this machine's 1 rank") \
            as refused:
        machine_fit.check_states_fit(params + 1, precision, world=1, ranks_here=1,
                                     device_type="cpu")
    assert refused.value.code is Code.MODEL_MEMORY
    machine_fit.check_states_fit(4 * params, precision, world=8, ranks_here=2,
                                 device_type="cpu")  # 2 of 8 ranks here: a quarter
    monkeypatch.setattr(machine_fit, "process_limit_bytes", lambda: gib)
    with pytest.raises(SettingError, match=r"for one rank .* allowed a process \(RLIMIT_AS\)"):
        machine_fit.check_states_fit(4 * params, precision, world=8, ranks_here=2,
                                     device_type="cpu")
