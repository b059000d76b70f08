"""The pipeline bubble from meshtrain's own schedules, run by the simulator on per-chunk costs.

Long steps are simulated at a capped number of micro-batches and extended at the busiest rank's
per-micro-batch rate: once a schedule reaches its steady state every further micro-batch adds
exactly that rank's work (checked against the uncapped simulation in the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from meshtrain.parallel.runtime import schedules
from meshtrain.parallel.runtime.plan import ParallelPlan


class ChunkCost(NamedTuple):
    """One micro-batch through one model chunk on one rank (seconds; parameters: count)."""

    forward: float
    forward_comm: float
    """Communication on the forward's critical path (after overlap)."""
    backward: float
    backward_comm: float
    parameters: float


@dataclass(frozen=True)
class PipelineRun:
    makespan: float
    busy: list[float]
    """Per pipeline rank: compute and critical-path communication over the step."""
    peak_in_flight: list[int]
    """Per pipeline rank: most (micro-batch, chunk) pairs whose activations it holds."""
    pp: int
    virtual_stages: int
    micro_batches: int

    def chunks_of(self, rank: int) -> list[int]:
        """Global chunk indices a pipeline rank holds (rank s: s, s + pp, ...)."""
        return [schedules.model_chunk(rank, c, self.pp) for c in range(self.virtual_stages)]


def run_pipeline(chunks: list[ChunkCost], layout: ParallelPlan, micro_batches: int) -> PipelineRun:
    p, v, m = layout.pp, layout.virtual_stages, micro_batches
    forward = tuple(c.forward + c.forward_comm for c in chunks)
    backward = tuple(c.backward + c.backward_comm for c in chunks)
    if p == 1:
        busy = m * (forward[0] + backward[0])
        return PipelineRun(busy, [busy], [1], 1, 1, m)
    if layout.pp_schedule == "2bw":
        one = _simulate("2bw", p, v, m, forward, backward, steps=1)
        two = _simulate("2bw", p, v, m, forward, backward, steps=2)
        busy = [b2 - b1 for b1, b2 in zip(one.busy, two.busy, strict=True)]
        return PipelineRun(two.makespan - one.makespan, busy, two.peak_in_flight, p, v, m)
    cap = p * max(8, 2 * v + 2)
    simulated = _simulate(layout.pp_schedule, p, v, min(m, cap), forward, backward)
    per_micro = [sum(forward[g] + backward[g] for g in range(r, p * v, p)) for r in range(p)]
    extra = max(m - cap, 0)
    busy = [b + extra * rate for b, rate in zip(simulated.busy, per_micro, strict=True)]
    return PipelineRun(simulated.makespan + extra * max(per_micro), busy,
                       simulated.peak_in_flight, p, v, m)


@functools.lru_cache(maxsize=4096)
def _simulate(schedule: str, p: int, v: int, m: int, forward: tuple[float, ...],
              backward: tuple[float, ...], steps: int = 1) -> schedules.Simulation:
    return schedules.simulate(_schedule(schedule, p, v, m, steps), forward_cost=list(forward),
                              backward_cost=list(backward), v=v)


@functools.lru_cache(maxsize=256)
def _schedule(schedule: str, p: int, v: int, m: int, steps: int) -> list[list[schedules.Action]]:
    """The action lists (costs aside): a search simulates the same shape with many costs, and
    building the lists is a third of a simulation. `simulate` only reads them."""
    if schedule == "gpipe":
        return schedules.gpipe(p, m)
    if schedule == "1f1b":
        return schedules.one_f_one_b(p, m)
    if schedule == "interleaved":
        return schedules.interleaved(p, m, v)
    return schedules.pipedream_2bw(p, m, steps)
