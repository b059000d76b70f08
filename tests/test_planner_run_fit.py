"""Fitting a profile to real runs (`plan calibrate --from-run`): the fit recovers the factors
that made the runs' step times, reads run directories as `train` leaves them, refuses what is
not one, and the machine's calibrated profile is what `plan` then uses by itself."""

import dataclasses
import json
import tomllib

import pytest

from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.planner.hardware import BUILT_IN, calibrated_path, load_hardware
from meshtrain.planner.run_fit import WARMUP_STEPS, fit_runs, read_run, scaled

BASE = BUILT_IN["cpu-gloo"]
MODEL = {"model": "tiny", "num_layers": 2, "hidden_size": 64, "num_heads": 4,
         "vocab_size": 256}
LAYOUTS = ({"dp": 4}, {"tp": 2, "dp": 2}, {"tp": 4, "dp": 1})


def write_run(folder, layout: dict, machine, steps: int = 6, junk: str = ""):
    """A run directory as `train` leaves it: its resolved config.toml and a metrics.jsonl
    whose step times `machine` predicts (the warm-up steps slower, as real ones are)."""
    cfg = build_config({}, {"model": MODEL, "parallel": layout,
                            "train": {"seq_len": 64, "global_batch": 8, "precision": "fp32",
                                      "micro_batch": 2},
                            "checkpoint": {"out": str(folder)}})
    model = cfg.model_config(MODEL["vocab_size"])
    cfg = cfg.resolved(model, cfg.plan)
    folder.mkdir()
    (folder / "config.toml").write_text(cfg.to_toml())
    run = read_run_times(folder, cfg, machine, steps)
    (folder / "metrics.jsonl").write_text(junk + "\n".join(json.dumps(row) for row in run) + "\n")
    return folder


def read_run_times(folder, cfg, machine, steps):
    from meshtrain.planner.costs import predict

    step = predict(cfg.model_config(MODEL["vocab_size"]), cfg.plan, machine, seq_len=64,
                   global_batch=8, precision="fp32").step_time_s
    return [{"step": i + 1, "loss": 5.0, "step_time_s": step * (3 if i < WARMUP_STEPS else 1)}
            for i in range(steps)] + [{"step": steps, "eval_loss": 5.0}]


def test_one_run_fits_the_compute_factor_that_made_it(tmp_path):
    run = read_run(write_run(tmp_path / "a", LAYOUTS[0], scaled(BASE, 0.5, 1.0)))
    fitted = fit_runs(BASE, [run])
    assert run.predict(fitted) == pytest.approx(run.step_time_s, rel=1e-3)
    assert fitted.matmul_efficiency == pytest.approx(BASE.matmul_efficiency * 0.5, rel=2e-3)
    assert fitted.network_efficiency == BASE.network_efficiency  # one run: compute alone
    assert fitted.peak_tflops == BASE.peak_tflops and fitted.name == BASE.name


def test_runs_at_another_rank_count_fit_the_profile_they_were_scaled_from(tmp_path):
    """A 4-rank CPU profile fitted to 2-rank runs: each run is predicted with the profile scaled
    to its ranks, as `plan` scales it (`Hardware.for_ranks`), so the factors describe the
    profile itself and `plan --gpus 2` with the fitted one does not scale twice."""
    machine = scaled(BASE, 0.5, 1.0)
    run = read_run(write_run(tmp_path / "a", {"dp": 2}, machine.for_ranks(2)))
    fitted = fit_runs(BASE, [run])
    assert fitted.matmul_efficiency == pytest.approx(machine.matmul_efficiency, rel=2e-3)
    assert fitted.calibrated_ranks == BASE.calibrated_ranks


