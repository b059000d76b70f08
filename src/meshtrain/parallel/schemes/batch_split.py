"""What the grid schemes (2D, 2.5D, 3D) share: hidden states split over the batch inside the
TP block, so partial results are reduce-scattered along the batch and per-token values
gathered along it; layers built from the dense layer they replace by slicing its parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.sharding import shard_tensor


class _ReduceScatterBatch(torch.autograd.Function):
    """Sum partial results over an axis, keeping this rank's chunk of the batch; backward
    all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, axis: MeshAxis):
        ctx.axis = axis
        return comm.reduce_scatter(x, axis, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.axis, dim=0), None


def reduce_scatter_batch(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Partial `[b, ...]` summed over `axis`, this rank's `[b/n, ...]` kept (differentiable)."""
    return x if axis.size == 1 else _ReduceScatterBatch.apply(x, axis)


class _GatherBatch(torch.autograd.Function):
    """Concatenate every rank's batch chunk of a value every rank then uses alike (the
    per-token loss); backward keeps this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx, x, axis: MeshAxis):
        ctx.axis = axis
        return comm.all_gather(x, axis, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.axis.size)[ctx.axis.rank], None


def gather_batch(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """`x`'s batch chunks over `axis` joined (differentiable, see `_GatherBatch`)."""
    return x if axis.size == 1 else _GatherBatch.apply(x, axis)


def adopt_slices(module: nn.Module, dense: nn.Module) -> None:
    """Give `module` this rank's slice of each of `dense`'s parameters it has a split for
    (`module.shards`, relative to `module.mesh`)."""
    for name, spec in module.shards.items():
        full = getattr(dense, name).detach()
        module.register_parameter(name, nn.Parameter(shard_tensor(full, spec, module.mesh)))


def partial_gradients_by_axis(model: nn.Module, mesh, exclude: set[int]
                              ) -> list[tuple[MeshAxis, list[nn.Parameter]]]:
    """The parameters each layer names in its `partial_axes` (name -> grid axes its gradient
    is summed over), grouped by axis, in the order the axes first appear."""
    groups: dict[str, list[nn.Parameter]] = {}
    for module in model.modules():
        for name, axes in getattr(module, "partial_axes", {}).items():
            param = getattr(module, name)
            if id(param) not in exclude:
                for axis in axes:
                    groups.setdefault(axis, []).append(param)
    return [(mesh.axis(axis), params) for axis, params in groups.items()]
