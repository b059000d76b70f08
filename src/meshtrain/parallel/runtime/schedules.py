"""Pipeline schedules as data, and a simulator that runs them on costs instead of processes.

A schedule is, per pipeline rank, a plain list of `Action`s: forward or backward of (micro-batch,
local model chunk), the sends and receives around them, and the optimizer step. Generators:
GPipe (all forwards, then all backwards), 1F1B / PipeDream-Flush (warm-up, one forward one
backward, cool-down), Megatron's interleaved 1F1B (v model chunks per rank: rank s holds model
chunks s, s + p, ...), and PipeDream-2BW (1F1B across optimizer steps with no flush). The
zero-bubble generators (`zero_bubble.py`) split the backward into `I` and `W` (below) and may
place chunks in a V.

`simulate` replays the lists with a cost per action and returns each rank's busy time, the
makespan and the peak number of micro-batches (chunks) whose activations a rank holds, so bubble
and memory claims are checked without running a model; `pipeline.run_schedule` runs the same
lists on a real model.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw", "zb-h1", "zb-v")
"""The `pp_schedule` choices: flush schedules GPipe, 1F1B and interleaved 1F1B, PipeDream-2BW,
and the zero-bubble flush schedules ZB-H1 and ZB-V (`zero_bubble.py`), which split each
backward into input- and weight-gradient parts."""
SPLIT_BACKWARD = ("zb-h1", "zb-v")
"""The schedules that run `I` and `W` instead of a fused `B`."""

FORWARD, BACKWARD = "F", "B"
INPUT_GRAD, WEIGHT_GRAD = "I", "W"
"""The backward split in two (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241):
`I` computes the gradient of the chunk's input, which the previous chunk waits for (the critical
path); `W` computes the chunk's weight gradients, which nothing else waits for, so a schedule
may put it in a bubble. `B` stays the fused backward (I then W at once) of the other schedules."""
RECV_ACTIVATION, SEND_ACTIVATION = "recv_act", "send_act"
RECV_GRAD, SEND_GRAD = "recv_grad", "send_grad"
OPTIMIZER_STEP = "step"


@dataclass(frozen=True)
class Action:
    kind: str
    micro: int = -1
    chunk: int = 0  # local model chunk on this rank (0 without interleaving)


Placement = Callable[[int, int, int], int]
"""(rank, local chunk, p) -> global model chunk: where a schedule puts the model's chunks."""


def model_chunk(rank: int, chunk: int, p: int) -> int:
    """Global index of a rank's local chunk: rank s holds model chunks s, s + p, s + 2p, ...
    (the looped placement of every schedule but ZB-V)."""
    return chunk * p + rank


def v_shape_chunk(rank: int, chunk: int, p: int) -> int:
    """ZB-V's placement of two chunks per rank: rank r holds global chunks r and 2p - 1 - r, so
    the forward runs down ranks 0..p-1 and back up p-1..0, and rank 0 holds the first chunk and
    the last (the loss). Rank p - 1 holds the middle two: that boundary stays on one rank."""
    if chunk not in (0, 1):
        raise ValueError(f"the V placement has two chunks per rank, got local chunk {chunk}")
    return rank if chunk == 0 else 2 * p - 1 - rank


def schedule_placement(schedule: str) -> Placement:
    """Where `schedule` puts a rank's chunks: ZB-V in a V, every other schedule looped."""
    return v_shape_chunk if schedule == "zb-v" else model_chunk


