"""Graceful stop, elastic restart and the resume rules, through the `meshtrain` command.

Every signalled run waits until metrics.jsonl shows step 2 before signalling, so the stop lands
mid-run; the stopped-and-continued runs and the restarted one must end bitwise where one
uninterrupted run ends (dropout 0, the same layout).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from harness import pipe_holders, rank_pids, run_cli, start_cli
from safetensors.torch import load_file

from meshtrain.checkpointing.checkpoint import latest_checkpoint
from meshtrain.cli.main import _train_config, check_train, main
from meshtrain.cli.parsers import build_parser
from meshtrain.operations import stopping
from meshtrain.operations.run_lock import LOCK_FILE, RunLock, RunLockError, check_free
from meshtrain.training.run_state import RunState
from meshtrain.training.trainer import Trainer

STEPS = 30
TINY = ["--device", "cpu", "--num-layers", "1", "--hidden-size", "32", "--num-heads", "2",
        "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--eval-every", "0",
        "--log-every", "1", "--tp", "1"]


def _flags(corpus: str, out: Path, *more: str) -> list[str]:
    return ["train", *TINY, "--data", corpus, "--steps", str(STEPS), "--out", str(out), *more]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """One uninterrupted 2-rank run. Its --out holds the metrics of a run killed before its first
    save, which --auto-resume must drop: it starts fresh."""
    out = tmp_path_factory.mktemp("reference") / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 99.0}) + "\n")
    run_cli(*_flags(corpus, out, "--nproc", "2", "--auto-resume"))
    return out


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("step", 0) >= step for r in _rows(out)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the run did not reach step {step}"
        time.sleep(0.02)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # the launcher may have exited while something it started still holds its output
        code = proc.poll()
        holders = list(dict.fromkeys(h for pipe in (proc.stdout, proc.stderr) if pipe
                                     for h in pipe_holders(pipe)))
        proc.kill()
        raise AssertionError(f"no end of output in {timeout} s; launcher exit code {code};"
                             f" output held by {holders or 'nobody'}") from None
    return proc.returncode, err


def _meshtrain_lines(err: str) -> list[str]:
    """What a run said besides its launch line and its periodic checkpoints."""
    return [line for line in err.splitlines() if line.startswith("meshtrain:")
            and not line.startswith(("meshtrain: 2 ranks (", "meshtrain: saved checkpoint",
                                     "meshtrain: resuming from ",
                                     "meshtrain: changed from the checkpoint's settings"))]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}


def _final_tensors(out: Path) -> dict[str, torch.Tensor]:
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert latest.name == f"step_{STEPS:08d}"
    return load_file(str(latest / "rank_00000.safetensors"))


def _assert_same_run(out: Path, reference: Path) -> None:
    assert _losses(out) == _losses(reference)  # bitwise: JSON floats round-trip exactly
    mine, theirs = _final_tensors(out), _final_tensors(reference)
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key


def test_auto_resume_on_a_fresh_out_starts_fresh(reference):
    losses = _losses(reference)
    assert sorted(losses) == list(range(1, STEPS + 1)) and 99.0 not in losses.values()
    assert not (reference / LOCK_FILE).exists()  # released at the end


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.extended  # the launcher's path of SIGTERM (the test below) with another signal
def test_sighup_to_the_launcher_stops_as_sigterm(corpus, tmp_path):
    out = tmp_path / "run"
    proc = start_cli(*_flags(corpus, out, "--nproc", "2"))
    _wait_for_step(out, 2, proc)
    os.kill(proc.pid, signal.SIGHUP)  # a closed terminal
    code, err = _finish(proc)
    first = max(_losses(out))
    assert code == 3 and _meshtrain_lines(err) == [
        f"meshtrain: stopped by SIGHUP after step {first}; checkpoint step_{first:08d} saved;"
        " continue with --resume (or --auto-resume)"], err[-3000:]


def test_no_rank_outlives_its_launcher(corpus, tmp_path):
    out = tmp_path / "run"
    proc = start_cli(*_flags(corpus, out, "--nproc", "2"))
    _wait_for_step(out, 2, proc)
    ranks = rank_pids(proc.pid)
    assert len(ranks) == 2
    listed = json.loads((out / LOCK_FILE).read_text())["ranks"]
    assert sorted(r["pid"] for r in listed) == sorted(ranks.values())
    try:
        for pid in ranks.values():  # held still: the lock outlives its taker while they live
            os.kill(pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGKILL)  # an OOM kill: the ranks stop after a checkpoint
        proc.wait()  # (its pipes stay open in the held ranks)
        with pytest.raises(ValueError, match="is in use by another run"):
            check_free(out)
    finally:
        for pid in ranks.values():
            os.kill(pid, signal.SIGCONT)
    proc.communicate()
    deadline = time.monotonic() + 20
    while any(map(_alive, ranks.values())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks.values())), "a rank outlived its launcher"
    assert latest_checkpoint(out / "checkpoints").name >= "step_00000002"
    check_free(out)  # all gone: the lock is stale


def test_stopped_restarted_and_continued_ends_as_the_uninterrupted_run(corpus, reference,
                                                                      tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    (out / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid,
                                             "run_id": "crashed"}))  # stale: taken over

    # SIGTERM as a scheduler sends it: to the launcher (twice) and to every rank, at once.
    proc = start_cli(*_flags(corpus, out, "--nproc", "2"))
    _wait_for_step(out, 2, proc)
    ranks = rank_pids(proc.pid)
    for pid in [proc.pid, proc.pid, *ranks.values()]:
        os.kill(pid, signal.SIGTERM)
    code, err = _finish(proc)
    lines = _meshtrain_lines(err)
    assert code == 3 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    first = max(_losses(out))
    assert lines[0] == (f"meshtrain: stopped by SIGTERM after step {first}; checkpoint"
                        f" step_{first:08d} saved; continue with --resume (or --auto-resume)")
    assert (out / "checkpoints" / "latest").read_text() == f"step_{first:08d}"

    # SIGTERM to one rank, under restarts: meshtrain's launcher hears of it and stops them all,
    # restarting none. Timed saves on.
    proc = start_cli(*_flags(corpus, out, "--nproc", "2", "--auto-resume", "--max-restarts",
                          "1", "--save-every-minutes", "0.0001"))
    _wait_for_step(out, first + 2, proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGTERM)
    code, err = _finish(proc)
    lines = _meshtrain_lines(err)
    second = max(_losses(out))
    assert code == 3 and len(lines) == 1 and err.count("model states") == 1, err[-3000:]
    assert lines[0].startswith(f"meshtrain: stopped by SIGTERM after step {second};")
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert [name for name in saved if first < int(name[5:]) < second], saved  # by the clock

    # Continue under restarts; SIGKILL rank 1 two steps after the next save at a multiple of 5.
    proc = start_cli(*_flags(corpus, out, "--nproc", "2", "--max-restarts", "1", "--auto-resume",
                          "--save-every", "5", "--save-every-minutes", "0"))  # else carried
    kill_at = (second // 5 + 1) * 5 + 2
    assert kill_at < STEPS - 10
    _wait_for_step(out, kill_at, proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)
    code, err = _finish(proc)
    assert code == 0, err[-3000:]
    assert err.count("model states on rank 0") == 2  # it did restart
    # The kill lands some steps after kill_at on a busy host: the resume is from the last save
    # at a multiple of 5 before it, kill_at - 2 or a later one.
    resumed = re.search(r"meshtrain: restart 1: rank 1 ended without a word \(killed by a"
                        r" signal\); resumed from checkpoint step_(\d{8})\n", err)
    assert resumed, err[-3000:]
    step = int(resumed.group(1))
    assert step % 5 == 0 and kill_at - 2 <= step < STEPS, resumed.group(0)
    _assert_same_run(out, reference)


def _loading_torch(pid: int) -> bool:
    """The rank has begun to load torch: meshtrain's package has run its first line (which
    holds stop signals), and the rank is seconds away from arming its own handling."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _ranks_started(proc: subprocess.Popen, loading: bool) -> dict[int, int]:
    """The launcher's 2 rank pids once they exist (`loading`: once both load torch)."""
    deadline = time.monotonic() + 90
    while len(ranks := rank_pids(proc.pid)) < 2 or loading and not all(
            map(_loading_torch, ranks.values())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.01)
    return ranks


