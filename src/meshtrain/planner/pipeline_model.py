"""The pipeline bubble from meshtrain's own schedules, run by the simulator on per-chunk costs.

Long steps are simulated at a capped number of micro-batches and extended at the steady state's
rate: each further micro-batch adds the busiest rank's work, or, where ranks share processors
(`Hardware.oversubscription`), every further p micro-batches add what the last p added (read
from a second simulation p micro-batches shorter). Both are checked against the uncapped
simulation in the tests.

A schedule with a split backward (zb-h1, zb-v) runs each chunk's backward as `I` and `W`
(`split_backward`), and a schedule places the chunks (zb-v in a V, `actions.v_shape_chunk`:
rank 0 then holds the first global chunk and the last). A schedule whose steps overlap (no flush:
2BW) is priced by its steady state, the difference of two steps' simulation and one's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schedules.actions import Action
from meshtrain.parallel.schedules.catalog import pipeline_schedule
from meshtrain.parallel.schedules.releases import held_boundary_tensors, send_releases
from meshtrain.parallel.schedules.simulator import Simulation, simulate


class ChunkCost(NamedTuple):
    """One micro-batch through one model chunk on one rank (seconds; parameters: count)."""

    forward: float
    forward_comm: float
    """Communication on the forward's critical path (after overlap)."""
    backward: float
    backward_comm: float
    parameters: float
    weight_grad: float = 0.0
    """Of `backward`: what a split backward runs at `W` (the weight-gradient matmuls)."""
    weight_grad_comm: float = 0.0
    """Of `backward_comm`: what a split backward runs at `W` (sequence parallelism's
    all-gathers of the inputs the weight gradients need)."""
    expert_parameters: float = 0.0
    """Of `parameters`: the routed experts' (`LayerWork.expert_parameters`)."""


@dataclass(frozen=True)
class PipelineRun:
    makespan: float
    busy: list[float]
    """Per pipeline rank: compute and critical-path communication over the step."""
    peak_in_flight: list[int]
    """Per pipeline rank: most (micro-batch, chunk) pairs whose activations it holds (from
    the forward until the `B`, or under a split backward the `W`)."""
    pp: int
    chunks_per_rank: int
    micro_batches: int
    schedule: str

    def chunks_of(self, rank: int) -> list[int]:
        return rank_chunks(self.schedule, self.pp, self.chunks_per_rank, rank)


def rank_chunks(schedule: str, p: int, v: int, rank: int) -> list[int]:
    """Global chunk indices a pipeline rank holds, in the schedule's placement (looped: s,
    s + p, ...; zb-v: s and 2p - 1 - s)."""
    place = pipeline_schedule(schedule).placement
    return [place(rank, c, p) for c in range(v)]


