"""Threads per process on the CPU: the cores no one else is using, shared by the local ranks.

A process with as many OpenMP threads as cores collapses when another process wants a core:
its threads wait for each other at every parallel region (the default run took 2.4x its quiet
time beside one busy process on 2 cores, one thread per process 0.95x; docs/benchmarks.md). So
the default counts the cores busy right now and leaves them out; `OMP_NUM_THREADS` or the
`threads` setting, when given, win."""

from __future__ import annotations

import os
import time

SAMPLE_S = 0.1
"""How long the cores' busy time is sampled before a run starts."""


def threads_per_rank(local_ranks: int, setting: int | None = None) -> int:
    """`setting` if given, else `OMP_NUM_THREADS` if set, else the idle cores / `local_ranks`
    (at least 1)."""
    if setting is not None:
        return setting
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cores = os.cpu_count() or 1
    idle = cores - busy_cores()
    return max(1, min(cores, int(idle + 0.5)) // local_ranks)


def busy_cores() -> float:
    """Cores other processes keep busy now: from /proc/stat over `SAMPLE_S` (Linux), else the
    1-minute load average, else 0."""
    try:
        first = _cpu_times()
        time.sleep(SAMPLE_S)
        second = _cpu_times()
    except OSError:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    total, idle = (b - a for a, b in zip(first, second, strict=True))
    return (os.cpu_count() or 1) * (1 - idle / total) if total > 0 else 0.0


def _cpu_times() -> tuple[int, int]:
    """(all, idle) clock ticks of every core since boot; idle counts I/O waits."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:9]]
    return sum(ticks), ticks[3] + ticks[4]