def _assert_no_rank_left(ranks: dict[int, int]) -> None:
    deadline = time.monotonic() + 10
    while any(map(_alive, ranks.values())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, ranks.values())), "a rank outlived the stop"


def test_a_signal_to_the_launcher_during_start_up_stops_at_once(corpus, tmp_path):
    """No rank has armed (they load torch): nothing to save, the ranks go, one line, exit 3."""
    out = tmp_path / "run"
    proc = start_cli(*_flags(corpus, out, "--nproc", "2"))
    ranks = _ranks_started(proc, loading=False)
    os.kill(proc.pid, signal.SIGTERM)
    code, err = _finish(proc, timeout=30)
    assert code == 3 and _meshtrain_lines(err) == [
        "meshtrain: stopped by SIGTERM during start-up, before the first step: nothing to"
        " save"], err[-3000:]
    _assert_no_rank_left(ranks)
    check_free(out)


@pytest.mark.extended  # its parts are default: the hold (below) and a rank's stop under restarts
def test_a_signal_to_a_rank_during_start_up_stops_after_the_first_step(corpus, tmp_path):
    """Held while the rank loads, acted on when it arms: as any rank's signal, a stop with a
    checkpoint, not a failure to restart (under --max-restarts)."""
    out = tmp_path / "run"
    proc = start_cli(*_flags(corpus, out, "--nproc", "2", "--max-restarts", "1",
                             "--auto-resume"))
    ranks = _ranks_started(proc, loading=True)
    os.kill(ranks[1], signal.SIGTERM)
    code, err = _finish(proc)
    assert code == 3 and _meshtrain_lines(err) == [
        "meshtrain: stopped by SIGTERM after step 1; checkpoint step_00000001 saved; continue"
        " with --resume (or --auto-resume)"], err[-3000:]
    assert err.count("model states on rank 0") == 1  # not restarted
    _assert_no_rank_left(ranks)


