"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv
2401.10241) as `actions.Action` lists: the backward split into `I` (input gradient, which the
previous chunk waits for) and `W` (weight gradient, which nobody waits for), so Ws can fill the
time a rank would otherwise wait.

`zb_h1(p, m)`: 1F1B's order and memory with W deferred into the drain (a third of 1F1B's bubble at
equal costs). `zb_v(p, m)`: two chunks per rank in a V (`actions.v_shape_chunk`), the paper's
handcrafted order, at 1F1B's peak activation memory with the least bubble a V can have for
m >= 2p - 1 when every chunk's F, I and W cost alike. Real chunks do not: the first chunk has no
input gradient to pass on (its I is empty, its W the whole backward) and the last holds the
output layer, so `zb_v(p, m, costs)` also builds greedy orders under the same memory limit and
keeps whichever the simulator finishes first. Simulate ZB-V with `simulate(..., v=2,
placement=v_shape_chunk)`.

`runtime/pipeline.run_schedule` runs these lists with the split backward (`layers/weight_grads.py`).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import NamedTuple

from meshtrain.errors import Code, SettingError
from meshtrain.parallel.schedules.actions import (
    FORWARD,
    INPUT_GRAD,
    OPTIMIZER_STEP,
    WEIGHT_GRAD,
    Action,
    check_counts,
    v_shape_chunk,
    with_communication,
)
from meshtrain.parallel.schedules.schedule import PipelineSchedule
from meshtrain.parallel.schedules.simulator import input_ready, simulate


def zb_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1: one chunk per rank, 1F1B's warm-up and in-flight count, with the backward split."""
    check_counts(p, m)
    return [with_communication(_zb_h1_order(p, m, s) + [Action(OPTIMIZER_STEP)], s, p, 1)
            for s in range(p)]


def _zb_h1_order(p: int, m: int, s: int) -> list[Action]:
    """Rank s warms up with min(p - 1 - s, m) forwards, then pairs one F with one I (the last
    pairs have no F left). The first s pairs defer their W; after each later I the oldest
    pending W runs, and the s deferred Ws end the list. Why: the I chain reaches rank 0 sooner
    than a fused B chain would (I is cheaper), and the deferred Ws fill the drain, where rank s
    would wait for the last I to travel to rank 0: later ranks wait longer and defer more. Every
    rank then holds at most p micro-batches (1F1B's rank 0). This is the order of torch's
    ScheduleInterleavedZeroBubble (ZB1P) with one stage per rank."""
    warmup = min(p - 1 - s, m)
    order = [Action(FORWARD, k) for k in range(warmup)]
    pending: deque[int] = deque()
    for k in range(m):
        if warmup + k < m:
            order.append(Action(FORWARD, warmup + k))
        order.append(Action(INPUT_GRAD, k))
        pending.append(k)
        if k >= s:
            order.append(Action(WEIGHT_GRAD, pending.popleft()))
    return order + [Action(WEIGHT_GRAD, k) for k in pending]


class ChunkCosts(NamedTuple):
    """Each global chunk's F, I and W cost (any one unit), in chunk order."""

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]


def estimated_costs(chunk_layers: tuple[int, ...], output_layer: float,
                    attention: float) -> ChunkCosts:
    """Costs in a layer's weight-matmul FLOPs: a layer's F is 1 + `attention` (its
    attention core), its I 1 + 2 `attention` (the core's backward is all input gradient), its
    W 1; the output layer adds `output_layer` to each on the last chunk. The first chunk's I is
    empty (nothing before it waits for a gradient) and its W its whole backward (the
    embedding's own is a scatter, left out). `TransformerConfig.pipeline_work_shares` gives
    both shares."""
    forward = [n * (1 + attention) for n in chunk_layers]
    input_grad = [n * (1 + 2 * attention) for n in chunk_layers]
    weight_grad = [float(n) for n in chunk_layers]
    for costs in (forward, input_grad, weight_grad):
        costs[-1] += output_layer
    weight_grad[0] += input_grad[0]
    return ChunkCosts(tuple(forward), (0.0, *input_grad[1:]), tuple(weight_grad))


def zb_v(p: int, m: int, costs: ChunkCosts | None = None) -> list[list[Action]]:
    """ZB-V: rank r holds global chunks r and 2p - 1 - r (`v_shape_chunk`), local chunks 0 and
    1. Pass `v=2, placement=v_shape_chunk` to `simulate`. With `costs`, the handcrafted order
    or a greedy one (`_greedy_v_orders`, up to GREEDY_LIMIT), whichever `simulate` finishes
    first on them."""
    check_counts(p, m)
    orders = [[_zb_v_order(p, m, r) for r in range(p)]]
    if costs is not None and p * m <= GREEDY_LIMIT:  # first: a tie goes to the greedy order,
        orders[:0] = _greedy_v_orders(p, m, costs)  # which adapts to what estimates leave out
    lists = [[with_communication(order + [Action(OPTIMIZER_STEP)], r, p, 2, v_shape_chunk)
              for r, order in enumerate(rank_orders)] for rank_orders in orders]
    if len(lists) == 1:
        return lists[0]
    return min(lists, key=lambda candidate: simulate(
        candidate, forward_cost=list(costs.forward), v=2, placement=v_shape_chunk,
        backward_cost=[i + w for i, w in zip(costs.input_grad, costs.weight_grad, strict=True)],
        input_grad_cost=list(costs.input_grad),
        weight_grad_cost=list(costs.weight_grad)).makespan)


