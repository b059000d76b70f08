"""ZeRO's flat bucket: a run of parameters packed into one buffer, padded to a multiple of the
axis size, and the contiguous 1/N shard of it this rank owns (Megatron's distributed-optimizer
layout), with the gradient buffers and the fp32 master shard the optimizer steps."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.mesh import MeshAxis

FREE, FORWARD, BACKWARD = "free", "forward", "backward"  # stage 3: where a bucket's unit is


def shard_numel(params: list[nn.Parameter], parts: int) -> int:
    """Elements of each rank's shard of a bucket of `params` split `parts` ways (padded)."""
    return -(-sum(p.numel() for p in params) // parts)


class Bucket:
    """One flat bucket: its parameters, its shard of them, their gradients and master shard."""

    def __init__(self, params: list[nn.Parameter], axis: MeshAxis, *, full_gradients: bool,
                 sharded_parameters: bool, grad_dtype: torch.dtype, offload: bool):
        self.params = params
        self.shapes = {id(p): p.shape for p in params}
        self.offsets: dict[int, int] = {}
        offset = 0
        for p in params:
            self.offsets[id(p)] = offset
            offset += p.numel()
        self.numel = offset
        self.shard_size = shard_numel(params, axis.size)
        self.padded = self.shard_size * axis.size
        self.lo = axis.rank * self.shard_size
        self.dtype, self.device = params[0].dtype, params[0].device
        self.grad_dtype = grad_dtype
        self.pieces: list[tuple[nn.Parameter, int, int]] = []  # (param, start in shard, length)
        for p in params:
            start = max(self.offsets[id(p)], self.lo)
            end = min(self.offsets[id(p)] + p.numel(), self.lo + self.shard_size)
            if start < end:
                self.pieces.append((p, start - self.lo, end - start))
        self._flatten_parameters(sharded_parameters)
        self._make_gradients(full_gradients)
        self.pending = len(params)
        self.work: dist.Work | None = None
        self.reduced: torch.Tensor | None = None  # stage 2/3: reduce-scatter output in flight
        self.launched = False
        # the fp32 shard the optimizer steps, and the gradient it reads
        # offloaded states are always separate host copies (on a CPU-only machine too, so that
        # the copy path is the one tested)
        master_device = torch.device("cpu") if offload else self.device
        in_place = self.dtype == torch.float32 and not offload
        self.master = self.param_shard if in_place else \
            self.param_shard.detach().to(master_device, torch.float32, copy=True)
        # the gradient shard itself, or (16-bit gradients, offload) an fp32 copy made for the
        # step and freed after it
        self.grad_in_place = not offload and grad_dtype == torch.float32

    def _flatten_parameters(self, sharded: bool) -> None:
        """Parameters become views of the full flat buffer for good. `sharded` (stage 3) frees
        it by shrinking its storage to nothing and regathers into the same storage (FSDP's
        way): views that autograd saved (a weight's transpose) then hold no memory while freed
        and see the regathered values in backward."""
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for p in self.params:
            self.param_view(flat, p).copy_(p.detach())
        self.param_flat = flat
        self.param_shard = flat[self.lo:self.lo + self.shard_size]
        for p in self.params:
            p.data = self.param_view(flat, p)
        self.resident = True  # the full parameters are there
        self.gathering: dist.Work | None | bool = False  # in-flight gather (None at N = 1)
        self.state = FORWARD
        if sharded:
            self.param_shard = self.param_shard.clone()
            flat.untyped_storage().resize_(0)
            self.resident, self.state = False, FREE

    def _make_gradients(self, full: bool) -> None:
        """`full` (stage 1) keeps the full gradient bucket and reduces into its own shard; else
        (stages 2 and 3) only a shard is kept (full buckets live during one reduction), and
        only from the step's first reduction to its update (`take_reduced` .. `drop_grad_shard`): no
        gradient memory through the forward, where the activations peak."""
        self.as_grads = full and self.dtype == self.grad_dtype
        self.grad_flat = torch.zeros(self.padded, dtype=self.grad_dtype, device=self.device) \
            if full else None
        self.grad_views: dict[int, torch.Tensor] = {}
        self.grad_shard: torch.Tensor | None = None
        self.grad_pieces: dict[int, torch.Tensor] = {}
        if self.grad_flat is not None:
            self.set_grad_flat(self.grad_flat)
            self._set_grad_shard(self.grad_flat[self.lo:self.lo + self.shard_size])
        if self.as_grads:
            for p in self.params:
                p.grad = self.grad_views[id(p)]

    def _set_grad_shard(self, shard: torch.Tensor | None) -> None:
        self.grad_shard = shard
        self.grad_pieces = {} if shard is None else \
            {id(p): shard[a:a + n] for p, a, n in self.pieces}

    def take_reduced(self, reduced: torch.Tensor) -> None:
        """Stages 2 and 3: add a landed reduction (a slice of the full bucket) to the gradient
        shard; the step's first becomes it (a copy, so the full bucket can go)."""
        if self.grad_shard is None:
            self._set_grad_shard(reduced.clone())
        else:
            self.grad_shard.add_(reduced)

    def ensure_grad_shard(self) -> None:
        """A zero shard for a bucket no reduction reached this step (its parameters got no
        gradient), so every piece has one."""
        if self.grad_shard is None:
            self._set_grad_shard(torch.zeros(self.shard_size, dtype=self.grad_dtype,
                                             device=self.device))

    def drop_grad_shard(self) -> None:
        """Stages 2 and 3: free the shard once the update has read it."""
        self._set_grad_shard(None)

    def param_view(self, flat: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        start = self.offsets[id(p)]
        shape = self.shapes[id(p)]
        return flat[start:start + shape.numel()].view(shape)

    def set_grad_flat(self, flat: torch.Tensor) -> None:
        """A (fresh) full gradient bucket, and each parameter's view into it."""
        self.grad_flat = flat
        self.grad_views = {id(p): self.param_view(flat, p) for p in self.params}
        self.unwritten: set[int] = set()

    def fresh_grad_flat(self) -> torch.Tensor:
        """Stages 2 and 3: an unwritten bucket for one micro-batch. Each gradient is copied
        in as it arrives rather than added to zeros, so memory is committed only as gradients
        land (the page-backed host allocator touches no page before it is written): a unit
        whose gradients arrive far apart (the final norm's at the start of backward, the
        embedding's at its end) holds no full bucket in between."""
        flat = torch.empty(self.padded, dtype=self.grad_dtype, device=self.device)
        flat[self.numel:].zero_()  # the padding
        self.set_grad_flat(flat)
        self.unwritten = {id(p) for p in self.params}
        return flat

    def add_grad(self, p: nn.Parameter) -> None:
        """Accumulate p's gradient into its view (the first of a fresh bucket's: copied)."""
        view = self.grad_views[id(p)]
        if id(p) in self.unwritten:
            self.unwritten.discard(id(p))
            view.copy_(p.grad)
        else:
            view.add_(p.grad)

    def fill_unwritten(self) -> None:
        """Zero the views of parameters that got no gradient, before the bucket is reduced."""
        for pid in self.unwritten:
            self.grad_views[pid].zero_()
        self.unwritten = set()