# A rank's phases besides the step: a signal there is held until the next step's agreement
# (a save or an evaluation in flight completes), and one after the last step changes nothing.
_PHASES = {"save": (Trainer, "save"), "eval": (Trainer, "evaluate"),
           "shutdown": (RunState, "finish")}


@pytest.mark.parametrize("phase,sig", [("save", signal.SIGTERM), ("eval", signal.SIGHUP),
                                       ("save", signal.SIGUSR1), ("shutdown", signal.SIGINT)])
def test_a_signal_during_a_save_an_evaluation_or_the_shutdown(capsys, corpus, tmp_path,
                                                               monkeypatch, phase, sig):
    owner, name = _PHASES[phase]
    original, fired = getattr(owner, name), []

    def signalled(self, *args, **kwargs):
        if not fired:
            fired.append(os.kill(os.getpid(), sig))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)
    out = tmp_path / "run"
    code = main(_flags(corpus, out, "--steps", "6", "--save-every", "2", "--eval-every", "2"))
    lines = _meshtrain_lines(capsys.readouterr().err)
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    if phase == "shutdown":  # the run is complete: it ends as one without the signal
        assert code == 0 and lines == [] and saved[-1] == "step_00000006", lines
        return
    assert code == 3 and lines == [
        f"meshtrain: stopped by {sig.name} after step 3; checkpoint step_00000003 saved;"
        " continue with --resume (or --auto-resume)"], lines
    assert saved == ["step_00000002", "step_00000003"]  # the save in flight completed
    assert max(_losses(out)) == 3


_SLOW_PHASE = textwrap.dedent("""
    import os, time
    from pathlib import Path
    if os.environ.get("RANK") == "0":  # in meshtrain's ranks only, not in their launcher
        from meshtrain.training import run_state, trainer
        owner, name = {"save": (trainer.Trainer, "save"),
                       "shutdown": (run_state.RunState, "finish")}[os.environ["SLOW_PHASE"]]
        original = getattr(owner, name)
        def slow(self, *args, **kwargs):
            Path(os.environ["SLOW_MARK"]).touch()
            time.sleep(2)
            return original(self, *args, **kwargs)
        setattr(owner, name, slow)
""")


