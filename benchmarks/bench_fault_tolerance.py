"""One rank SIGKILLed mid-run, two ways, on 4 CPU ranks: replica groups under torchft (2 groups
x 2 ranks, `--fault-tolerance --max-restarts 1`: the other group keeps stepping, the failed one
restarts and heals from it) against today's whole-job restart from the last checkpoint
(`--nproc 4 --max-restarts 1 --auto-resume --save-every N`).

    python benchmarks/bench_fault_tolerance.py --steps 600 --kill-at 25 --save-every 20

Measured from outside: the launcher's metrics.jsonl is read every 50 ms (under fault tolerance
a row is written each step), so each row's wall time is when it appeared. Reported per run:
committed steps the survivors lost (rows of steps they had already written that are trained
again: a whole-job restart loses the steps after its checkpoint), steps discarded (the step in
flight), seconds from the kill until the replacement takes part again (fault tolerance: the
first row with both groups; a restart: the first new row), seconds from the kill until the run
is past the step it had reached, the wall time, and (fault tolerance) whether both groups'
final weights are bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import rank_pids  # noqa: E402

COMMON = ("--model", "tiny", "--seq-len", "64", "--global-batch", "8", "--micro-batch", "2",
          "--eval-every", "0",
          "--log-every", "1")


def _children(parent: int) -> list[tuple[int, str]]:
    """(pid, command line) of `parent`'s live children."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1]
                                            .split()[1]) == parent:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append((int(entry.name), command))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _victim(top: int, fault_tolerance: bool) -> int | None:
    """Rank 1 of the run (of replica group 1 under fault tolerance), once it exists."""
    launcher = top
    if fault_tolerance:
        launcher = next((pid for pid, cmd in _children(top) if "--replica-group-id 1" in cmd),
                        None)
        if launcher is None:
            return None
    return rank_pids(launcher).get(1)


def _rows(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a line being written
    return rows


def failure_run(out: Path, *, fault_tolerance: bool, steps: int, kill_at: int,
                save_every: int, timeout: float = 600.0, stop_after_rejoin: bool = False,
                layout: tuple[str, ...] = (), fault=None) -> dict:
    """Train, SIGKILL the victim rank once `kill_at` rows are written, train on; returns what
    happened (see the module's docstring) with the exit code and the stderr tail.
    `stop_after_rejoin`: SIGTERM the run 5 steps after the replacement took part again (a test
    then needs no guess of how many steps the restart takes); `layout`: flags of each group's
    layout (e.g. `--tp 2`); `fault(pid)`: what befalls the victim instead of SIGKILL."""
    flags = ["--nproc", "4", "--steps", str(steps), "--out", str(out), "--max-restarts", "1",
             "--save-every", str(save_every), *COMMON, *layout]
    flags += ["--replica-groups", "2", "--fault-tolerance"] if fault_tolerance else \
        ["--auto-resume"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    log = tempfile.TemporaryFile("w+")  # not a pipe: a full one would stall the ranks
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "train", *flags], env=env,
                            stderr=log, stdout=subprocess.DEVNULL, text=True)
    seen: dict[int, float] = {}  # step -> wall time its row first appeared
    killed, reached, deadline = None, 0, start + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        rows = _rows(out / "metrics.jsonl")
        now = time.monotonic()
        for row in rows:
            if "loss" in row:
                seen.setdefault(row["step"], now)
        if killed is None and len(seen) >= kill_at and \
                (victim := _victim(proc.pid, fault_tolerance)) is not None:
            reached = max(seen)
            (fault or _sigkill)(victim)
            killed = (now, {step for step in seen}, rows)
            seen_after: dict[int, float] = {}
        elif killed is not None:  # rows written since: appended, or rewritten after a restart
            before = killed[2]
            for i, row in enumerate(rows):
                if "loss" in row and (i >= len(before) or row != before[i]):
                    seen_after.setdefault((row["step"], row.get("replica_groups")), now)
            if stop_after_rejoin and _rejoined(seen_after, margin=5):
                proc.send_signal(signal.SIGTERM)
                stop_after_rejoin = False
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.seek(0)
    stderr = log.read()
    return _report(out, proc.returncode, stderr, start, killed, reached,
                   seen_after if killed else {}, fault_tolerance)


def _sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def _rejoined(after: dict, margin: int) -> bool:
    """Whether a row with both groups came `margin` steps after one with a group missing."""
    alone = [step for step, groups in after if groups == 1]
    return bool(alone) and any(groups == 2 and step >= min(alone) + margin
                               for step, groups in after)


def _report(out: Path, code: int, stderr: str, start: float, killed, reached: int,
            after: dict, fault_tolerance: bool) -> dict:
    rows = [row for row in _rows(out / "metrics.jsonl") if "loss" in row]
    kill_time = killed[0] if killed else float("nan")
    redone = [p for p in out.glob("metrics.after_step_*.jsonl")]
    lost = sum(len(_rows(p)) for p in redone)
    report = {"exit_code": code, "wall_s": time.monotonic() - start, "reached_at_kill": reached,
              "committed_steps_lost": lost, "rows": len(rows),
              "steps_in_order": [r["step"] for r in rows] == list(range(1, len(rows) + 1)),
              "stderr_tail": stderr.strip().splitlines()[-6:],
              "failure_lines": [line for line in stderr.splitlines()
                                if line.startswith("meshtrain: ") and "restart" in line]}
    if fault_tolerance:
        alone = [step for (step, groups) in after if groups == 1]
        both = [t for (step, groups), t in after.items()
                if groups == 2 and alone and step > min(alone)]
        report["rejoin_s"] = min(both) - kill_time if both else None
        groups = [json.loads(p.read_text()) for p in sorted((out / "replica_groups")
                                                            .glob("group*.json"))]
        report["discarded_steps"] = max((g["discarded_steps"] for g in groups), default=None)
        report["weights_equal"] = len(groups) == 2 and groups[0]["step"] == groups[1]["step"] \
            and groups[0]["weights_sha256"] == groups[1]["weights_sha256"]
        report["steps_with_one_group"] = sum(r.get("replica_groups") == 1 for r in rows)
    else:
        report["rejoin_s"] = min(after.values()) - kill_time if after else None
        report["discarded_steps"] = 1  # the step in flight dies with the job (not measured)
    past = [t for (step, _), t in after.items() if step > reached]
    report["past_reached_s"] = min(past) - kill_time if past else None
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--save-every", type=int, default=20)
    args = parser.parse_args()
    for fault_tolerance in (True, False):
        with tempfile.TemporaryDirectory() as folder:
            report = failure_run(Path(folder) / "run", fault_tolerance=fault_tolerance,
                                 steps=args.steps, kill_at=args.kill_at,
                                 save_every=args.save_every)
        name = "torchft replica groups 2x2" if fault_tolerance else "whole-job restart, 4 ranks"
        print(json.dumps({"run": name} | report, indent=1))


if __name__ == "__main__":
    main()
