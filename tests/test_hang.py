"""Hang diagnosis and peer failures: the flight recorder's ring, the verdict rules, the watchdog
on real gloo ranks (a stopped rank, a killed rank, an op mismatch, a rank that sleeps), the
`doctor` command, and how ranks and the launcher turn failures into one line."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from harness import rank_pids, run_torchrun, start_cli

from meshtrain.cli import main as cli
from meshtrain.cli import parsers as cli_parsers
from meshtrain.mesh import MeshAxis
from meshtrain.operations import endings
from meshtrain.operations.doctor import read_dumps, verdict
from meshtrain.operations.failures import EXIT_FAILED, EXIT_HANG, EXIT_PEER_FAILED, RunFailure
from meshtrain.parallel.communication.flight_recorder import FlightRecorder

TIMEOUT = 3  # --collective-timeout of the multi-rank cases (seconds)


def _axis(name: str, ranks=(0, 1), rank: int = 0) -> MeshAxis:
    return MeshAxis(name, len(ranks), rank, tuple(ranks), None)


# ---------------------------------------------------------------------------------------------
# The ring
# ---------------------------------------------------------------------------------------------

def test_ring_numbers_each_axis_and_stays_bounded():
    import torch

    recorder = FlightRecorder(capacity=5)
    dp, tp = _axis("dp"), _axis("tp")
    for _ in range(4):
        recorder.done(recorder.issue("all_reduce", dp, torch.ones(3)))
    for _ in range(3):
        recorder.done(recorder.issue("all_gather", tp, torch.ones(2, 2, dtype=torch.bfloat16)))
    assert recorder.seq == {"dp": 4, "tp": 3}
    dump = recorder.dump()
    assert [(e["axis"], e["seq"]) for e in dump["entries"]] == \
        [("dp", 3), ("dp", 4), ("tp", 1), ("tp", 2), ("tp", 3)]
    assert dump["entries"][-1] | {"issued": 0, "blocked": 0, "ended": 0} == {
        "axis": "tp", "seq": 3, "op": "all_gather", "shape": [2, 2], "dtype": "bfloat16",
        "peer": None, "issued": 0, "blocked": 0, "ended": 0}
    assert dump["waiting"] is None and dump["axes"] == {"dp": [0, 1], "tp": [0, 1]}


def test_async_work_blocks_where_it_is_waited():
    import torch

    recorder = FlightRecorder()
    waited = []
    work = recorder.done(recorder.issue("all_reduce", _axis("dp"), torch.ones(1),
                                        blocking=False), SimpleNamespace(wait=lambda:
                                                                         waited.append(1)))
    assert recorder.stuck() is None  # issued, not waited: compute in between is no wait
    entry = recorder.entries[-1]
    assert entry.blocked is None and entry.ended is None
    recorder.block(entry)
    assert recorder.stuck()[0] is entry
    recorder.end(entry)
    assert recorder.stuck() is None and entry.ended is not None
    work.wait()
    assert waited == [1]


def test_comm_feeds_the_armed_recorder_only():
    import torch

    from meshtrain.parallel.communication import comm
    solo = _axis("dp", ranks=(0,))
    with FlightRecorder() as recorder:
        comm.all_reduce(torch.ones(2), solo)  # size 1: nothing sent, nothing recorded
    assert not recorder.entries
    assert not comm._flight_recorders


# ---------------------------------------------------------------------------------------------
# The verdict on synthetic dumps
# ---------------------------------------------------------------------------------------------

def _entry(axis, seq, op="all_reduce", shape=(4,), ended=True, peer=None):
    return {"axis": axis, "seq": seq, "op": op, "shape": list(shape), "dtype": "float32",
            "peer": peer, "issued": 99.0, "blocked": 99.0, "ended": 99.5 if ended else None}


def _dump(rank, entries, world=2, axes=None, run="r:0"):
    waiting = next((e | {"waited_s": 4.0} for e in entries if e["ended"] is None), None)
    seq = {}
    for e in entries:
        seq[e["axis"]] = e["seq"]
    return {"rank": rank, "world_size": world, "run": run, "time": 104.0,
            "axes": axes or {"dp": list(range(world))}, "seq": seq, "waiting": waiting,
            "entries": entries}


def test_verdict_names_the_rank_that_never_arrived():
    done = [_entry("dp", 1), _entry("dp", 2)]
    waiting = _dump(0, done + [_entry("dp", 3, ended=False)])
    text = verdict({0: waiting, 1: _dump(1, done)})
    assert text.startswith("rank 1 never reached all_reduce #3 on axis dp; it last completed"
                           " all_reduce #2 on axis dp 4.5 s before its dump"), text
    alone = verdict({0: waiting})
    assert alone.startswith("rank 1 never completed all_reduce #3 on axis dp and left no dump")


def test_verdict_names_both_sides_of_a_mismatch():
    dumps = {0: _dump(0, [_entry("dp", 1), _entry("dp", 2, ended=False)]),
             1: _dump(1, [_entry("dp", 1), _entry("dp", 2, "all_gather", (8,), ended=False)])}
    assert verdict(dumps) == ("rank 0 issued all_reduce [4] float32 and rank 1 issued"
                              " all_gather [8] float32 as collective #2 on axis dp")


def test_verdict_follows_the_chain_to_its_cause():
    """tp pairs (0,1) and (2,3); dp pairs (0,2) and (1,3). Rank 3 stalls: rank 2 waits for it
    on tp, ranks 0 and 1 wait for rank 2 and 3 on dp. The cause is rank 3, not rank 2."""
    axes = {0: {"tp": [0, 1], "dp": [0, 2]}, 1: {"tp": [0, 1], "dp": [1, 3]},
            2: {"tp": [2, 3], "dp": [0, 2]}}
    dp_wait = [_entry("tp", 1), _entry("dp", 1, ended=False)]
    dumps = {0: _dump(0, dp_wait, 4, axes[0]), 1: _dump(1, dp_wait, 4, axes[1]),
             2: _dump(2, [_entry("tp", 1, ended=False) | {"blocked": 98.0}], 4, axes[2])}
    assert verdict(dumps).startswith("rank 3 never completed all_reduce #1 on axis tp and left"
                                     " no dump")


def test_verdict_when_every_rank_agrees_or_none_waits():
    same = [_entry("dp", 1), _entry("dp", 2, ended=False)]
    text = verdict({0: _dump(0, same), 1: _dump(1, same)})
    assert "every rank of the axis that dumped reached it with the same call" in text
    idle = [_entry("dp", 1)]
    assert verdict({0: _dump(0, idle), 1: _dump(1, idle)}) == \
        "no rank was waiting in a collective when the dumps were written"


def test_point_to_point_waits_are_matched_by_peer():
    axes = {"pp": [0, 1]}
    dumps = {0: _dump(0, [_entry("pp", 1, "recv", peer=1, ended=False)], axes=axes),
             1: _dump(1, [_entry("pp", 1, "recv", peer=0, ended=False)], axes=axes)}
    assert verdict(dumps).startswith("rank 0 waits in recv #1 on axis pp for rank 1, which"
                                     " waits in recv #1 on axis pp for rank 0")


def test_doctor_reads_only_the_newest_hang(tmp_path, capsys):
    hang = tmp_path / "hang"
    hang.mkdir()
    old = _dump(1, [_entry("dp", 1)], run="old") | {"time": 1.0}
    (hang / "rank_1.json").write_text(json.dumps(old))
    (hang / "rank_0.json").write_text(json.dumps(
        _dump(0, [_entry("dp", 1), _entry("dp", 2, ended=False)])))
    assert list(read_dumps(hang)) == [0]
    assert cli.main(["doctor", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("meshtrain: hang: rank 1 never completed all_reduce #2 on axis"
                               " dp and left no dump")
    assert "no dump from rank 1" in lines[1] and "waiting" in lines[-1]


@pytest.mark.parametrize("content,problem", [
    ("{", "not readable JSON (JSONDecodeError)"),
    ("[" * 100_000, "not readable JSON (RecursionError)"),
    ("null", "not a JSON object"),
    ("{}", "no rank below a world size"),
    ('{"rank": 2, "world_size": 2}', "no rank below a world size"),
    ('{"rank": 0, "world_size": 2, "time": 1e999, "run": "r"}', "no time or run"),
    ('{"rank": 0, "world_size": 2, "time": 9, "run": "r", "axes": {"dp": ["x"]}}',
     "its axes are not lists of ranks"),
    ('{"rank": 0, "world_size": 2, "time": 9, "run": "r", "axes": {}, "seq": {}, "entries": 5}',
     "its entries are not a list"),
    ('{"rank": 0, "world_size": 2, "time": 9, "run": "r", "axes": {}, "seq": {},'
     ' "entries": [{"axis": "dp"}]}', "an entry lacks its axis, number, op, shape or dtype"),
], ids=["cut", "nested", "null", "empty", "rank", "time", "axes", "entries", "entry"])
def test_doctor_names_damaged_dumps_and_diagnoses_without_them(tmp_path, capsys, content,
                                                                problem):
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "rank_1.json").write_text(content)
    assert cli.main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (f"meshtrain: no readable hang dump in {hang} (rank_1.json: {problem}): the"
                   " files are damaged; rerun the hung run to dump again\n")
    (hang / "rank_0.json").write_text(json.dumps(
        _dump(0, [_entry("dp", 1), _entry("dp", 2, ended=False)])))
    assert cli.main(["doctor", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("meshtrain: hang: rank 1 never completed all_reduce #2")
    assert lines[2] == f"skipped damaged dumps: rank_1.json: {problem}"


def test_doctor_without_dumps_says_so(tmp_path, capsys):
    assert cli.main(["doctor", str(tmp_path), "--debug"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"meshtrain: no hang dumps in {tmp_path / 'hang'}")


# ---------------------------------------------------------------------------------------------
# Failures in a rank and in the launcher: one line
# ---------------------------------------------------------------------------------------------

def _raise(error):
    def fn():
        raise error
    return fn


def test_rank_failures_become_one_line_or_none(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert cli._in_rank(_raise(KeyError("boom"))) == EXIT_FAILED
    assert capsys.readouterr().err == ("meshtrain: error: rank 1: KeyError: 'boom' (rerun with"
                                       " --debug for the traceback)\n")
    assert cli._in_rank(_raise(KeyError("boom")), debug=True) == EXIT_FAILED
    assert "Traceback" in capsys.readouterr().err
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error:"
                        " Connection reset by peer")
    assert cli._in_rank(_raise(gloo)) == EXIT_PEER_FAILED
    assert capsys.readouterr().err == ""
    assert cli._in_rank(_raise(RunFailure("step 3: loss is nan", 5, agreed=True))) == 5
    assert capsys.readouterr().err == ""  # agreed: rank 0 says it
    assert cli._in_rank(_raise(RunFailure("disk full", 1))) == 1
    assert capsys.readouterr().err == "meshtrain: disk full\n"


def _failure(code, when=100):
    name = signal.Signals(-code).name if code < 0 else ""
    return SimpleNamespace(exitcode=code, timestamp=when, signal_name=lambda: name)


def test_launcher_names_the_rank_that_died(capsys):
    # The agent SIGTERMs the ranks left after the first failure and lists them too.
    code = endings.launch_failure({0: _failure(-signal.SIGTERM), 1: _failure(-signal.SIGKILL)})
    err = capsys.readouterr().err
    assert code == EXIT_PEER_FAILED and err.startswith("meshtrain: rank 1 was killed by SIGKILL")
    assert endings.launch_failure({0: _failure(EXIT_HANG), 1: _failure(-signal.SIGKILL)}) == 4
    assert endings.launch_failure({0: _failure(EXIT_PEER_FAILED), 1: _failure(2)}) == 2
    assert capsys.readouterr().err == ""  # those ranks printed their own line


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "0.001"])
def test_collective_timeout_must_be_at_least_a_second(capsys, value):
    assert cli.main(["train", "--collective-timeout", value, "--device", "cpu"]) == 2
    assert capsys.readouterr().err == (
        "meshtrain: error: --collective-timeout must be a number of seconds from 1 (below, a"
        f" collective of a healthy run times out), got {float(value)}\n")


def test_every_subcommand_accepts_debug():
    parser = cli_parsers.build_parser()
    for argv in (["train"], ["export", "r", "--out", "x"], ["import-hf", "d", "--out", "x"],
                 ["sample", "r"], ["doctor", "r"], ["prepare", "f", "--out", "x"],
                 ["tokenizer", "train", "f", "--vocab-size", "300", "--out", "x"]):
        assert parser.parse_args([*argv, "--debug"]).debug, argv


# ---------------------------------------------------------------------------------------------
# Real ranks
# ---------------------------------------------------------------------------------------------

def _worker(mode: str, out: str) -> None:
    """One rank of a 2-rank gloo world (run under torch.distributed.run): one agreed
    all-reduce, then the fault `mode`; the watchdog ends the process."""
    import torch

    from meshtrain.operations.watchdog import HangWatchdog, process_group_timeout
    from meshtrain.parallel.communication import comm
    from meshtrain.parallel.runtime.process_groups import init_parallel

    mesh = init_parallel(dp=2, device="cpu", timeout=process_group_timeout(TIMEOUT))
    with HangWatchdog(rank=mesh.rank, world_size=2, timeout=TIMEOUT, out=out):
        x = torch.ones(4)
        comm.all_reduce(x, mesh.dp)
        if mesh.rank == 0:
            comm.all_reduce(x, mesh.dp)
        elif mode == "mismatch":
            comm.all_gather(x, mesh.dp)
        else:
            time.sleep(600)  # a rank that sleeps forever (its watchdog still runs)


@pytest.mark.parametrize("mode,expected", [
    ("mismatch", "rank 0 issued all_reduce [4] float32 and rank 1 issued all_gather [8] float32"
                 " as collective #2 on axis dp"),
    ("sleep", "rank 1 never reached all_reduce #2 on axis dp; it last completed all_reduce #1"
              " on axis dp"),
], ids=["mismatch", "sleep"])
def test_watchdog_names_what_diverged(tmp_path, capsys, mode, expected):
    start = time.monotonic()
    result = run_torchrun(__file__, mode, str(tmp_path), timeout=120)
    assert time.monotonic() - start < TIMEOUT + 30
    lines = [line for line in result.stderr.splitlines() if line.startswith("meshtrain: hang")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"meshtrain: hang: {expected}"), lines[0]
    assert lines[0].endswith(f"dumps of ranks 0, 1 in {tmp_path / 'hang'} (meshtrain doctor"
                             f" {tmp_path})")
    assert sorted(p.name for p in (tmp_path / "hang").glob("rank_*.json")) == \
        ["rank_0.json", "rank_1.json"]
    assert cli.main(["doctor", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == lines[0]  # the same verdict


def _train_then(tmp_path, corpus, fault, rank: int, line_start: str) -> tuple[int, str, float]:
    """Start a 2-rank training run, send `fault` to `rank` after two steps; returns the exit
    code, stderr and the seconds from the fault to the line starting with `line_start` (the
    whole command ends within 10 s of it: a stopped rank is ended by the launcher)."""
    out, err = tmp_path / "run", tmp_path / "stderr"
    with err.open("w") as stderr:
        launcher = start_cli(
            "train", "--nproc", "2", "--device", "cpu", "--data", corpus, "--steps", "100000",
            "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--log-every", "1",
            "--eval-every", "0", "--collective-timeout", str(TIMEOUT), "--out", str(out),
            stderr=stderr, stdout=subprocess.DEVNULL)
    pid = None
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert launcher.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        pid = rank_pids(launcher.pid)[rank]
        os.kill(pid, fault)
        faulted = time.monotonic()
        while line_start not in err.read_text() and time.monotonic() < faulted + 60:
            time.sleep(0.2)
        named = time.monotonic() - faulted
        code = launcher.wait(timeout=60)
        assert time.monotonic() - faulted - named < 10, "the command outlived its verdict"
    finally:
        launcher.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return code, err.read_text(), named


def _meshtrain_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if not line.startswith(("train: step", "model states", "meshtrain: 2 ranks"))]


def test_a_stopped_rank_is_named(tmp_path, corpus):
    code, stderr, named = _train_then(tmp_path, corpus, signal.SIGSTOP, 0, "meshtrain: hang")
    assert named < TIMEOUT + 30
    assert code == EXIT_HANG, stderr[-3000:]
    lines = _meshtrain_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("meshtrain: hang: rank 0 never completed all_reduce #"), lines[0]
    assert "left no dump" in lines[0] and "rank 1 waited" in lines[0]


def test_a_killed_rank_is_named(tmp_path, corpus):
    code, stderr, named = _train_then(tmp_path, corpus, signal.SIGKILL, 1, "was killed")
    assert named < TIMEOUT + 30
    assert code == EXIT_PEER_FAILED, stderr[-3000:]
    lines = _meshtrain_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("meshtrain: rank 1 was killed by SIGKILL"), \
        stderr[-3000:]


def _loading_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.extended  # a stopped rank in training is default; this waits the start-up margin
def test_a_rank_stopped_during_start_up_is_a_hang_and_the_command_ends_soon_after(tmp_path,
                                                                                   corpus):
    out, err = tmp_path / "run", tmp_path / "stderr"
    with err.open("w") as stderr:
        launcher = start_cli(
            "train", "--nproc", "2", "--device", "cpu", "--data", corpus, "--steps", "5",
            "--micro-batch", "2", "--global-batch", "4", "--seq-len", "32", "--eval-every", "0",
            "--collective-timeout", str(TIMEOUT), "--out", str(out), stderr=stderr,
            stdout=subprocess.DEVNULL)
    ranks = {}
    try:
        deadline = time.monotonic() + 120
        while 1 not in (ranks := rank_pids(launcher.pid)) or not _loading_torch(ranks[1]):
            assert launcher.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.01)
        os.kill(ranks[1], signal.SIGSTOP)  # before it joins the process group
        stopped = time.monotonic()
        while "meshtrain: hang" not in err.read_text() and launcher.poll() is None:
            time.sleep(0.1)
        named = time.monotonic() - stopped
        code = launcher.wait(timeout=60)
        ended = time.monotonic() - stopped - named
    finally:
        launcher.kill()
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    lines = _meshtrain_lines(err.read_text())
    assert code == EXIT_HANG and len(lines) == 1, lines
    assert lines[0].startswith("meshtrain: hang: rank 1 never completed rendezvous #1 on axis"
                               " world and left no dump"), lines[0]
    assert named < TIMEOUT + 30 and ended < 10, (named, ended)


if __name__ == "__main__":
    _worker(*sys.argv[1:])