@pytest.mark.parametrize("phase", ["save", pytest.param("shutdown", marks=pytest.mark.extended)])
def test_a_signal_to_the_launcher_while_rank_0_saves_or_shuts_down(corpus, tmp_path,
                                                                    monkeypatch, phase):
    """The launcher forwards SIGTERM while rank 0 is in a 2 s save (or its end of run): the
    save completes and the ranks stop after the next step (at the end: a complete run, exit 0).
    The shutdown case is extended: the in-process case above covers the rank's side of it."""
    hook, mark, out = tmp_path / "hook", tmp_path / "in_phase", tmp_path / "run"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_SLOW_PHASE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("SLOW_PHASE", phase)
    monkeypatch.setenv("SLOW_MARK", str(mark))
    proc = start_cli(*_flags(corpus, out, "--nproc", "2", "--steps", "4", "--save-every", "2"))
    deadline = time.monotonic() + 90
    while not mark.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    code, err = _finish(proc)
    lines = _meshtrain_lines(err)
    if phase == "shutdown":
        assert code == 0 and lines == [] and "Traceback" not in err, err[-3000:]
        assert (out / "checkpoints" / "latest").read_text() == "step_00000004"
        return
    assert code == 3 and lines == [
        "meshtrain: stopped by SIGTERM after step 3; checkpoint step_00000003 saved; continue"
        " with --resume (or --auto-resume)"], err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == \
        ["step_00000002", "step_00000003"]


def _in_process(capsys, corpus, out, *flags) -> tuple[int, str]:
    code = main(_flags(corpus, out, *flags))
    return code, capsys.readouterr().err.strip()


def test_resume_rules(capsys, corpus, reference):
    code, err = _in_process(capsys, corpus, reference, "--nproc", "2", "--auto-resume")
    assert code == 0 and err == (f"meshtrain: {reference} is complete: its checkpoint"
                                 f" step_{STEPS:08d} is at step {STEPS}, the run's end; nothing"
                                 " to do")
    for flags, needle in [
        (["--resume"], f"--steps {STEPS} is at or below the step of the checkpoint to resume"
                       f" (step_{STEPS:08d}, step {STEPS}): raise --steps past {STEPS}"),
        (["--resume", "--steps", "25"], "--steps 25 is at or below"),
        (["--auto-resume", "--steps", "300", "--stop-at", "20"], "--stop-at 20 is at or below"),
        (["--resume", "--auto-resume"], "--resume and --auto-resume exclude each other"),
        (["--nproc", "2", "--max-restarts", "1"], "--max-restarts restarts the ranks with the"
                                                  " same flags: add --auto-resume"),
        (["--save-every-minutes", "-1"], "--save-every-minutes must be >= 0"),
    ]:
        code, err = _in_process(capsys, corpus, reference, *flags)
        assert code == 2 and len(err.splitlines()) == 1 and needle in err, (flags, err)

    argv = _flags(corpus, reference, "--resume", "--steps", "150", "--lr", "0.001")
    check_train(_train_config(build_parser().parse_args(argv)), 1)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"meshtrain: --steps changed from {STEPS} to 150, --lr changed from 0.003 to 0.001 on"
        " resume:"
        f" the learning-rate schedule follows the new values from step {STEPS} on")


def test_a_live_run_holds_its_out(capsys, corpus, reference, monkeypatch):
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": "first"}
    (reference / LOCK_FILE).write_text(json.dumps(owner))
    try:
        code, err = _in_process(capsys, corpus, reference, "--resume", "--steps", "150")
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"--out {reference} is in use by another run (host {owner['host']}, pid" \
               f" {os.getpid()}, run id first)" in err
        check_free(reference, "first")  # a restarted worker of the same elastic run
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "first")
        check_train(_train_config(build_parser().parse_args(
            _flags(corpus, reference, "--resume", "--steps", "150"))), 1)
        with pytest.raises(RunLockError, match="in use by another run"):
            RunLock(reference, "second").acquire()
    finally:
        (reference / LOCK_FILE).unlink()
    capsys.readouterr()


_SIGNALS_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from meshtrain.operations import stopping
    stopping.DUPLICATE_WINDOW_S, stopping.AGREE_DEADLINE_S = 0.5, float(sys.argv[1])
    stop = stopping.StopSignals(rank=0)
    stop.arm()
    for pause in sys.argv[2:]:
        time.sleep(float(pause))
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        print(stop.request(), flush=True)
    time.sleep(2)  # the main thread busy elsewhere: the watcher must act on its own
    print("slept", flush=True)
