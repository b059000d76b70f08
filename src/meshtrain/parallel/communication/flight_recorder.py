"""A per-rank ring of the last collectives this rank issued, for diagnosing hangs.

Every helper in `comm` reports to the armed `FlightRecorder`: the mesh axis, a sequence number
per axis (the n-th collective this rank issued on it), the op, shape and dtype, and when this rank
issued it, started to block on it and saw it end. An async work blocks where it is waited, not
where it is issued, so the compute between the two never counts as waiting. On CUDA the host
does not block in NCCL calls: an event recorded after the call ends the entry when the device
passes it (`poll_device`).

Beside the ring it keeps per-step totals (`begin_step`, `end_step`): the seconds this rank was
blocked in collectives during a step, and the rest of the step's wall time, its compute. Compared
across ranks they name a straggler (`operations.stragglers`): the slow rank computes longer, its
peers wait longer. On CUDA the host does not block in NCCL calls, so there the totals see a slow
host, not a slow device.

Its methods that a training step calls run as plain Python even inside a compiled region
(`_eager`): they read clocks and keep a ring, nothing for Dynamo to trace into a graph.

A watchdog thread reads the recorder without a lock: the main thread only replaces attributes,
which the interpreter does atomically, so a reader sees an entry before or after an update.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from meshtrain.mesh import MeshAxis

_eager = torch.compiler.disable  # the bookkeeping is not traced (nor warned about) by Dynamo
P2P_OPS = ("send", "recv", "sendrecv")  # matched by peer, not by sequence number
ARMED: list[FlightRecorder] = []  # observers `comm` reports to (the last one armed)


class Entry:
    """One collective: `blocked` and `ended` are monotonic seconds or None (not yet)."""

    __slots__ = ("axis", "seq", "op", "shape", "dtype", "peer", "issued", "blocked", "ended",
                 "event")

    def __init__(self, axis: str, seq: int, op: str, shape: tuple, dtype: str, peer: int | None):
        self.axis, self.seq, self.op, self.shape, self.dtype = axis, seq, op, shape, dtype
        self.peer = peer
        self.issued = time.monotonic()
        self.blocked: float | None = None
        self.ended: float | None = None
        self.event = None  # a CUDA event recorded after the call (device tensors only)

    def to_json(self, wall: float) -> dict:
        """`wall`: time.time() - time.monotonic(), to turn monotonic stamps into wall time."""
        def stamp(t):
            return None if t is None else round(t + wall, 3)

        return {"axis": self.axis, "seq": self.seq, "op": self.op, "shape": list(self.shape),
                "dtype": self.dtype, "peer": self.peer, "issued": stamp(self.issued),
                "blocked": stamp(self.blocked), "ended": stamp(self.ended)}


class FlightRecorder:
    """The last `capacity` collectives of this rank, and its last `capacity` steps' totals. Arm
    it for a region with `with recorder:` (see `comm`); `waiting` is the entry the host is
    blocked in, if any."""

    def __init__(self, capacity: int = 128):
        self.entries: deque[Entry] = deque(maxlen=capacity)
        self.seq: dict[str, int] = {}  # axis name -> sequence number of its last collective
        self.axes: dict[str, tuple[int, ...]] = {}  # axis name -> its global ranks
        self.waiting: Entry | None = None
        self.blocked_s = 0.0  # seconds the host spent blocked in collectives, all told
        self.steps: deque[tuple[float, float]] = deque(maxlen=capacity)  # (compute, blocked)
        self._step_start: tuple[float, float] | None = None  # (monotonic, blocked_s) at begin

    def __enter__(self) -> FlightRecorder:
        ARMED.append(self)
        return self

    def __exit__(self, *exc) -> None:
        ARMED.remove(self)

    @_eager
    def issue(self, op: str, axis: MeshAxis, tensor: torch.Tensor | None, *,
              peer: int | None = None, blocking: bool = True) -> Entry:
        """Record a call about to be made; a `blocking` one is waited on at once."""
        name = axis.name
        seq = self.seq[name] = self.seq.get(name, 0) + 1
        if name not in self.axes:
            self.axes[name] = axis.ranks
        if tensor is None:
            entry = Entry(name, seq, op, (), "object", peer)
        else:
            entry = Entry(name, seq, op, tuple(tensor.shape), str(tensor.dtype)[6:], peer)
            if tensor.is_cuda:
                entry.event = torch.cuda.Event()
        self.entries.append(entry)
        if blocking:
            entry.blocked = entry.issued
            self.waiting = entry
        return entry

    @_eager
    def done(self, entry: Entry, work=None):
        """The call returned: a blocking one has ended; an async `work` is returned wrapped so
        that its `wait()` is tracked."""
        if work is None:
            self.end(entry)
            return None
        return TrackedWork(work, entry, self)

    @_eager
    def block(self, entry: Entry) -> None:
        """The host starts waiting for `entry` (an async work's wait)."""
        entry.blocked = time.monotonic()
        self.waiting = entry

    @_eager
    def end(self, entry: Entry) -> None:
        """The host is past `entry`; on CUDA the device may still be in it."""
        now = time.monotonic()
        if entry.event is None:
            entry.ended = now
        else:  # recorded before `waiting` clears: the watchdog never queries an unrecorded event
            entry.event.record()
            if entry.blocked is None:
                entry.blocked = entry.issued
        if entry.blocked is not None:
            self.blocked_s += now - entry.blocked
        self.waiting = None

    def begin_step(self) -> None:
        """A training step starts: its totals count from here."""
        self._step_start = (time.monotonic(), self.blocked_s)

    def end_step(self) -> tuple[float, float]:
        """The step begun last ended: its (compute, blocked) seconds, also kept in `steps`."""
        began, blocked_before = self._step_start
        blocked = self.blocked_s - blocked_before
        totals = (max(0.0, time.monotonic() - began - blocked), blocked)
        self.steps.append(totals)
        self._step_start = None
        return totals

    def poll_device(self) -> None:
        """End the CUDA entries whose event the device has passed (watchdog thread)."""
        for entry in list(self.entries):
            if entry.event is not None and entry.ended is None and entry.blocked is not None \
                    and self.waiting is not entry and entry.event.query():
                entry.ended = time.monotonic()

    def stuck(self) -> tuple[Entry, float] | None:
        """The entry this rank has waited in longest and for how many seconds, or None."""
        now, oldest = time.monotonic(), None
        waiting = self.waiting
        if waiting is not None and waiting.blocked is not None:
            oldest = waiting
        for entry in list(self.entries):
            if entry.event is not None and entry.ended is None and entry.blocked is not None \
                    and (oldest is None or entry.blocked < oldest.blocked):
                oldest = entry
        return None if oldest is None else (oldest, now - oldest.blocked)

    def dump(self) -> dict:
        """The ring as JSON-ready data (oldest first)."""
        wall = time.time() - time.monotonic()
        entries = list(self.entries)
        waiting = self.stuck()
        return {"axes": {name: list(ranks) for name, ranks in self.axes.items()},
                "seq": dict(self.seq),
                "waiting": None if waiting is None else
                waiting[0].to_json(wall) | {"waited_s": round(waiting[1], 3)},
                "entries": [entry.to_json(wall) for entry in entries],
                "steps": [[round(c, 4), round(b, 4)] for c, b in list(self.steps)]}


class TrackedWork:
    """A `dist.Work` whose `wait()` the flight recorder sees: that is where a rank blocks."""

    __slots__ = ("work", "entry", "recorder")

    def __init__(self, work, entry: Entry, recorder: FlightRecorder):
        self.work, self.entry, self.recorder = work, entry, recorder

    def wait(self, *args) -> bool:
        self.recorder.block(self.entry)
        done = self.work.wait(*args)
        self.recorder.end(self.entry)
        return done
