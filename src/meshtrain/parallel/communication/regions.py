"""Differentiable communication: autograd functions whose backward is the conjugate
collective, built on `comm`'s counted helpers.

The region operators of the Megatron paper on the tensor-parallel axis: f =
`copy_to_tensor_parallel_region` (identity forward, all-reduce backward) and its conjugate g =
`reduce_from_tensor_parallel_region` (all-reduce forward, identity backward), scatter/gather
along the last dimension, the sequence-parallel regions along the sequence, and the all-to-all
that MoE dispatch and Ulysses attention pass gradients back through.
"""

from __future__ import annotations

import torch

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    reduce_scatter,
    split_along,
)


class _AllToAll(torch.autograd.Function):
    """all_to_all forward; the reverse all_to_all (splits swapped) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis, send_splits, recv_splits):
        ctx.axis, ctx.send_splits, ctx.recv_splits = axis, send_splits, recv_splits
        return all_to_all(x, axis, send_splits=send_splits, recv_splits=recv_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad, ctx.axis, send_splits=ctx.recv_splits,
                          recv_splits=ctx.send_splits), None, None, None


def all_to_all_differentiable(x: torch.Tensor, axis: MeshAxis, *, send_splits: list[int],
                              recv_splits: list[int]) -> torch.Tensor:
    """`all_to_all` that autograd can pass gradients back through (MoE token dispatch)."""
    if axis.size == 1:
        return x
    return _AllToAll.apply(x, axis, list(send_splits), list(recv_splits))



class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, ctx.axis)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, axis):
        out = x.clone(memory_format=torch.contiguous_format)
        all_reduce(out, axis)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's chunk of the last dimension; backward gathers the gradient."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return split_along(x, axis, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.axis, dim=-1), None


class _GatherFromRegion(torch.autograd.Function):
    """Concatenate every rank's chunk of the last dimension; backward keeps this rank's chunk."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return all_gather(x, axis, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, ctx.axis, dim=-1), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Keep this rank's chunk of the sequence (dim 1); backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return split_along(x, axis, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.axis, dim=1), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather the sequence (dim 1); backward reduce-scatters the gradient (the conjugate)."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return all_gather(x, axis, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.axis, dim=1), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Sum partial results over TP, keeping this rank's chunk of the sequence; backward
    all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x, axis):
        ctx.axis = axis
        return reduce_scatter(x, axis, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.axis, dim=1), None


def scatter_to_sequence_parallel_region(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Split `[b, s, h]` into this rank's `[b, s/t, h]`."""
    return x if axis.size == 1 else _ScatterToSequenceRegion.apply(x, axis)


def gather_from_sequence_parallel_region(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """`[b, s/t, h]` -> `[b, s, h]` (all-gather); the gradient is reduce-scattered."""
    return x if axis.size == 1 else _GatherFromSequenceRegion.apply(x, axis)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Partial `[b, s, h]` -> summed `[b, s/t, h]` (reduce-scatter); the gradient all-gathered."""
    return x if axis.size == 1 else _ReduceScatterToSequenceRegion.apply(x, axis)


def copy_to_tensor_parallel_region(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """f: enter a TP region with a replicated input; the gradient is summed over `axis`."""
    return x if axis.size == 1 else _CopyToRegion.apply(x, axis)


def reduce_from_tensor_parallel_region(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """g: leave a TP region by summing partial results over `axis`."""
    return x if axis.size == 1 else _ReduceFromRegion.apply(x, axis)


def scatter_to_tensor_parallel_region(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Split the last dimension over `axis`, keeping this rank's chunk."""
    return x if axis.size == 1 else _ScatterToRegion.apply(x, axis)


def gather_from_tensor_parallel_region(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Concatenate the last dimension over `axis`."""
    return x if axis.size == 1 else _GatherFromRegion.apply(x, axis)