def test_runs_that_communicate_differently_fit_compute_and_network_apart(tmp_path):
    machine = scaled(BASE, 0.6, 2.5)
    runs = [read_run(write_run(tmp_path / str(i), layout, machine))
            for i, layout in enumerate(LAYOUTS)]
    lines = []
    fitted = fit_runs(BASE, runs, report=lines.append)
    for field in ("matmul_efficiency", "network_efficiency", "collective_latency_s",
                  "layer_overhead_s"):
        assert getattr(fitted, field) == pytest.approx(getattr(machine, field), rel=1e-2), field
    assert lines[-1].startswith("fit: compute x0.6") and "network x2.5" in lines[-1]
    assert all(run.predict(fitted) == pytest.approx(run.step_time_s, rel=1e-2) for run in runs)


def test_a_run_is_its_median_step_after_warm_up_and_cut_lines_are_skipped(tmp_path):
    folder = write_run(tmp_path / "a", LAYOUTS[1], BASE, junk='{"step": 1, "loss"\n[1]\n')
    run = read_run(folder)
    assert run.step_time_s == pytest.approx(run.predict(BASE), rel=1e-12)


def test_what_is_not_a_finished_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"`from_run` .* is not a run directory"):
        read_run(tmp_path)
    short = write_run(tmp_path / "short", LAYOUTS[0], BASE, steps=WARMUP_STEPS)
    with pytest.raises(ValueError, match=r"has 2 timed step\(s\): train at least 3 steps"):
        read_run(short)


def test_calibrate_from_runs_writes_the_profile_plan_then_uses(tmp_path, capsys):
    runs = [str(write_run(tmp_path / str(i), layout, scaled(BASE, 0.5, 1.0)))
            for i, layout in enumerate(LAYOUTS[:1])]
    assert main(["plan", "calibrate", "--from-run", *runs, "--hardware", "cpu-gloo"]) == 0
    out = capsys.readouterr().out
    path = calibrated_path("cpu-gloo", 4)
    assert f"wrote {path}" in out and "fit: compute x0.5" in out
    fitted = load_hardware(str(path))
    assert fitted.matmul_efficiency == pytest.approx(BASE.matmul_efficiency * 0.5, rel=2e-3)
    plans = {}
    for given in ([], ["--hardware", str(path)], ["--hardware", "cpu-gloo"]):
        assert main(["plan", "--gpus", "4", "--model", "tiny", "--json", *given]) == 0
        plans[len(given) and given[1]] = json.loads(capsys.readouterr().out)["layouts"]
    path.unlink()  # the suite's other plans see the built-in profile again
    assert plans[0] == plans[str(path)] != plans["cpu-gloo"]


def test_plan_names_the_ranks_a_cpu_profile_was_measured_with(capsys):
    assert main(["plan", "--gpus", "8", "--model", "tiny", "--top", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert "measured with 4 ranks sharing the machine" in header
    assert "plan calibrate --ranks 8` measures 8" in header


def test_a_profile_records_its_fp16_peak_and_ranks(tmp_path):
    hw = dataclasses.replace(BASE, fp16_peak_tflops=0.0004)
    assert hw.peak_for("fp16") == 0.0004 and hw.peak_for("bf16") == BASE.peak_tflops
    assert BUILT_IN["h100-80g"].peak_for("fp16") == BUILT_IN["h100-80g"].peak_tflops  # bf16's
    assert BASE.peak_for("fp16") < BASE.peak_tflops / 10  # this CPU's, measured
    path = tmp_path / "p.toml"
    path.write_text(hw.to_toml())
    assert tomllib.loads(path.read_text())["calibrated_ranks"] == 4
    assert load_hardware(str(path)) == hw


def test_a_fit_from_runs_is_kept_as_this_machines_profile_at_their_rank_count(tmp_path, capsys):
    """Fitted from a data-sheet profile or at another rank count, the result is still this
    machine's profile for the runs' world size: the one `plan --gpus 2` looks for."""
    run = write_run(tmp_path / "a", {"dp": 2}, scaled(BASE, 0.5, 1.0))
    assert main(["plan", "calibrate", "--from-run", str(run), "--hardware", "h100-80g"]) == 0
    path = calibrated_path("cpu-gloo", 2)
    assert f"wrote {path}" in capsys.readouterr().out
    assert load_hardware(str(path)).peak_tflops == BUILT_IN["h100-80g"].peak_tflops
    path.unlink()
