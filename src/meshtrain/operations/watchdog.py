"""The hang watchdog: a daemon thread per rank that ends a run whose collective waits too long.

It reads the rank's `FlightRecorder`, never the backend, so it works the same on gloo and NCCL,
and it counts only the time this rank is blocked in one collective (compilation, evaluation or a
checkpoint write between collectives never trips it). When a wait passes `collective_timeout`:
1. the rank dumps its ring to `OUT/hang/rank_N.json`;
2. every other rank's watchdog sees the new dump (it looks at `OUT/hang` each poll) and dumps its
   own, hung or not, so the verdict sees every rank that can still run Python;
3. each dumping rank waits a short grace for the others (all of them, or until the grace ends:
   a stopped or dead rank never dumps), then the lowest rank that dumped prints the one line
   (`doctor.hang_line`) and writes it to `OUT/hang/verdict.txt`; the others wait for that file;
4. every dumping rank leaves with `EXIT_HANG` through `os._exit`: the main thread is stuck in C++
   and cannot be unwound. The elastic launcher then stops the ranks that did not dump.
The process group's start-up counts as a collective of the world (`rendezvous`), allowed
START_UP_MARGIN_S more (the ranks load torch at their own pace): a rank stopped or dead before
it joins is named like a peer that never reached a call.
The exchange is through files, not the process group's store: `--out` is already shared by all
ranks (checkpoints are written there), the dumps must be files for `meshtrain doctor` anyway, and
a store hosted by a stopped rank would itself hang.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

from meshtrain.data.corpus import write_atomic
from meshtrain.mesh import MeshAxis
from meshtrain.operations.doctor import hang_line, read_dumps
from meshtrain.operations.failures import EXIT_HANG
from meshtrain.operations.stopping import report_exit
from meshtrain.parallel.communication.flight_recorder import FlightRecorder

PROCESS_GROUP_MARGIN_S = 60.0  # the backend's timeout comes this much after ours
RING_CAPACITY = 128  # collectives each rank remembers
CLOCK_SKEW_S = 2.0  # dumps older than this before arming belong to an earlier run
START_UP_MARGIN_S = 15.0  # a rendezvous may wait this much past `collective_timeout`


def process_group_timeout(collective_timeout: float) -> datetime.timedelta:
    """The process group's own timeout: past the watchdog's deadline and grace, so the watchdog
    names what hung before the backend raises its own error."""
    return datetime.timedelta(seconds=collective_timeout + PROCESS_GROUP_MARGIN_S)


class HangWatchdog:
    """Arms a `FlightRecorder` and watches it while the `with` block runs (on every rank)."""

    def __init__(self, *, rank: int, world_size: int, timeout: float, out: str | Path):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.out, self.hang_dir = Path(out), Path(out) / "hang"
        self.recorder = FlightRecorder(RING_CAPACITY)
        self.poll = min(1.0, timeout / 4)
        self.grace = min(10.0, max(2.0, timeout / 2))
        self.run = (f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
                    f":{os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}")
        self._stop, self._firing = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._watch, name="meshtrain-watchdog",
                                        daemon=True)
        self.armed = 0.0  # when the `with` block began (less the skew); set by __enter__

    def __enter__(self) -> HangWatchdog:
        self.recorder.__enter__()
        self.armed = time.time() - CLOCK_SKEW_S
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._firing.is_set():  # a peer's exit broke our collective: let the verdict finish
            self._thread.join()
        self.recorder.__exit__(*exc)

    @contextlib.contextmanager
    def rendezvous(self):
        """Watch the process group's start-up (every rank must join) as one collective."""
        world = MeshAxis("world", self.world_size, self.rank, tuple(range(self.world_size)),
                         None)
        entry = self.recorder.issue("rendezvous", world, None)
        yield
        self.recorder.end(entry)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self.recorder.poll_device()
            stuck = self.recorder.stuck()
            margin = START_UP_MARGIN_S if stuck and stuck[0].op == "rendezvous" else 0.0
            if stuck is not None and stuck[1] > self.timeout + margin:
                return self._fire("waited longer than `collective_timeout`")
            if self._peer_dumped():
                return self._fire("another rank dumped")

    def _peer_dumped(self) -> bool:
        try:
            if self.hang_dir.stat().st_mtime < self.armed:
                return False
        except OSError:
            return False
        return bool(set(self._fresh_dumps()) - {self.rank})

    def _fresh_dumps(self) -> dict[int, dict]:
        return read_dumps(self.hang_dir, since=self.armed, run=self.run)

    def _fire(self, reason: str) -> None:
        self._firing.set()
        code = EXIT_HANG
        try:
            own = self._dump(reason)
            end = time.monotonic() + self.grace
            while time.monotonic() < end and len(self._fresh_dumps()) < self.world_size:
                time.sleep(0.1)
            self._report(own)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            report_exit(code)  # meshtrain's launcher then ends the ranks that left no dump
            os._exit(code)

    def _dump(self, reason: str) -> dict:
        record = {"rank": self.rank, "world_size": self.world_size, "run": self.run,
                  "time": round(time.time(), 3), "host": socket.gethostname(),
                  "pid": os.getpid(), "reason": reason,
                  "collective_timeout": self.timeout} | self.recorder.dump()
        try:
            self.hang_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(self.hang_dir / f"rank_{self.rank}.json",
                         json.dumps(record, indent=1).encode())
        except OSError as e:
            print(f"meshtrain: rank {self.rank} could not write its hang dump: {e}",
                  file=sys.stderr)
        return record

    def _report(self, own: dict) -> None:
        """The lowest rank that dumped prints the verdict; the others wait until it has."""
        dumps = self._fresh_dumps() | {self.rank: own}
        marker = self.hang_dir / "verdict.txt"
        if self.rank != min(dumps):
            end = time.monotonic() + self.grace + self.poll
            while time.monotonic() < end:
                if marker.exists() and marker.stat().st_mtime >= self.armed:
                    return
                time.sleep(0.1)
            dumps = self._fresh_dumps() | {self.rank: own}  # the lowest went silent: speak
        line = hang_line(dumps, self.out)
        print(line, file=sys.stderr, flush=True)
        try:
            marker.write_text(line + "\n")
        except OSError:
            pass  # the line is printed; the file only tells the other ranks so
