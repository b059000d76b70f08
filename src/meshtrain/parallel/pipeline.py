"""Pipeline parallelism: which layers a stage holds, and the executor that runs a schedule.

The executor runs one rank's action list (see `schedules.py`) on its model chunks (one, or v
under the interleaved schedule: rank s holds global chunks s, s + p, ...): forwards take token
ids (first global chunk) or the activation received from the previous global chunk; backwards
take the loss (last global chunk) or the gradient received from the next one. The previous
chunk lives on rank s - 1, or on rank p - 1 for rank 0's later chunks (the wrap-around), and the
next on rank s + 1, or rank 0. Sends are asynchronous and waited at the end of the step;
receives block just before the compute that needs them, so any schedule the simulator accepts
runs without deadlock. Shapes are known ahead (`[micro, s, h]`), so no handshake precedes a
transfer.

Matching transfers: every (micro-batch, stage boundary, direction) has its own tag (gloo matches
on it). NCCL ignores tags and matches the transfers between two ranks in issue order, so
activations travel on the `pp` groups and gradients on `pp_grad`: per group and rank pair, the
sender issues in the order the receiver expects, because every rank runs its forwards (and its
backwards) in the same (micro-batch, local chunk) order. One shared group would not do: at
pp 2 with interleaving, rank 0 sends rank 1 both activations and (wrapped-around) gradients, and
the two ranks interleave forwards and backwards differently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

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
    model_chunk,
)


def stage_layers(num_layers: int, num_stages: int, split: list[int] | None = None) -> list[range]:
    """Layers of each stage: `split` (counts per stage, from --pp-layers) or balanced, earlier
    stages taking the remainder."""
    if split is None:
        base, extra = divmod(num_layers, num_stages)
        split = [base + (1 if s < extra else 0) for s in range(num_stages)]
    text = ",".join(map(str, split))
    if len(split) != num_stages:
        raise ValueError(f"--pp-layers {text} has {len(split)} entries: give one layer count per"
                         f" pipeline stage ({num_stages})")
    if min(split) < 1:
        raise ValueError(f"--pp-layers {text} leaves a stage without layers: every count must be"
                         " at least 1")
    if sum(split) != num_layers:
        raise ValueError(f"--pp-layers {text} sums to {sum(split)}: the counts must sum to the"
                         f" model's {num_layers} layers")
    starts = [sum(split[:s]) for s in range(num_stages)]
    return [range(start, start + n) for start, n in zip(starts, split, strict=True)]


@dataclass
class ScheduleRun:
    """What one rank's run of a schedule produced, and the most activation state it held."""

    losses: list[torch.Tensor]  # last global chunk's per-micro-batch losses (/ m), else empty
    peak_in_flight: int  # most (micro, chunk)s forwarded and not yet backwarded at one time
    peak_saved_bytes: int  # most bytes autograd saved for them at one time (0: not counted)


class _SavedBytes:
    """Bytes autograd saves during one forward, one count per storage, parameters excluded
    (what `memory.saved_activation_bytes` counts, kept per in-flight chunk)."""

    def __init__(self, params) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def total(self) -> int:
        return sum(self.storages.values())


def run_schedule(actions: list[Action], *, stage: Callable, loss_fn: Callable,
                 micro_batches: list[tuple[torch.Tensor, torch.Tensor]], mesh: ParallelMesh,
                 activation_shape: tuple[int, ...], dtype: torch.dtype, num_chunks: int = 1,
                 before_backward: Callable[[int], None] = lambda micro: None,
                 stage_loss: Callable[[], torch.Tensor | float] = lambda: 0.0,
                 loss_scale: float = 1.0, count_saved_of=None) -> ScheduleRun:
    """Run this rank's actions. `stage(x, chunk)` runs local chunk `chunk` (of `num_chunks`).

    `before_backward(i)` lets the caller mark the last backward of a step (data-parallel
    reduction); `stage_loss()`, called after each forward, gives this chunk's own extra loss for
    it (MoE routing losses), which joins that backward. `count_saved_of`: the stage's parameters,
    to count the bytes autograd saves per in-flight chunk (off by default: a hook per tensor).
    """
    axis, grad_axis, s = mesh.pp, mesh.axis("pp_grad"), mesh.pp.rank
    p, v = axis.size, num_chunks
    previous, following = (s - 1) % p, (s + 1) % p
    last = p * v - 1
    m = len(micro_batches)
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor] = {}
    extra: dict[tuple[int, int], torch.Tensor | float] = {}
    saved: dict[tuple[int, int], int] = {}  # bytes autograd holds for each in-flight chunk
    run = ScheduleRun([], 0, 0)
    sends = []

    def tag(i: int, boundary: int, direction: int) -> int:
        """Boundary b lies between global chunks b and b + 1: one tag per (micro, boundary,
        direction: 0 activation, 1 gradient)."""
        return 2 * (i * (last + 1) + boundary) + direction

    for a in actions:
        i, g, key = a.micro, model_chunk(s, a.chunk, p), (a.micro, a.chunk)
        if a.kind == RECV_ACTIVATION:
            buffer = torch.empty(activation_shape, dtype=dtype, device=mesh.device)
            comm.recv(buffer, axis, previous, tag=tag(i, g - 1, 0))
            inputs[key] = buffer.requires_grad_(torch.is_grad_enabled())
        elif a.kind == FORWARD:
            ids, targets = micro_batches[i]
            counter = _SavedBytes(count_saved_of) if count_saved_of is not None else None
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t) \
                    if counter else contextlib.nullcontext():
                out = stage(ids.to(mesh.device) if g == 0 else inputs[key], a.chunk)
                extra[key] = stage_loss()
                if g == last:
                    out = loss_fn(out, targets.to(mesh.device)) / m
                    run.losses.append(out.detach())
            outputs[key] = out
            saved[key] = counter.total() if counter else 0
            run.peak_in_flight = max(run.peak_in_flight, len(saved))
            run.peak_saved_bytes = max(run.peak_saved_bytes, sum(saved.values()))
        elif a.kind == SEND_ACTIVATION:
            tensor = outputs[key].detach() if torch.is_grad_enabled() else outputs.pop(key)
            sends.append((comm.send(tensor, axis, following, tag=tag(i, g, 0)), tensor))
        elif a.kind == RECV_GRAD:
            grads[key] = torch.empty(activation_shape, dtype=dtype, device=mesh.device)
            comm.recv(grads[key], grad_axis, following, tag=tag(i, g, 1))
        elif a.kind == BACKWARD:
            before_backward(i)
            own = extra.pop(key)
            if g == last:
                ((outputs.pop(key) + own / m) * loss_scale).backward()
            elif isinstance(own, torch.Tensor):
                torch.autograd.backward([outputs.pop(key), own * (loss_scale / m)],
                                        [grads.pop(key), None])
            else:
                outputs.pop(key).backward(grads.pop(key))
            del saved[key]
        elif a.kind == SEND_GRAD:
            tensor = inputs.pop(key).grad
            sends.append((comm.send(tensor, grad_axis, previous, tag=tag(i, g - 1, 1)), tensor))
        else:
            assert a.kind == OPTIMIZER_STEP, a
    for work, _ in sends:  # the tensor stays referenced until its send completes
        work.wait()
    return run
