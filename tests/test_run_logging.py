"""What a run logs besides metrics.jsonl: W&B (offline here: nothing leaves the machine) under
the run's name, continued by a resumed run; `profile_steps` and `wandb_project` checked before
any work."""

import importlib.util
import json
import sys
import types

import pytest

from meshtrain.cli.main import main
from meshtrain.config.run_config import profile_window
from meshtrain.config.settings import LoggingSettings
from meshtrain.training.metrics import MetricsLog, metric_sinks


def _wandb_log(out, resume_step):
    sinks = metric_sinks(out, LoggingSettings(run_name="r", wandb_project="p"),
                         resume_step=resume_step, config={"train": {"lr": 0.5}})
    return MetricsLog(out / "metrics.jsonl", resume_step=resume_step, sinks=sinks)


def test_a_resumed_run_logs_to_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = _wandb_log(tmp_path, None)
    for step in (1, 2):
        log.write({"step": step, "loss": 4.0 / step})
    log.close()
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    log = _wandb_log(tmp_path, 2)
    log.write({"step": 3, "loss": 1.25})
    log.close()
    assert (tmp_path / "wandb" / "run_id").read_text() == run_id
    records = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [r.name for r in records] == [f"run-{run_id}.wandb"] * 2  # both parts, one run id
    # (what reaches each record file is written by wandb's own service in the background: the
    # rows handed to it are checked exactly below)


def test_every_row_goes_to_wandb_with_its_step(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, scalars, step):
            calls.append(("log", scalars, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = _wandb_log(tmp_path, None)
    log.write({"step": 1, "loss": 2.5, "lr": 0.1, "note": "text"})
    log.write({"step": 1, "eval_loss": 3.0})
    log.close()
    (_, init), *rest = calls
    assert init == {"project": "p", "name": "r", "id": (tmp_path / "wandb" / "run_id").read_text(),
                    "resume": "allow", "dir": str(tmp_path), "config": {"train": {"lr": 0.5}}}
    assert rest == [("log", {"loss": 2.5, "lr": 0.1}, 1), ("log", {"eval_loss": 3.0}, 1),
                    ("finish",)]


@pytest.mark.parametrize("spec", ["3", "0:2", "4:2", "2:9", "a:b"])
def test_profile_steps_outside_the_run_are_refused_before_any_work(capsys, tmp_path, spec):
    if spec == "3":  # one step, as A:A
        assert profile_window(spec, 5) == profile_window("3:3", 5) == range(3, 4)
        return
    code = main(["train", "--steps", "8", "--profile-steps", spec, "--out", str(tmp_path / "r")])
    assert code == 2 and not (tmp_path / "r").exists()
    err = capsys.readouterr().err
    assert err == (f"meshtrain: error: --profile-steps {spec!r} must be A:B with 1 <= A <= B <="
                   " the run's 8 steps, e.g. 5:7\n")


def test_wandb_without_its_package_names_the_extra(capsys, monkeypatch, tmp_path):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else found(name, *a))
    assert main(["train", "--wandb-project", "p", "--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == ("meshtrain: error: --wandb-project needs the wandb"
                                       " package: pip install 'meshtrain[wandb]' (or drop"
                                       " --wandb-project)\n")


def test_peak_memory_writes_the_second_steps_peak_beside_the_model_states(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--num-layers", "1", "--hidden-size", "32",
                 "--num-heads", "2", "--seq-len", "32", "--global-batch", "2", "--micro-batch",
                 "2", "--eval-every", "0", "--peak-memory", "--out", str(out)]) == 0
    (rank,) = json.loads((out / "memory.json").read_text())["ranks"]
    peak = rank["peak"]
    assert peak["step"] == 2 and peak["peak"] == sum(peak["at_peak"].values())
    # the step holds every model state (the parameters, and the gradients and Adam moments
    # it finds live) and allocates activations on top of them
    assert peak["at_peak"]["parameters"] + peak["at_peak"]["held"] >= rank["total"]
    assert peak["at_peak"]["allocated"] > 0