def _with_communication(compute: list[Action], rank: int, p: int, v: int,
                        placement: Placement = model_chunk) -> list[Action]:
    """Insert receives before and sends after each compute action that crosses chunks: around
    forwards the activation, around `B` or `I` the input gradient (`W` sends nothing). Every
    chunk boundary gets its pair, also one inside a rank (ZB-V's turn on rank p - 1, or any
    boundary at p = 1): a runtime may hand that tensor over in memory instead."""
    last = p * v - 1
    out: list[Action] = []
    for a in compute:
        g = placement(rank, a.chunk, p)
        if a.kind == FORWARD:
            if g > 0:
                out.append(Action(RECV_ACTIVATION, a.micro, a.chunk))
            out.append(a)
            if g < last:
                out.append(Action(SEND_ACTIVATION, a.micro, a.chunk))
        elif a.kind in (BACKWARD, INPUT_GRAD):
            if g < last:
                out.append(Action(RECV_GRAD, a.micro, a.chunk))
            out.append(a)
            if g > 0:
                out.append(Action(SEND_GRAD, a.micro, a.chunk))
        else:
            out.append(a)
    return out


def _check(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"pipeline degree and micro-batches must be positive, got {p} and {m}")


def gpipe(p: int, m: int) -> list[list[Action]]:
    _check(p, m)
    return [_with_communication([Action(FORWARD, i) for i in range(m)]
                                + [Action(BACKWARD, i) for i in range(m)]
                                + [Action(OPTIMIZER_STEP)], s, p, 1) for s in range(p)]


def _one_f_one_b_order(warmup: int, total: int, forward, backward) -> list[Action]:
    """`warmup` forwards, then alternate one forward and one backward, then the backwards left."""
    order = [forward(k) for k in range(warmup)]
    done_f, done_b = warmup, 0
    while done_f < total:
        order += [forward(done_f), backward(done_b)]
        done_f, done_b = done_f + 1, done_b + 1
    order += [backward(k) for k in range(done_b, total)]
    return order


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """PipeDream-Flush: stage s warms up with min(p - s - 1, m) forwards."""
    _check(p, m)
    ranks = []
    for s in range(p):
        order = _one_f_one_b_order(min(p - s - 1, m), m, lambda k: Action(FORWARD, k),
                                   lambda k: Action(BACKWARD, k))
        ranks.append(_with_communication(order + [Action(OPTIMIZER_STEP)], s, p, 1))
    return ranks


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: forwards go through chunks in groups of p micro-batches;
    backwards through the chunks in reverse. Needs m divisible by p."""
    _check(p, m)
    if v < 1:
        raise ValueError(f"`virtual_stages` must be positive, got {v}")
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) divisible by"
                         f" `pp` ({p}): change `global_batch` or `micro_batch`")
    total = m * v

    def forward(k: int) -> Action:
        return Action(FORWARD, (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action(BACKWARD, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    ranks = []
    for s in range(p):
        warmup = min(total, (p - s - 1) * 2 + (v - 1) * p)
        order = _one_f_one_b_order(warmup, total, forward, backward)
        ranks.append(_with_communication(order + [Action(OPTIMIZER_STEP)], s, p, v))
    return ranks


def pipedream_2bw(p: int, m: int, steps: int) -> list[list[Action]]:
    """1F1B over `steps` x m micro-batches with no flush: stage s steps its weights after every
    m-th backward. Needs m >= p (so a weight version is never needed by more than two
    in-flight generations)."""
    _check(p, m)
    if m < p:
        raise ValueError(f"PipeDream-2BW needs micro-batches ({m}) >= `pp` ({p}): raise"
                         " `global_batch` or lower `micro_batch`")
    total = steps * m
    ranks = []
    for s in range(p):
        order = _one_f_one_b_order(min(p - s - 1, total), total, lambda k: Action(FORWARD, k),
                                   lambda k: Action(BACKWARD, k))
        with_steps: list[Action] = []
        for a in order:
            with_steps.append(a)
            if a.kind == BACKWARD and (a.micro + 1) % m == 0:
                with_steps.append(Action(OPTIMIZER_STEP, a.micro // m))
        ranks.append(_with_communication(with_steps, s, p, 1))
    return ranks


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
    """Run every rank's list in order; an action waits for its input (`_input_ready`). A number
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
                if _input_ready(a, g, self.last, self.done) is None:
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


def _input_ready(a: Action, g: int, last: int, done: dict) -> float | None:
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