GREEDY_LIMIT = 8192
"""The largest p x m the greedy orders are built for (p 32, m 256 takes ~9 s once, in Python);
longer pipelines run the handcrafted order."""
GREEDY_PRIORITIES = ("I1 I0 F1 F0 W1 W0", "I0 I1 F1 F0 W0 W1", "F1 W0 I1 F0 I0 W1",
                     "I0 F1 F0 W0 I1 W1", "I0 W1 F1 F0 I1 W0")
"""Which ready action a rank starts first (kind and local chunk), one greedy order each,
picked one by one from all 720 priority orders over 25 V shapes (p 2 to 8, m 4 to 16, five
cost profiles of `estimated_costs`): the best of these and the handcrafted order is on average
0.06% longer than the best of all 720 and the handcrafted, the handcrafted alone 1.9% (up to
4.4%, p 8 and m 16)."""


def _greedy_v_orders(p: int, m: int, costs: ChunkCosts) -> list[list[list[Action]]]:
    """Per priority of GREEDY_PRIORITIES, every rank's order from a list scheduler on `costs`:
    whenever a rank is free it starts its first ready action in priority order (each kind
    takes its chunk's micro-batches in order; a W after its I; a forward while the rank holds
    fewer than 2p forwarded chunks without their W, 1F1B's peak, a chunk-0 forward only while
    that leaves room for a chunk-1 one)."""
    return [_list_schedule(p, m, costs, [(step[0], int(step[1])) for step in priority.split()])
            for priority in GREEDY_PRIORITIES]


KINDS = {"F": FORWARD, "I": INPUT_GRAD, "W": WEIGHT_GRAD}


def _list_schedule(p: int, m: int, costs: ChunkCosts,
                   priority: list[tuple[str, int]]) -> list[list[Action]]:
    cost = {"F": costs.forward, "I": costs.input_grad, "W": costs.weight_grad}
    done: dict[tuple[str, int, int], float] = {}  # (action kind, micro, global chunk) -> end
    nxt = {(r, kind, c): 0 for r in range(p) for kind in KINDS for c in (0, 1)}
    free, held = [0.0] * p, [0] * p
    ends: list[float] = []  # a heap of the ends of started actions
    orders: list[list[Action]] = [[] for _ in range(p)]
    busy = list(range(p))  # ranks with actions left
    while busy:
        t = min(free[r] for r in busy)
        started = False
        for r in (r for r in busy if free[r] == t):
            pick = next(((kind, c) for kind, c in priority
                         if _ready(r, kind, c, t, p, m, nxt, done, held)), None)
            if pick is None:
                continue
            kind, c = pick
            i, g = nxt[(r, kind, c)], v_shape_chunk(r, c, p)
            done[(KINDS[kind], i, g)] = free[r] = t + cost[kind][g]
            heapq.heappush(ends, free[r])
            nxt[(r, kind, c)] += 1
            held[r] += {"F": 1, "I": 0, "W": -1}[kind]
            orders[r].append(Action(KINDS[kind], i, c))
            started = True
        if not started:  # every free rank waits: on to the next end
            while ends[0] <= t:
                heapq.heappop(ends)
            for r in busy:
                if free[r] == t:
                    free[r] = ends[0]
        busy = [r for r in busy if len(orders[r]) < 6 * m]
    return orders


def _ready(r: int, kind: str, c: int, t: float, p: int, m: int, nxt: dict, done: dict,
           held: list[int]) -> bool:
    """Whether rank `r` may start its next `kind` on local chunk `c` at time `t`."""
    i, g = nxt[(r, kind, c)], v_shape_chunk(r, c, p)
    if i >= m:
        return False
    if kind == "F" and held[r] >= 2 * p - (1 if c == 0 else 0):
        return False
    if kind != "F" and nxt[(r, "F" if kind == "I" else "I", c)] <= i:  # not yet on this rank
        return False
    end = input_ready(Action(KINDS[kind], i, c), g, 2 * p - 1, done)
    return end is not None and end <= t


