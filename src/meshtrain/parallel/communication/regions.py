"""Differentiable communication: autograd functions whose backward is the conjugate
collective, built on `comm`'s counted helpers, all from one constructor (`conjugate`).

The region operators of the Megatron paper on the tensor-parallel axis: f =
`copy_to_tensor_parallel_region` (identity forward, all-reduce backward) and its conjugate g =
`reduce_from_tensor_parallel_region` (all-reduce forward, identity backward), scatter/gather
along the last dimension, the sequence-parallel regions along the sequence, the batch regions
of the grid schemes, and the all-to-all that MoE dispatch and Ulysses attention pass gradients
back through. Each is the identity on an axis of one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    reduce_scatter,
    split_along,
)

Collective = Callable[..., torch.Tensor]  # (tensor, axis, *args) -> tensor


def conjugate(forward: Collective, backward: Collective, doc: str) -> Collective:
    """`x -> forward(x, axis, *args)` for autograd, whose gradient is `backward(grad, axis,
    *args)`; the identity when `axis` has one rank."""

    def _forward(ctx, x, axis, *args):
        ctx.axis, ctx.args = axis, args
        return forward(x, axis, *args)

    def _backward(ctx, grad):
        return backward(grad, ctx.axis, *ctx.args), None, *(None for _ in ctx.args)

    function = type("Conjugate", (torch.autograd.Function,),
                    {"forward": staticmethod(_forward), "backward": staticmethod(_backward)})

    def apply(x: torch.Tensor, axis: MeshAxis, *args) -> torch.Tensor:
        return x if axis.size == 1 else function.apply(x, axis, *args)

    apply.__doc__ = doc
    return apply


def _view(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    return x.view_as(x)


def _same(grad: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    return grad


def _summed(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """`x` summed over `axis` into a new tensor."""
    out = x.clone(memory_format=torch.contiguous_format)
    all_reduce(out, axis)
    return out


def _own_batch_chunk(grad: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    return grad.chunk(axis.size)[axis.rank]


def _swapped_all_to_all(grad, axis, send_splits, recv_splits) -> torch.Tensor:
    return all_to_all(grad, axis, send_splits=recv_splits, recv_splits=send_splits)


def _all_to_all(x, axis, send_splits, recv_splits) -> torch.Tensor:
    return all_to_all(x, axis, send_splits=send_splits, recv_splits=recv_splits)


copy_to_tensor_parallel_region = conjugate(
    _view, _summed, "f: enter a TP region with a replicated input; the gradient is summed over"
                    " `axis`.")
reduce_from_tensor_parallel_region = conjugate(
    _summed, _same, "g: leave a TP region by summing partial results over `axis`.")
scatter_to_tensor_parallel_region = conjugate(
    partial(split_along, dim=-1), partial(all_gather, dim=-1),
    "Split the last dimension over `axis`, keeping this rank's chunk.")
gather_from_tensor_parallel_region = conjugate(
    partial(all_gather, dim=-1), partial(split_along, dim=-1),
    "Concatenate the last dimension over `axis`.")
gather_from_sequence_parallel_region = conjugate(
    partial(all_gather, dim=1), partial(reduce_scatter, dim=1),
    "`[b, s/t, h]` -> `[b, s, h]` (all-gather); the gradient is reduce-scattered.")
reduce_scatter_to_sequence_parallel_region = conjugate(
    partial(reduce_scatter, dim=1), partial(all_gather, dim=1),
    "Partial `[b, s, h]` -> summed `[b, s/t, h]` (reduce-scatter); the gradient all-gathered.")
gather_sequence_alike = conjugate(
    partial(all_gather, dim=1), partial(split_along, dim=1),
    "`[b, s/t, ...]` -> `[b, s, ...]` for a computation every rank then repeats alike (MoE"
    " routing and dispatch under sequence parallelism); the gradient keeps this rank's chunk.")
split_sequence = conjugate(
    partial(split_along, dim=1), partial(all_gather, dim=1),
    "This rank's `[b, s/t, ...]` of a `[b, s, ...]` every rank holds alike; the gradient is"
    " all-gathered.")
reduce_scatter_batch = conjugate(
    partial(reduce_scatter, dim=0), partial(all_gather, dim=0),
    "Partial `[b, ...]` summed over `axis`, this rank's `[b/n, ...]` kept (grid schemes).")
gather_batch = conjugate(
    partial(all_gather, dim=0), _own_batch_chunk,
    "`x`'s batch chunks over `axis` joined, for a value every rank then uses alike (the"
    " per-token loss); the gradient keeps this rank's chunk.")
_all_to_all_conjugate = conjugate(
    _all_to_all, _swapped_all_to_all,
    "`all_to_all` with split sizes; the gradient takes the reverse all-to-all.")


def all_to_all_differentiable(x: torch.Tensor, axis: MeshAxis, *, send_splits: list[int],
                              recv_splits: list[int]) -> torch.Tensor:
    """`all_to_all` that autograd can pass gradients back through (MoE token dispatch,
    Ulysses attention)."""
    return _all_to_all_conjugate(x, axis, list(send_splits), list(recv_splits))
