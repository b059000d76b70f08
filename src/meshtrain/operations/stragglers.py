"""Straggler detection: which rank computes much longer than its peers, every `straggler_window`
steps.

Each rank's flight recorder keeps per-step totals of its compute and of its time blocked in
collectives (`FlightRecorder.end_step`). A slow rank's steps are all compute; its peers' extra
time is spent blocked, waiting for it, so compute names the cause where step time (equal on
every rank of a synchronous step) cannot. Every window the ranks exchange their window's sums in
one all-gather of three floats each over the world (compute, blocked, pipeline stage), and every
rank names the same stragglers: a rank whose compute is over `threshold` times the median of the
ranks of its pipeline stage (those doing the same work; the lower median of an even count, so of
two ranks the slower is compared with the faster). A stage of one rank is compared with nobody.
The run's first step (compilation, warm-up) is left out.

`persistent(k)` is the hook for acting on a straggler: the ranks named in each of the last k
windows.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.communication import comm

HISTORY = 64  # windows whose named ranks `persistent` can look back on


@dataclass(frozen=True)
class Window:
    """One comparison: steps `first`..`last` (1-based), each global rank's sums in seconds and
    its compute over its stage's median (None: a stage of one rank)."""

    first: int
    last: int
    compute: list[float]
    blocked: list[float]
    ratios: list[float | None]
    threshold: float

    @property
    def named(self) -> list[int]:
        return [r for r, ratio in enumerate(self.ratios)
                if ratio is not None and ratio > self.threshold]

    def fields(self) -> dict:
        """The metrics row's keys for this window."""
        largest = max((ratio for ratio in self.ratios if ratio is not None), default=1.0)
        return {"stragglers": self.named, "compute_max_over_median": round(largest, 3)}

    def line(self) -> str:
        """The progress line naming the stragglers (when some are named)."""
        ranks = "; ".join(f"rank {r} computed {self.compute[r]:.2f} s, {self.ratios[r]:.1f}x"
                          f" its stage's median (blocked in collectives {self.blocked[r]:.2f} s)"
                          for r in self.named)
        return (f"meshtrain: straggler: steps {self.first}-{self.last}: {ranks}; the threshold"
                f" is {self.threshold:g}x")


def compare(compute: list[float], stages: list[int]) -> list[float | None]:
    """Each rank's compute over the median of its stage's ranks (the lower median of an even
    count); None for a rank alone in its stage or a stage that computed nothing."""
    ratios: list[float | None] = [None] * len(compute)
    for stage in set(stages):
        ranks = [r for r, s in enumerate(stages) if s == stage]
        median = statistics.median_low(compute[r] for r in ranks)
        if len(ranks) > 1 and median > 0:
            for r in ranks:
                ratios[r] = compute[r] / median
    return ratios


class StragglerDetector:
    """Sums this rank's step totals and compares them across the world every `window` steps."""

    def __init__(self, mesh: ParallelMesh, *, window: int, threshold: float):
        self.mesh, self.window, self.threshold = mesh, window, threshold
        self.compute = self.blocked = 0.0
        self.first: int | None = None  # the first step of the window summed
        self.history: deque[list[int]] = deque(maxlen=HISTORY)

    def step(self, done: int, totals: tuple[float, float] | None) -> Window | None:
        """After step `done` (1-based): add its (compute, blocked) totals (None: left out); at a
        window's end compare (collective over the world) and return the window."""
        if totals is not None:
            self.first = done if self.first is None else self.first
            self.compute += totals[0]
            self.blocked += totals[1]
        if done % self.window or self.first is None:
            return None  # every rank has the same steps counted: all skip together
        mine = torch.tensor([self.compute, self.blocked, float(self.mesh.pp.rank)],
                            dtype=torch.float64, device=self.mesh.device)
        every = comm.all_gather(mine, self.mesh.world).view(-1, 3).tolist()
        compute = [row[0] for row in every]
        window = Window(self.first, done, compute, [row[1] for row in every],
                        compare(compute, [int(row[2]) for row in every]), self.threshold)
        self.history.append(window.named)
        self.compute = self.blocked = 0.0
        self.first = None
        return window

    def persistent(self, windows: int) -> list[int]:
        """The ranks named in each of the last `windows` windows (none before that many)."""
        if len(self.history) < windows:
            return []
        last = list(self.history)[-windows:]
        return sorted(set(last[0]).intersection(*last[1:]))


def _window_row(row) -> bool:
    """Whether `row` (parsed JSON) is a metrics row of a compared window."""
    def number(value) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool)

    return isinstance(row, dict) and isinstance(row.get("step"), int) and \
        number(row.get("compute_max_over_median")) and isinstance(row.get("stragglers"), list) \
        and all(isinstance(rank, int) for rank in row["stragglers"])


def summary(run_dir: Path) -> list[str]:
    """`meshtrain doctor`'s lines on stragglers, from the run's metrics.jsonl: each rank named,
    in how many windows and at which steps; none when the run compared no window."""
    windows = []
    try:
        lines = (Path(run_dir) / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if _window_row(row):
            windows.append(row)
    if not windows:
        return []
    worst = max(row["compute_max_over_median"] for row in windows)
    head = (f"stragglers: {len(windows)} windows compared (steps up to {windows[-1]['step']});"
            f" the slowest rank's compute at most {worst:.2f}x its stage's median")
    named: dict[int, list[int]] = {}
    for row in windows:
        for rank in row["stragglers"]:
            named.setdefault(rank, []).append(row["step"])
    if not named:
        return [head, "no rank was named a straggler"]
    return [head] + [f"rank {rank}: named in {len(steps)} of {len(windows)} windows, from step"
                     f" {steps[0]} to step {steps[-1]}" for rank, steps in sorted(named.items())]
