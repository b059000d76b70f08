"""Talking to the long-lived worker ranks the benchmarks keep between rounds."""

from __future__ import annotations

import queue


def collect(results, procs, kind: str) -> list[tuple]:
    """The payload of one `(kind, rank, *payload)` message from every worker, in rank order.

    Raises with the worker's traceback on an `("error", rank, text)` message, and if a worker
    died without reporting (instead of waiting forever).
    """
    got: dict[int, tuple] = {}
    while len(got) < len(procs):
        try:
            msg = results.get(timeout=5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive()]
            if dead:
                raise RuntimeError(f"rank(s) {dead} exited without a report") from None
            continue
        if msg[0] == "error":
            raise RuntimeError(f"rank {msg[1]} failed:\n{msg[2]}")
        assert msg[0] == kind, msg
        got[msg[1]] = msg[2:]
    return [got[r] for r in range(len(procs))]


def stop_workers(commands, procs) -> None:
    """Ask every worker to exit (a None command), then make sure it has."""
    for q in commands:
        q.put(None)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()