class _Counters:
    """The next micro-batch per (kind, local chunk): each kind runs its micro-batches in order on
    each chunk, as the executor's matching of transfers needs."""

    def __init__(self) -> None:
        self.next = {(kind, c): 0 for kind in (FORWARD, INPUT_GRAD, WEIGHT_GRAD) for c in (0, 1)}
        self.order: list[Action] = []

    def __getitem__(self, key: tuple[str, int]) -> int:
        return self.next[key]

    def emit(self, *steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            self.order.append(Action(kind, self.next[(kind, chunk)], chunk))
            self.next[(kind, chunk)] += 1


def _zb_v_order(p: int, m: int, r: int) -> list[Action]:
    """The paper's handcrafted ZB-V (as torch's ScheduleZBVZeroBubble builds it), written for
    n = max(m, 2p - 1) micro-batches; those past m are then left out. With chunk costs
    F = I = W each rank runs:

    - warm-up: 2(p - r) - 1 forwards of chunk 0 (what fits before micro-batch 0 comes back up
      the V to chunk 1), then r times (F1, F0), then p - r times (F1, I1, W1): chunk 1's
      gradients start on rank 0 (the loss) one step after its forward and climb the V;
    - steady state, until both chunks have forwarded n: (F0 while any is left, I0, W0, F1, I1,
      W1), one micro-batch of both chunks per period on every rank, so no rank waits;
    - cool-down: r times (I0, I1) and p - r times (I0, W0) while the last gradients travel to
      rank 0, then the deferred Ws (chunk 1's, then chunk 0's) fill the drain.

    Why handcrafted rather than a greedy list scheduler: for m >= 2p - 1 this order's makespan
    is m(F + I + W) + (p - 1) F_chunk, the least any V placement allows (rank p - 1's first
    forward needs p - 1 chunk forwards before it), and each rank holds at most 2p chunk
    activations (p stages, 1F1B's peak). Priority-rule greedies (every order of F0, F1, I0, I1,
    W0, W1 under that memory limit) left up to 7 chunk steps more at p = 8. Below 2p - 1
    micro-batches the dropped ones leave holes: at m = p the bubble is 2(p - 1) chunk forwards
    (ZB-H1's), at m = 1 4(p - 1)."""
    n = max(m, 2 * p - 1)
    run = _Counters()
    run.emit(*[(FORWARD, 0)] * (2 * (p - r) - 1))
    run.emit(*[(FORWARD, 1), (FORWARD, 0)] * r)
    run.emit(*[(FORWARD, 1), (INPUT_GRAD, 1), (WEIGHT_GRAD, 1)] * (p - r))
    while run[(FORWARD, 1)] < run[(FORWARD, 0)] or run[(FORWARD, 0)] < n:
        if run[(FORWARD, 0)] < n:
            run.emit((FORWARD, 0))
        run.emit((INPUT_GRAD, 0), (WEIGHT_GRAD, 0), (FORWARD, 1), (INPUT_GRAD, 1),
                 (WEIGHT_GRAD, 1))
    run.emit(*[(INPUT_GRAD, 0), (INPUT_GRAD, 1)] * r)
    run.emit(*[(INPUT_GRAD, 0), (WEIGHT_GRAD, 0)] * (p - r))
    for chunk in (1, 0):
        run.emit(*[(WEIGHT_GRAD, chunk)] * (run[(INPUT_GRAD, chunk)] - run[(WEIGHT_GRAD, chunk)]))
    return [a for a in run.order if a.micro < m]


class ZeroBubble(PipelineSchedule):
    """What both zero-bubble schedules share: a split backward (it needs `pp` > 1 and a
    scheme whose layers defer their weight gradients: `runtime/capabilities`)."""

    split_backward = searched = True
    supports = PipelineSchedule.supports | {"split_backward"}


class ZeroBubbleH1(ZeroBubble):
    name = "zb-h1"
    summary = "zero bubble: weight gradients fill the bubbles"

    def action_lists(self, p, m, *, v=1, steps=1, chunk_costs=None):
        return zb_h1(p, m)


class ZeroBubbleV(ZeroBubble):
    name, summary = "zb-v", "zero bubble on two chunks per rank in a V"
    placement = staticmethod(v_shape_chunk)
    orders_on_costs = True

    def chunks_per_rank(self, pp: int, virtual_stages: int) -> int:
        return 2 if pp > 1 else virtual_stages

    def action_lists(self, p, m, *, v=1, steps=1, chunk_costs=None):
        return zb_v(p, m, chunk_costs)

    def check(self, plan, model, micro_batches: int) -> None:
        if 2 * plan.pp > model.num_layers:
            raise SettingError(Code.ZB_V_LAYERS, (
                f"`pp_schedule` zb-v gives each of the `pp` {plan.pp} ranks two model chunks:"
                f" the model's {model.num_layers} layers are fewer than {2 * plan.pp}; lower"
                " `pp` or use zb-h1"))


ZB_H1, ZB_V = ZeroBubbleH1(), ZeroBubbleV()