""")


def _signal_script(deadline: float, *pauses: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SIGNALS_SCRIPT, str(deadline),
                           *map(str, pauses)], capture_output=True, text=True, timeout=60)


def test_a_repeat_counts_once_and_a_later_signal_aborts():
    twice = _signal_script(60, 0, 0.1)  # SIGINT twice within 0.2 s: one stop request
    assert twice.returncode == 0 and twice.stdout.split() == ["102.0", "102.0", "slept"]
    later = _signal_script(60, 0, 1.0)  # the second 1.1 s after the first: abort at once
    assert later.returncode == 128 + signal.SIGINT and later.stdout.split() == ["102.0"]
    assert later.stderr.strip() == ("meshtrain: rank 0: SIGINT again 1 s after SIGINT: aborted at"
                                    " once without saving; the last complete checkpoint is kept")


_HELD_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from meshtrain.operations import stopping
    stopping.DUPLICATE_WINDOW_S = 0.5
    stopping.hold_signals()
    for pause in sys.argv[1:]:
        os.kill(os.getpid(), signal.SIGTERM)  # while the run starts: held, not fatal
        time.sleep(float(pause))
    stop = stopping.StopSignals(rank=0)
    print(stop.request(), flush=True)
    stop.arm()
    time.sleep(0.2)
    print(stop.request(), flush=True)
""")


@pytest.mark.parametrize("pauses,code,printed", [(["0"], 0, ["0.0", "115.0"]),
                                                 (["1", "0"], 128 + signal.SIGTERM, ["0.0"])],
                         ids=["once", "again-later"])
def test_a_signal_before_arming_is_held_and_acted_on_when_armed(pauses, code, printed):
    """As if it had come armed: a stop request, or an abort for a repeat past the window."""
    run = subprocess.run([sys.executable, "-c", _HELD_SCRIPT, *pauses], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == code and run.stdout.split() == printed, run.stderr


def test_a_stop_the_ranks_cannot_agree_on_gives_up():
    stuck = _signal_script(1.0, 0)  # nobody reads the request: as if a peer were gone
    assert stuck.returncode == 6 and stuck.stdout.split() == ["102.0"]
    assert "SIGINT: the ranks did not all reach the end of the step within 1 s" in stuck.stderr


def test_a_lock_lives_while_a_listed_rank_lives(tmp_path):
    """The taker is gone; a rank it lists is this process (alive) unless its start time says
    the pid now belongs to another process."""
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "started": int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])}
    for ranks, live in (([me], True), ([me | {"started": me["started"] + 1}], False), ([], False)):
        (tmp_path / LOCK_FILE).write_text(json.dumps(
            {"host": me["host"], "pid": gone.pid, "run_id": "x", "ranks": ranks}))
        if live:
            with pytest.raises(ValueError, match="is in use by another run"):
                check_free(tmp_path)
        else:
            check_free(tmp_path)


def _attempt(run: Path, attempt: int, local_rank: int, rank: int, code: str | None) -> Path:
    """torchrun's folder of one rank and attempt, with the files that rank left."""
    folder = run / f"attempt_{attempt}" / str(local_rank)
    folder.mkdir(parents=True)
    (folder / f"rank_{rank}.armed").touch()
    if code is not None:
        (folder / f"rank_{rank}.exit").write_text(code)
    return folder / "error.json"


@pytest.mark.parametrize("codes,named", [
    ({2: "6", 3: None}, "rank 3 ended without a word (killed by a signal)"),
    ({2: None, 3: None}, "rank 2 and rank 3 ended without a word (killed by a signal)"),
    ({2: "1", 3: "6"}, "rank 2 failed with exit code 1"),
    ({2: "6", 3: "3"}, None),  # nothing here names a cause: another node's rank failed
])
def test_a_restart_under_torchrun_names_the_rank_from_the_last_attempts_files(
        tmp_path, monkeypatch, codes, named):
    """Under plain torchrun each rank leaves its armed and exit files beside its error file in
    the agent's folder of its attempt; the next attempt reads the last one's on its node."""
    for local_rank, (rank, code) in enumerate(codes.items()):
        _attempt(tmp_path, 0, local_rank, rank, code)
    monkeypatch.delenv(stopping.EXIT_DIR, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE",
                       str(tmp_path / "attempt_1" / "0" / "error.json"))
    assert stopping.failed_rank(4) == named
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "logs" / "0" / "error.json"))
    assert stopping.failed_rank(4) is None  # a folder not of the agent's layout
