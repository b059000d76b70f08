"""Zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv
2401.10241) as `schedules.Action` lists: the backward split into `I` (input gradient, which the
previous chunk waits for) and `W` (weight gradient, which nobody waits for), so Ws can fill the
time a rank would otherwise wait.

`zb_h1(p, m)`: 1F1B's order and memory with W deferred into the drain (a third of 1F1B's bubble at
equal costs). `zb_v(p, m)`: two chunks per rank in a V (`schedules.v_shape_chunk`), the paper's
handcrafted order, at 1F1B's peak activation memory with the least bubble a V can have for
m >= 2p - 1. Simulate ZB-V with `simulate(..., v=2, placement=v_shape_chunk)`.

`pipeline.run_schedule` runs these lists with the split backward (`layers/weight_grads.py`).
"""

from __future__ import annotations

from collections import deque

from meshtrain.parallel.runtime.schedules import (
    FORWARD,
    INPUT_GRAD,
    OPTIMIZER_STEP,
    WEIGHT_GRAD,
    Action,
    _check,
    _with_communication,
    v_shape_chunk,
)


def zb_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1: one chunk per rank, 1F1B's warm-up and in-flight count, with the backward split."""
    _check(p, m)
    return [_with_communication(_zb_h1_order(p, m, s) + [Action(OPTIMIZER_STEP)], s, p, 1)
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


def zb_v(p: int, m: int) -> list[list[Action]]:
    """ZB-V: rank r holds global chunks r and 2p - 1 - r (`v_shape_chunk`), local chunks 0 and
    1. Pass `v=2, placement=v_shape_chunk` to `simulate`."""
    _check(p, m)
    return [_with_communication(_zb_v_order(p, m, r) + [Action(OPTIMIZER_STEP)], r, p, 2,
                                v_shape_chunk) for r in range(p)]


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
