"""Replica groups under torchft (`--fault-tolerance`): settings refused before anything starts
(default tier, in this process), and the failure scenarios (extended): a SIGKILLed rank of one
group while the other keeps stepping, its restart healing from the live group's state, both
groups' weights bitwise equal at the end, also at tp 2, pp 2 and ZeRO 1/2/3 inside each group;
a group of another model or layout refused before it takes part; a straggling rank's group
dropped by `--drop-stragglers`, restarted and healed; a lighthouse that does not answer; SIGTERM
stopping every group with a checkpoint and leaving no process behind."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import run_cli, start_cli

from meshtrain.cli.main import main
from meshtrain.errors import SettingError
from meshtrain.operations.failures import EXIT_BAD_INPUT, EXIT_STOPPED
from meshtrain.parallel.runtime.replica_groups import check_fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "16",
        "--global-batch", "8", "--micro-batch", "2", "--eval-every", "0"]


def _refused(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["train", *TINY, *args]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_replica_group_settings_are_refused_in_one_line_before_anything_starts(
        capsys, corpus, tmp_path, monkeypatch):
    """Each bad input named in one line, exit 2, nothing written: groups not dividing the
    ranks, a quorum above the groups, a group setting without fault tolerance, a group started
    alone without its id, and fault tolerance without the torchft package; and a healing group
    refuses a live state of other settings, naming the first that differs."""
    run = ["--data", corpus, "--out", str(tmp_path / "run"), "--fault-tolerance"]
    cases = [
        (["--nproc", "4", "--replica-groups", "3", "--global-batch", "12"],
         "--replica-groups 3 does not divide the 4 ranks (--nproc)"),
        (["--nproc", "4", "--replica-groups", "2", "--min-replica-groups", "3"],
         "--min-replica-groups 3 must be from 1 to --replica-groups 2"),
        (["--nproc", "4", "--replica-groups", "3"], "--replica-groups 3 does not divide"
                                                    " --global-batch 8"),
        (["--nproc", "4", "--replica-groups", "2", "--micro-batch", "4"],
         "--global-batch 8 must be divisible by --replica-groups x --micro-batch x dp = 2 x 4 x 2"),
    ]
    for flags, line in cases:
        assert _refused(capsys, *run, *flags).startswith(f"meshtrain: error: {line}")
    assert "needs --fault-tolerance" in _refused(capsys, "--data", corpus, "--out",
                                                 str(tmp_path / "run"), "--replica-groups", "2")
    with monkeypatch.context() as under_torchrun:
        under_torchrun.setenv("RANK", "0")
        under_torchrun.setenv("WORLD_SIZE", "2")
        assert "needs --replica-group-id (0 to 1) and --lighthouse" in _refused(
            capsys, *run, "--replica-groups", "2")
    monkeypatch.setitem(sys.modules, "torchft", None)  # the extra not installed
    assert _refused(capsys, *run, "--nproc", "4", "--replica-groups", "2") == (
        "meshtrain: error: --fault-tolerance needs the torchft package: pip install"
        " 'meshtrain[ft]'")
    assert not (tmp_path / "run").exists()
    mine = {"model.num_layers": "2", "parallel.tp": "1", "train.seed": "0"}
    check_fingerprint(1, mine, dict(mine))  # the same settings: healed from
    with pytest.raises(SettingError, match=r"replica group 1: `parallel.tp` differs from the"
                                           r" running groups'"):
        check_fingerprint(1, mine, mine | {"parallel.tp": "2", "train.seed": "1"})


@pytest.mark.extended
def test_a_lighthouse_that_does_not_answer_is_one_line_after_a_bounded_wait(capsys, corpus,
                                                                             tmp_path):
    pytest.importorskip("torchft")
    began = time.monotonic()
    line = _refused(capsys, "--data", corpus, "--out", str(tmp_path / "run"),
                    "--fault-tolerance", "--replica-groups", "2", "--replica-group-id", "0",
                    "--lighthouse", "localhost:1")
    assert line.startswith("meshtrain: error: --lighthouse localhost:1 did not answer within")
    assert time.monotonic() - began < 30


@pytest.mark.extended
def test_a_killed_rank_restarts_its_group_alone_and_heals_from_the_live_group(tmp_path):
    """2 groups x 2 ranks, rank 1 of group 1 SIGKILLed after 12 steps: every step is
    committed once (no row rewritten, none lost), at most one is discarded, the restarted group
    takes part again without reading a checkpoint, and both groups, stopped by SIGTERM 5 steps
    later, end at the same step bitwise equal."""
    pytest.importorskip("torchft")
    from bench_fault_tolerance import failure_run

    report = failure_run(tmp_path / "run", fault_tolerance=True, steps=100_000, kill_at=12,
                         save_every=100, stop_after_rejoin=True)
    assert report["exit_code"] == EXIT_STOPPED, report
    assert report["steps_in_order"], report
    assert report["committed_steps_lost"] == 0 and report["discarded_steps"] <= 1, report
    assert report["rejoin_s"] is not None and report["weights_equal"], report
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    alone = [row for row in rows if row["replica_groups"] == 1]
    assert alone and all(row["groups_missing"] == [1] for row in alone)
    assert rows[-1]["replica_groups"] == 2 and "groups_missing" not in rows[-1]


@pytest.mark.extended
@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2"), ("--zero", "1"),
                                    ("--zero", "2"), ("--zero", "3")],
                         ids=["tp2", "pp2", "zero1", "zero2", "zero3"])
def test_a_group_with_a_layout_inside_heals_bitwise_equal(tmp_path, layout):
    """The same failure with each group's 2 ranks split by tensor or pipeline parallelism or
    ZeRO (dp 2): rank 1 of the healed group takes its own part from rank 1 of the live group,
    and both groups end at the same step with bitwise equal weights (the optimizer's values:
    ZeRO-3 frees its module's between steps), no committed step lost."""
    pytest.importorskip("torchft")
    from bench_fault_tolerance import failure_run

    report = failure_run(tmp_path / "run", fault_tolerance=True, steps=100_000, kill_at=6,
                         save_every=100, stop_after_rejoin=True, layout=layout)
    assert report["exit_code"] == EXIT_STOPPED, report
    assert report["steps_in_order"] and report["committed_steps_lost"] == 0, report
    assert report["discarded_steps"] <= 1, report
    assert report["rejoin_s"] is not None and report["weights_equal"], report


@pytest.mark.extended
def test_a_group_with_a_straggling_rank_is_dropped_restarted_and_healed(tmp_path):
    """`--drop-stragglers 2`: rank 1 of group 1 slowed from outside (a SIGSTOP/SIGCONT duty
    cycle) is named in two windows in a row at the default threshold, its group ends with one
    line and its agent restarts it; it heals from group 0, which never stopped (and is never
    dropped while it takes part alone), and both end bitwise equal."""
    pytest.importorskip("torchft")
    from bench_fault_tolerance import failure_run
    from test_stragglers import duty_cycle

    with contextlib.ExitStack() as slowed:  # the cycle ends itself with the slowed process
        report = failure_run(
            tmp_path / "run", fault_tolerance=True, steps=100_000, kill_at=4, save_every=100,
            stop_after_rejoin=True, fault=lambda pid: slowed.enter_context(
                duty_cycle(pid, stopped=0.08)),
            layout=("--straggler-window", "3", "--drop-stragglers", "2"))
    assert report["exit_code"] == EXIT_STOPPED, report
    assert any("of replica group 1 named stragglers in 2 windows in a row" in line
               for line in report["failure_lines"]), report
    assert report["steps_in_order"] and report["committed_steps_lost"] == 0, report
    assert report["rejoin_s"] is not None and report["weights_equal"], report


@pytest.mark.extended
def test_sigterm_stops_every_group_with_a_checkpoint_and_leaves_no_process(corpus, tmp_path):
    pytest.importorskip("torchft")
    out = tmp_path / "run"
    proc = start_cli("train", *TINY, "--data", corpus, "--out", str(out), "--nproc", "4",
                     "--replica-groups", "2", "--fault-tolerance", "--steps", "100000",
                     "--log-every", "1")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_STOPPED, err
    assert list((out / "checkpoints").glob("step_*")), err
    assert "Traceback" not in err
    assert not _descendants_alive(proc.pid)


def _descendants_alive(pid: int) -> list[int]:
    """Live processes whose parent chain reaches `pid` (re-parented orphans are caught by
    their command line naming the run)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"--replica-group-id" in command and b"meshtrain" in command:
                alive.append(int(entry.name))
    return alive


@pytest.mark.extended
def test_two_groups_train_as_dp_and_their_checkpoint_resumes_without_fault_tolerance(
        corpus, tmp_path):
    """No failure: 2 groups x 2 ranks give dp 4's losses (fp32 1e-5 per step), end bitwise
    equal, and their checkpoint resumes at dp 2 without fault tolerance."""
    pytest.importorskip("torchft")
    from meshtrain.training.metrics import read_metrics

    common = [*TINY, "--data", corpus, "--log-every", "1"]
    run_cli("train", *common, "--nproc", "4", "--replica-groups", "2", "--fault-tolerance",
            "--steps", "8", "--stop-at", "6", "--out", str(tmp_path / "ft"))
    run_cli("train", *common, "--nproc", "4", "--steps", "8", "--stop-at", "6",
            "--out", str(tmp_path / "dp"))
    ft, dp = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("ft", "dp"))
    assert [row["replica_groups"] for row in ft] == [2] * 6
    for mine, theirs in zip(ft, dp, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6)
    digests = {json.loads(p.read_text())["weights_sha256"]
               for p in (tmp_path / "ft" / "replica_groups").glob("group*.json")}
    assert len(digests) == 1
    run_cli("train", *common, "--nproc", "2", "--steps", "8", "--resume",
            "--out", str(tmp_path / "ft"))
    rows = read_metrics(tmp_path / "ft" / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 9)) and "replica_groups" not in rows[-1]


@pytest.mark.extended
@pytest.mark.parametrize(("differing", "field"), [(("--num-layers", "2"), "model.num_layers"),
                                                  (("--tp", "2"), "parallel.dp")],
                         ids=["model", "layout"])
def test_a_group_of_another_model_or_layout_is_refused_before_it_takes_part(
        corpus, tmp_path, monkeypatch, differing, field):
    """Two groups started as separate torchrun jobs on one lighthouse (the guide's
    across-machines form), group 1 with another model or layout: its ranks exit 2 with one line
    naming the first differing setting before any gradient is averaged with it (tensors of
    other shapes broke the reduction), and group 0 trains on alone to the end."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    from meshtrain.operations.replica_launch import HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    address = lighthouse.address().removeprefix("http://")
    torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", "localhost:0", "--rdzv-id", "mismatch", "-m", "meshtrain",
                "train", *TINY, "--data", corpus, "--out", str(tmp_path / "run"),
                "--fault-tolerance", "--replica-groups", "2", "--lighthouse", address,
                "--steps", "6", "--log-every", "1"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    try:
        groups = [subprocess.Popen([sys.executable, *torchrun, "--replica-group-id", "0"],
                                   env=env, stderr=subprocess.PIPE, text=True),
                  subprocess.Popen([sys.executable, *torchrun, "--replica-group-id", "1",
                                    *differing], env=env, stderr=subprocess.PIPE, text=True)]
        (_, err0), (_, err1) = (group.communicate(timeout=240) for group in groups)
    finally:
        lighthouse.shutdown()
    assert "(exitcode: 2)" in err1, err1  # torchrun's report of its ranks' exit code
    lines = [line for line in err1.splitlines() if "differs" in line]
    assert lines and all(line == lines[0] for line in lines), err1
    assert lines[0].startswith(f"meshtrain: error: replica group 1: `{field}` differs"), err1
    assert [line for line in err1.splitlines() if line.startswith("meshtrain:")] == lines, err1
    assert groups[0].returncode == 0, err0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [row["step"] for row in rows if "loss" in row] == list(range(1, 7))
    assert all(row["replica_groups"] == 1 for row in rows if "loss" in row), rows
