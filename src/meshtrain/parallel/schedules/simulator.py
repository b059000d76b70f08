"""A simulator that runs pipeline schedules on costs instead of processes.

`simulate` replays every rank's action list with a cost per action and returns each rank's busy
time, the makespan and the peak number of micro-batches (chunks) whose activations a rank holds,
so bubble and memory claims are checked without running a model, and the planner prices a
layout's schedule with it (`planner/pipeline_model.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Action,
    Placement,
    model_chunk,
)


@dataclass
class Simulation:
    makespan: float
    busy: list[float]  # per rank
    peak_in_flight: list[int]  # per rank: forwarded (micro, chunk)s whose B or W is not done
    timeline: list[list[tuple[Action, float, float]]]  # per rank: (action, start, end)
    chunks_per_rank: int = 1

    def idle_fraction(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan

    @property
    def peak_activations(self) -> list[float]:
        """`peak_in_flight` in whole-stage units: a chunk holds 1/v of a stage's layers, so
        schedules with different chunk counts compare on one memory scale."""
        return [n / self.chunks_per_rank for n in self.peak_in_flight]


def simulate(schedule: list[list[Action]], *, forward_cost: float | Sequence[float] = 1.0,
             backward_cost: float | Sequence[float] = 2.0, v: int = 1,
             input_grad_cost: float | Sequence[float] | None = None,
             weight_grad_cost: float | Sequence[float] | None = None,
             placement: Placement = model_chunk, oversubscription: float = 1.0) -> Simulation:
    """Run every rank's list in order; an action waits for its input (`input_ready`). A number
    is a cost per whole stage (a chunk of an interleaved schedule costs 1/v of it); a sequence
    gives each model chunk's own cost, in global chunk order (uneven stages, the head on the
    last one). `I` and `W` cost half of `backward_cost` each unless given. A chunk's
    activations count as held from its forward until its `B` or `W`: the weight gradient still
    needs them. `placement` maps (rank, local chunk) to the global chunk (`v_shape_chunk` for
    ZB-V). Communication is free.

    `oversubscription` o > 1: the ranks share processors, o ranks to one when all compute (as
    gloo ranks on a CPU host with fewer cores than ranks), and the costs were measured so; while
    only b of the p ranks compute, each runs min(o, p / b) times as fast: a waiting rank's share
    of the processors goes to the busy ones, and `busy` is wall time spent computing."""
    p = len(schedule)
    backward = _chunk_costs(backward_cost, p, v)
    costs = {FORWARD: _chunk_costs(forward_cost, p, v), BACKWARD: backward,
             INPUT_GRAD: _half_unless_given(input_grad_cost, backward, p, v),
             WEIGHT_GRAD: _half_unless_given(weight_grad_cost, backward, p, v)}
    replay = _Replay(schedule, costs, placement, v, oversubscription)
    ready: Sequence[int] = range(p)
    while True:
        for s in ready:
            replay.start_next(s)
        if not replay.running:
            if not replay.remaining:
                makespan = max((t[-1][2] for t in replay.timeline if t), default=0.0)
                return Simulation(makespan, replay.busy, replay.peak, replay.timeline, v)
            stuck = {s: schedule[s][replay.position[s]] for s in range(p)
                     if replay.position[s] < len(schedule[s])}
            raise RuntimeError(f"schedule deadlocks: ranks wait on {stuck}")
        ready = replay.finish_next()


class _Replay:
    """`simulate`'s state: where each rank is in its list, what it runs, what is done. Time is
    kept twice: `virtual`, the work each running action has done since it started (all running
    actions advance alike, so they end in the order of their virtual end), and `now`, the wall
    time, which advances by virtual time / the speed of the moment (unshared: the same)."""

    HELD = {FORWARD: 1, BACKWARD: -1, WEIGHT_GRAD: -1}

    def __init__(self, schedule: list[list[Action]], costs: dict[str, list[float]],
                 placement: Placement, v: int, oversubscription: float):
        p = len(schedule)
        self.schedule, self.costs, self.placement = schedule, costs, placement
        self.oversubscription = oversubscription
        self.last = p * v - 1
        self.done: dict[tuple[str, int, int], float] = {}  # (kind, micro, global chunk) -> end
        self.position, self.busy = [0] * p, [0.0] * p
        self.in_flight, self.peak = [0] * p, [0] * p
        self.timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
        self.running: dict[int, tuple[Action, int, float]] = {}  # rank -> (action, chunk, start)
        self.ends: list[tuple[float, int]] = []  # heap of (virtual end, rank)
        self.blocked: dict[int, tuple[int, int]] = {}  # rank -> (micro, global chunk) it waits on
        self.remaining = sum(len(r) for r in schedule)
        self.virtual = self.now = 0.0

    def start_next(self, s: int) -> None:
        """Pass rank `s`'s free actions (communication, steps) and start its next costed one if
        its input is ready."""
        actions = self.schedule[s]
        while self.position[s] < len(actions):
            a = actions[self.position[s]]
            g = self.placement(s, a.chunk, len(self.schedule))
            costed = a.kind in self.costs
            if costed:
                if input_ready(a, g, self.last, self.done) is None:
                    self.blocked[s] = (a.micro, g)
                    return
                self.running[s] = (a, g, self.now)
                heapq.heappush(self.ends, (self.virtual + self.costs[a.kind][g], s))
                self.in_flight[s] += self.HELD.get(a.kind, 0)
                self.peak[s] = max(self.peak[s], self.in_flight[s])
            self.position[s] += 1
            self.remaining -= 1
            if costed:
                return

    def finish_next(self) -> list[int]:
        """Advance to the next end; return the ranks that may start an action: those that
        finished, and those waiting on the same micro-batch in a neighbouring chunk."""
        speed = min(self.oversubscription, len(self.schedule) / len(self.running))
        virtual = self.ends[0][0]
        self.now = virtual if self.oversubscription == 1 else (
            self.now + (virtual - self.virtual) / speed)
        self.virtual = virtual
        woken = []
        while self.ends and self.ends[0][0] <= virtual:
            s = heapq.heappop(self.ends)[1]
            a, g, start = self.running.pop(s)
            self.done[(a.kind, a.micro, g)] = self.now
            self.timeline[s].append((a, start, self.now))
            self.busy[s] += self.now - start
            woken.append(s)
            woken += [w for w, (micro, chunk) in self.blocked.items()
                      if micro == a.micro and abs(chunk - g) <= 1]
        woken = list(dict.fromkeys(woken))
        for w in woken:
            self.blocked.pop(w, None)
        return woken


def input_ready(a: Action, g: int, last: int, done: dict) -> float | None:
    """When action `a` on global chunk `g` may start as far as other actions go (None: not
    yet): a forward after the previous chunk's forward of its micro-batch; `B` or `I` after the
    next chunk's input gradient (its `B` or `I`), or on the last chunk after its own forward;
    `W` after its own `I`. Communication and steps cost nothing and wait for nothing."""
    if a.kind == FORWARD:
        return done.get((FORWARD, a.micro, g - 1)) if g > 0 else 0.0
    if a.kind in (BACKWARD, INPUT_GRAD):
        if g == last:
            return done.get((FORWARD, a.micro, g))
        return done.get((INPUT_GRAD, a.micro, g + 1), done.get((BACKWARD, a.micro, g + 1)))
    if a.kind == WEIGHT_GRAD:
        return done.get((INPUT_GRAD, a.micro, g))
    return 0.0


def _half_unless_given(cost: float | Sequence[float] | None, backward: list[float], p: int,
                       v: int) -> list[float]:
    """`I` and `W` costs per chunk: as given, else half the fused backward's each."""
    return [b / 2 for b in backward] if cost is None else _chunk_costs(cost, p, v)


def _chunk_costs(cost: float | Sequence[float], p: int, v: int) -> list[float]:
    if isinstance(cost, int | float):
        return [cost / v] * (p * v)
    if len(cost) != p * v:
        raise ValueError(f"chunk costs must number pp x virtual_stages = {p * v}, got"
                         f" {len(cost)}")
    return list(cost)
