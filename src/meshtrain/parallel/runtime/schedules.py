"""Pipeline schedules as data, and a simulator that runs them on costs instead of processes.

A schedule is, per pipeline rank, a plain list of `Action`s: forward or backward of (micro-batch,
local model chunk), the sends and receives around them, and the optimizer step. Generators:
GPipe (all forwards, then all backwards), 1F1B / PipeDream-Flush (warm-up, one forward one
backward, cool-down), Megatron's interleaved 1F1B (v model chunks per rank: rank s holds model
chunks s, s + p, ...), and PipeDream-2BW (1F1B across optimizer steps with no flush).

`simulate` replays the lists with a cost per action and returns each rank's busy time, the
makespan and the peak number of micro-batches (chunks) whose activations a rank holds, so bubble
and memory claims are checked without running a model; `pipeline.run_schedule` runs the same
lists on a real model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")
"""The `pp_schedule` choices: flush schedules GPipe, 1F1B and interleaved 1F1B, and
PipeDream-2BW."""

FORWARD, BACKWARD = "F", "B"
RECV_ACTIVATION, SEND_ACTIVATION = "recv_act", "send_act"
RECV_GRAD, SEND_GRAD = "recv_grad", "send_grad"
OPTIMIZER_STEP = "step"


@dataclass(frozen=True)
class Action:
    kind: str
    micro: int = -1
    chunk: int = 0  # local model chunk on this rank (0 without interleaving)


def model_chunk(rank: int, chunk: int, p: int) -> int:
    """Global index of a rank's local chunk: rank s holds model chunks s, s + p, s + 2p, ..."""
    return chunk * p + rank


def _with_communication(compute: list[Action], rank: int, p: int, v: int) -> list[Action]:
    """Insert receives before and sends after each compute action that crosses stages."""
    last = p * v - 1
    out: list[Action] = []
    for a in compute:
        g = model_chunk(rank, a.chunk, p)
        if a.kind == FORWARD:
            if g > 0:
                out.append(Action(RECV_ACTIVATION, a.micro, a.chunk))
            out.append(a)
            if g < last:
                out.append(Action(SEND_ACTIVATION, a.micro, a.chunk))
        elif a.kind == BACKWARD:
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
    peak_in_flight: list[int]  # per rank: forwarded and not yet backwarded (micro, chunk)s
    timeline: list[list[tuple[Action, float, float]]]  # per rank: (action, start, end)

    def idle_fraction(self, rank: int) -> float:
        return 1.0 - self.busy[rank] / self.makespan


def simulate(schedule: list[list[Action]], *, forward_cost: float | Sequence[float] = 1.0,
             backward_cost: float | Sequence[float] = 2.0, v: int = 1) -> Simulation:
    """Run every rank's list in order; a forward waits for the previous model chunk's forward
    of the same micro-batch, a backward for the next chunk's backward. A number is a cost per
    whole stage (a chunk of an interleaved schedule costs 1/v of it); a sequence gives each
    model chunk's own cost, in global chunk order (uneven stages, the head on the last one).
    Communication is free."""
    p = len(schedule)
    last = p * v - 1
    forward = _chunk_costs(forward_cost, p, v)
    backward = _chunk_costs(backward_cost, p, v)
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, global chunk) -> end time
    position = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    in_flight, peak = [0] * p, [0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(r) for r in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                a = schedule[s][position[s]]
                g = model_chunk(s, a.chunk, p)
                ready = clock[s]
                if a.kind == FORWARD and g > 0:
                    dep = done.get((FORWARD, a.micro, g - 1))
                elif a.kind == BACKWARD:
                    dep = done.get((FORWARD, a.micro, g)) if g == last \
                        else done.get((BACKWARD, a.micro, g + 1))
                else:
                    dep = ready  # communication and steps: no cost, no dependency of their own
                if dep is None:
                    break
                start = max(ready, dep)
                cost = forward[g] if a.kind == FORWARD else backward[g] \
                    if a.kind == BACKWARD else 0.0
                clock[s] = start + cost
                busy[s] += cost
                if a.kind in (FORWARD, BACKWARD):
                    done[(a.kind, a.micro, g)] = clock[s]
                    timeline[s].append((a, start, clock[s]))
                    in_flight[s] += 1 if a.kind == FORWARD else -1
                    peak[s] = max(peak[s], in_flight[s])
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][position[s]] for s in range(p)
                     if position[s] < len(schedule[s])}
            raise RuntimeError(f"schedule deadlocks: ranks wait on {stuck}")
    return Simulation(max(clock), busy, peak, timeline)


def _chunk_costs(cost: float | Sequence[float], p: int, v: int) -> list[float]:
    if isinstance(cost, int | float):
        return [cost / v] * (p * v)
    if len(cost) != p * v:
        raise ValueError(f"chunk costs must number pp x virtual_stages = {p * v}, got"
                         f" {len(cost)}")
    return list(cost)
