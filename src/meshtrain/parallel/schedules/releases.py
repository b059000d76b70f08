"""When a rank may wait for one of its sends without risking a deadlock, so the sent tensor is
freed then instead of at the step's end.

A send completes once its receiver has taken it, and the receiver takes it only when its own
list reaches the receive: waiting earlier could block on a rank that is itself waiting for this
one. So a send is waited right after this rank receives something its receiver sent after
taking it (the receiver's later send proves the taking); a send with no such receive is waited
at the end. Under 1F1B an activation is waited when its gradient comes back and an input
gradient when the previous stage's next activation arrives, so a rank holds a bounded number of
sends whatever the micro-batch count (`held_boundary_tensors` counts them).
"""

from __future__ import annotations

import bisect
import itertools

from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    Action,
    Placement,
    model_chunk,
)

Releases = dict[int, list[Action]]
"""One rank's: after the action at this index, wait these sends (`SEND_*` actions)."""


def transfer(a: Action, g: int) -> tuple[str, int, int] | None:
    """Which transfer a communication action on global chunk `g` is half of: (direction,
    micro-batch, boundary), boundary b lying between global chunks b and b + 1."""
    return {SEND_ACTIVATION: ("act", a.micro, g), RECV_ACTIVATION: ("act", a.micro, g - 1),
            SEND_GRAD: ("grad", a.micro, g - 1), RECV_GRAD: ("grad", a.micro, g)}.get(a.kind)


def send_releases(lists: list[list[Action]], placement: Placement = model_chunk
                  ) -> list[Releases]:
    """Per rank of `lists` (every rank's actions, as `with_communication` makes them), where
    each send to another rank is waited (see the module); a send missing is waited at the end."""
    p = len(lists)
    sent, taken = {}, {}  # transfer -> (rank, index) of its send and of its receive
    for r, actions in enumerate(lists):
        for k, a in enumerate(actions):
            t = transfer(a, placement(r, a.chunk, p))
            if t is not None:
                (sent if a.kind in (SEND_ACTIVATION, SEND_GRAD) else taken)[t] = (r, k)
    releases: list[Releases] = [{} for _ in range(p)]
    for r, actions in enumerate(lists):
        # this rank's receives from each other rank: (index here, the sender's index), in order
        received: dict[int, list[tuple[int, int]]] = {}
        for k, a in enumerate(actions):
            t = transfer(a, placement(r, a.chunk, p))
            if a.kind in (RECV_ACTIVATION, RECV_GRAD) and t in sent and sent[t][0] != r:
                received.setdefault(sent[t][0], []).append((k, sent[t][1]))
        for k, a in enumerate(actions):
            t = transfer(a, placement(r, a.chunk, p))
            if a.kind not in (SEND_ACTIVATION, SEND_GRAD) or t not in taken:
                continue
            to, at = taken[t]
            later = received.get(to, [])
            after = itertools.islice(later, bisect.bisect(later, (k, len(lists[to]))), None)
            proof = next((j for j, index in after if index > at), None)
            if proof is not None:
                releases[r].setdefault(proof, []).append(a)
    return releases


def held_boundary_tensors(actions: list[Action], releases: Releases, rank: int, p: int,
                          num_chunks: int, placement: Placement = model_chunk) -> int:
    """The most boundary tensors one rank's list keeps at once when run with `releases`: the
    outputs of its forwards that feed another chunk, from the forward until the backward (or
    the send's wait, if later), the gradients it receives for them until that backward, and
    the input gradients it sent to another rank until waited."""
    last = p * num_chunks - 1
    owner = {placement(r, c, p): r for r in range(p) for c in range(num_chunks)}
    outputs: set = set()  # (micro, chunk) whose forward output is held for its backward
    grads: set = set()  # (micro, chunk) whose received output gradient is not yet used
    pending: set = set()  # sends to another rank not yet waited
    most = 0
    for k, a in enumerate(actions):
        g = placement(rank, a.chunk, p)
        if a.kind == FORWARD and g < last:
            outputs.add((a.micro, a.chunk))
        elif a.kind == RECV_GRAD:
            grads.add((a.micro, a.chunk))
        elif a.kind in (BACKWARD, INPUT_GRAD):
            outputs.discard((a.micro, a.chunk))
            grads.discard((a.micro, a.chunk))
        elif a.kind in (SEND_ACTIVATION, SEND_GRAD) and \
                owner[g + 1 if a.kind == SEND_ACTIVATION else g - 1] != rank:
            pending.add(a)
        pending -= set(releases.get(k, ()))
        sent_apart = [s for s in pending
                      if s.kind == SEND_GRAD or (s.micro, s.chunk) not in outputs]
        most = max(most, len(outputs) + len(grads) + len(sent_apart))
    return most
