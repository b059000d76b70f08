"""What a pipeline schedule is made of: per pipeline rank, a plain list of `Action`s (forward or
backward of (micro-batch, local model chunk), the sends and receives around them, the optimizer
step), and where a schedule places the model's chunks on the ranks (`Placement`). The schedules'
generators (`flush.py`, `interleaved.py`, `pipedream.py`, `zero_bubble.py`) build their lists
from these; `simulator.simulate` replays them on costs and `runtime/pipeline.run_schedule` on a
real model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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



def with_communication(compute: list[Action], rank: int, p: int, v: int,
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


def check_counts(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"pipeline degree and micro-batches must be positive, got {p} and {m}")



def one_f_one_b_order(warmup: int, total: int, forward, backward) -> list[Action]:
    """`warmup` forwards, then alternate one forward and one backward, then the backwards left."""
    order = [forward(k) for k in range(warmup)]
    done_f, done_b = warmup, 0
    while done_f < total:
        order += [forward(done_f), backward(done_b)]
        done_f, done_b = done_f + 1, done_b + 1
    order += [backward(k) for k in range(done_b, total)]
    return order

