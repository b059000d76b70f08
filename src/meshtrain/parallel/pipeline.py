"""Pipeline parallelism: which layers a stage holds, and the executor that runs a schedule.

The executor runs one rank's action list (see `schedules.py`) on its stage: forwards take token
ids (first stage) or the activation received from the previous stage; backwards take the loss
(last stage) or the gradient received from the next stage. Sends are asynchronous and waited at
the end of the step; receives block just before the compute that needs them, so any schedule the
simulator accepts runs without deadlock. Shapes are known ahead (`[micro, s, h]`), so no
handshake precedes a transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from meshtrain.mesh import ParallelMesh
from meshtrain.parallel import comm
from meshtrain.parallel.schedules import (
    BACKWARD,
    FORWARD,
    OPTIMIZER_STEP,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    Action,
)


def stage_layers(num_layers: int, pp: int, split: list[int] | None = None) -> list[range]:
    """Layers of each stage: `split` (counts per stage) or balanced, earlier stages taking the
    remainder."""
    if split is None:
        base, extra = divmod(num_layers, pp)
        split = [base + (1 if s < extra else 0) for s in range(pp)]
    if len(split) != pp or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"--pp-layers {','.join(map(str, split))} must give each of the {pp}"
                         f" stages at least one layer and sum to {num_layers}")
    starts = [sum(split[:s]) for s in range(pp)]
    return [range(start, start + n) for start, n in zip(starts, split, strict=True)]


def run_schedule(actions: list[Action], *, stage: Callable, loss_fn: Callable,
                 micro_batches: list[tuple[torch.Tensor, torch.Tensor]], mesh: ParallelMesh,
                 activation_shape: tuple[int, ...], dtype: torch.dtype,
                 before_backward: Callable[[int], None] = lambda micro: None,
                 stage_loss: Callable[[], torch.Tensor | float] = lambda: 0.0,
                 loss_scale: float = 1.0, timeline: list | None = None) -> list[torch.Tensor]:
    """Run this rank's actions; returns the last stage's per-micro-batch losses (already
    divided by the number of micro-batches), empty elsewhere. `before_backward(i)` lets the
    caller mark the last backward of a step (data-parallel reduction); `stage_loss()`, called
    after each forward, gives this stage's own extra loss for it (MoE routing losses), which
    joins that micro-batch's backward. `timeline`, when given, gets one (kind, micro, chunk,
    start, end) per action, in `time.perf_counter()` seconds (see `pipeline_trace.py`)."""
    axis, s = mesh.pp, mesh.pp.rank
    first, last = s == 0, s == mesh.pp.size - 1
    m = len(micro_batches)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}
    losses: list[torch.Tensor] = []
    extra: dict[int, torch.Tensor | float] = {}
    sends = []
    for a in actions:
        i, start = a.micro, time.perf_counter()
        if a.kind == RECV_ACTIVATION:
            buffer = torch.empty(activation_shape, dtype=dtype, device=mesh.device)
            comm.recv(buffer, axis, s - 1, tag=2 * i)
            inputs[i] = buffer.requires_grad_(torch.is_grad_enabled())
        elif a.kind == FORWARD:
            ids, targets = micro_batches[i]
            out = stage(ids.to(mesh.device) if first else inputs[i])
            extra[i] = stage_loss()
            if last:
                out = loss_fn(out, targets.to(mesh.device)) / m
                losses.append(out.detach())
            outputs[i] = out
        elif a.kind == SEND_ACTIVATION:
            tensor = outputs[i].detach() if torch.is_grad_enabled() else outputs.pop(i)
            sends.append((comm.send(tensor, axis, s + 1, tag=2 * i), tensor))
        elif a.kind == RECV_GRAD:
            grads[i] = torch.empty(activation_shape, dtype=dtype, device=mesh.device)
            comm.recv(grads[i], axis, s + 1, tag=2 * i + 1)
        elif a.kind == BACKWARD:
            before_backward(i)
            own = extra.pop(i)
            if last:
                ((outputs.pop(i) + own / m) * loss_scale).backward()
            elif isinstance(own, torch.Tensor):
                torch.autograd.backward([outputs.pop(i), own * (loss_scale / m)],
                                        [grads.pop(i), None])
            else:
                outputs.pop(i).backward(grads.pop(i))
        elif a.kind == SEND_GRAD:
            tensor = inputs.pop(i).grad
            sends.append((comm.send(tensor, axis, s - 1, tag=2 * i + 1), tensor))
        else:
            assert a.kind == OPTIMIZER_STEP, a
        if timeline is not None:
            timeline.append((a.kind, i, a.chunk, start, time.perf_counter()))
    for work, _ in sends:  # the tensor stays referenced until its send completes
        work.wait()
    return losses