def split_backward(chunks: list[ChunkCost]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each global chunk's `I` and `W` cost. `W` is the backward's weight half as `costs.py`
    counts it (a linear layer's weight gradient is one matmul the size of its input
    gradient's, so about half of its backward); `I` is the rest: the input-gradient matmuls,
    attention, elementwise work, recomputation, and the communication, which stays on `I`
    because the previous chunk waits for it (only what the weight gradients alone need moves
    to `W`). The first global chunk sends no input gradient: its `I` does nothing and its `W`
    is the fused backward (`costs.chunk_costs` gives it weight_grad = backward)."""
    weight = tuple(c.weight_grad + c.weight_grad_comm for c in chunks)
    whole = (c.backward + c.backward_comm for c in chunks)
    return tuple(b - w for b, w in zip(whole, weight, strict=True)), weight


def run_pipeline(chunks: list[ChunkCost], layout: ParallelPlan, micro_batches: int,
                 oversubscription: float = 1.0) -> PipelineRun:
    """Simulate the layout's schedule on the chunk costs; `oversubscription` as the hardware's
    (`Hardware.oversubscription`: ranks sharing processors speed up while others wait)."""
    p, v, m, o = layout.pp, layout.chunks_per_rank, micro_batches, oversubscription
    schedule, kind = layout.pp_schedule, layout.schedule
    forward = tuple(c.forward + c.forward_comm for c in chunks)
    backward = tuple(c.backward + c.backward_comm for c in chunks)
    if p == 1:
        busy = m * (forward[0] + backward[0])
        return PipelineRun(busy, [busy], [1], 1, 1, m, schedule)
    if not kind.flushes:  # one step of the steady state
        one = _simulate(schedule, p, v, m, forward, backward, steps=1, oversubscription=o)
        two = _simulate(schedule, p, v, m, forward, backward, steps=2, oversubscription=o)
        busy = [b2 - b1 for b1, b2 in zip(one.busy, two.busy, strict=True)]
        return PipelineRun(two.makespan - one.makespan, busy, two.peak_in_flight, p, v, m,
                           schedule)
    halves = split_backward(chunks) if kind.split_backward else (None, None)
    cap = p * max(8, 2 * v + 2)
    simulated = _simulate(schedule, p, v, min(m, cap), forward, backward, *halves,
                          oversubscription=o)
    if m <= cap:
        return PipelineRun(simulated.makespan, simulated.busy, simulated.peak_in_flight, p, v,
                           m, schedule)
    extra = m - cap
    if o == 1:  # every further micro-batch adds the busiest rank's work: it sets the pace
        per_micro = [sum(forward[g] + backward[g] for g in rank_chunks(schedule, p, v, r))
                     for r in range(p)]
        busy = [b + extra * w for b, w in zip(simulated.busy, per_micro, strict=True)]
        return PipelineRun(simulated.makespan + extra * max(per_micro), busy,
                           simulated.peak_in_flight, p, v, m, schedule)
    # Shared processors: how waits overlap sets the pace; every further p micro-batches add
    # what the last p added.
    shorter = _simulate(schedule, p, v, cap - p, forward, backward, *halves, oversubscription=o)
    scale = extra / p
    busy = [b + scale * (b - s) for b, s in zip(simulated.busy, shorter.busy, strict=True)]
    return PipelineRun(simulated.makespan + scale * (simulated.makespan - shorter.makespan),
                       busy, simulated.peak_in_flight, p, v, m, schedule)


@functools.lru_cache(maxsize=4096)
def _simulate(schedule: str, p: int, v: int, m: int, forward: tuple[float, ...],
              backward: tuple[float, ...], input_grad: tuple[float, ...] | None = None,
              weight_grad: tuple[float, ...] | None = None, steps: int = 1,
              oversubscription: float = 1.0) -> Simulation:
    return simulate(
        _schedule(schedule, p, v, m, steps), forward_cost=list(forward),
        backward_cost=list(backward), v=v, placement=pipeline_schedule(schedule).placement,
        input_grad_cost=None if input_grad is None else list(input_grad),
        weight_grad_cost=None if weight_grad is None else list(weight_grad),
        oversubscription=oversubscription)


@functools.lru_cache(maxsize=256)
def _schedule(schedule: str, p: int, v: int, m: int, steps: int) -> list[list[Action]]:
    """The action lists (costs aside): a search simulates the same shape with many costs, and
    building the lists is a third of a simulation. `simulate` only reads them."""
    return pipeline_schedule(schedule).action_lists(p, m, v=v, steps=steps)


@functools.lru_cache(maxsize=256)
def held_boundaries(schedule: str, p: int, v: int, m: int) -> tuple[int, ...]:
    """Per rank: the most boundary tensors the runtime holds at once (forward outputs until
    their backward, a received gradient until used, sends until waited:
    `releases.held_boundary_tensors`), over a step (2BW: its steady state, two steps). Counted
    at the simulation's cap of micro-batches and extended at the rate of its last p (none
    where the schedule bounds them; GPipe's outputs grow with m)."""
    if p == 1:
        return (0,)
    kind, cap = pipeline_schedule(schedule), p * max(8, 2 * v + 2)

    def count(n: int) -> list[int]:
        lists = _schedule(schedule, p, v, n, 1 if kind.flushes else 2)
        releases = send_releases(lists, kind.placement)
        return [held_boundary_tensors(actions, releases[r], r, p, v, kind.placement)
                for r, actions in enumerate(lists)]

    if m <= cap:
        return tuple(count(m))
    extra = (m - cap) / p
    return tuple(round(c + extra * (c - s)) for c, s in zip(count(cap), count(cap - p),
                                                            strict=True))
