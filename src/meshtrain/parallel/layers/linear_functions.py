"""The autograd functions of Megatron's 1D linear layers (`tensor.py`): each runs a layer's
local matmuls through its `gemm` (`DENSE`, or float8 after `fp8.convert_to_float8`) with the
communication Megatron puts around them: f and g fused with the matmuls, the sequence-parallel
all-gather and reduce-scatter, or (`tp_overlap`) those as ring steps behind chunks of the
matmuls (`collective_matmul.py`). A split-backward schedule may defer each weight gradient
(`weight_grads.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.collective_matmul import (
    gather_matmul,
    matmul_reduce_scatter,
    sequence_chunk,
)
from meshtrain.parallel.layers.eager import eager_under_compile
from meshtrain.parallel.layers.weight_grads import WeightGradients, now_or_later


def _joined(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Several layers' weights (or biases) stacked along the output; one is itself."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _split_params(num_weights: int, params: tuple) -> tuple[tuple, tuple]:
    """(weights, biases) of `params` = weights followed by biases (none, or one each)."""
    return params[:num_weights], params[num_weights:]


def _save_column(ctx, x, axis: MeshAxis, num_weights: int,
                 weight_grads: WeightGradients | None, gemm: DenseGemm,
                 params: tuple) -> tuple[tuple, tuple]:
    """What a column-parallel forward keeps for its backward: the input it was given and the
    weights (never their join), the axis, the gemm and where weight gradients go; returns
    (weights, biases)."""
    weights, biases = _split_params(num_weights, params)
    ctx.save_for_backward(x, *weights)
    ctx.axis, ctx.has_bias, ctx.gemm = axis, bool(biases), gemm
    ctx.weight_grads, ctx.params = weight_grads, params
    return weights, biases


class DenseGemm:
    """The local matmuls of a linear layer, in the dtype of its operands: the output
    `x W^T + b`, the input gradient `g W` and the weight gradient `g^T x`. A subclass computes
    them another way (`fp8.Float8Gemm`); the layers' autograd functions call these three and
    nothing else for their matmuls."""

    def output(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """`[..., in]` x `[out, in]` (+ `[out]`) -> `[..., out]`."""
        return F.linear(x, weight, bias)

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`[..., out]` x `[out, in]` -> `[..., in]`."""
        return grad @ weight

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`[tokens, out]` and `[tokens, in]` -> `[out, in]`."""
        return grad.T @ x


DENSE = DenseGemm()
"""Every layer's `gemm` unless converted."""


def _column_grads(ctx, grad: torch.Tensor, x: torch.Tensor, weights) -> tuple:
    """Weight and bias gradients of the joined layers, split back per layer."""
    flat_grad = grad.reshape(-1, grad.shape[-1])
    sizes = [w.shape[0] for w in weights]
    grad_weights = ctx.gemm.grad_weight(flat_grad, x.reshape(-1, x.shape[-1])).split(sizes)
    grad_biases = flat_grad.sum(dim=0).split(sizes) if ctx.has_bias else ()
    return (*grad_weights, *grad_biases)


class _LinearFn(torch.autograd.Function):
    """`F.linear` whose weight gradient a split backward may defer: the local matmul of the
    paths with no communication fused in (tp 1, the sequence-parallel row layer and output
    layer). Used only when `weight_grads` is given or the layer's `gemm` is not `DENSE`."""

    @staticmethod
    def forward(ctx, x, weight_grads: WeightGradients | None, gemm: DenseGemm, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.weight_grads, ctx.params, ctx.has_bias = weight_grads, (weight, bias), bias is not None
        ctx.gemm = gemm
        return gemm.output(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grads = now_or_later(ctx.weight_grads, ctx.params, lambda: (
            *_column_grads(ctx, grad, x, [weight]), *(() if ctx.has_bias else (None,))))
        return ctx.gemm.grad_input(grad, weight), None, None, *grads


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            weight_grads: WeightGradients | None, gemm: DenseGemm = DENSE) -> torch.Tensor:
    """F.linear, through `_LinearFn` when the weight gradient may be deferred or the matmuls
    are not the dense ones."""
    if weight_grads is None and gemm is DENSE:
        return F.linear(x, weight, bias)
    return _LinearFn.apply(x, weight_grads, gemm, weight, bias)


class ColumnParallelLinearFn(torch.autograd.Function):
    """f fused with the matmul: identity forward; backward launches the input gradient's
    all-reduce over TP and computes the weight gradient while it is in flight (or defers it:
    `weight_grads`). `params` are the weights, then the biases (if any), of one or more layers
    applied to the same input (`ColumnParallelGroup`): joined inside, so the joined weight is
    never saved."""

    @staticmethod
    def forward(ctx, x, axis: MeshAxis, num_weights: int,
                weight_grads: WeightGradients | None, gemm: DenseGemm, *params):
        weights, biases = _save_column(ctx, x, axis, num_weights, weight_grads, gemm, params)
        return gemm.output(x, _joined(weights), _joined(biases) if biases else None)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        grad_x, work = None, None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.gemm.grad_input(grad, _joined(weights))
            work = comm.all_reduce(grad_x, ctx.axis, async_op=True)
        params = now_or_later(ctx.weight_grads, ctx.params,
                              lambda: _column_grads(ctx, grad, x, weights))
        if work is not None:
            work.wait()
        return grad_x, None, None, None, None, *params


def column_parallel(x: torch.Tensor, axis: MeshAxis, sequence_parallel: bool,
                     layers: list, overlap: bool = False) -> torch.Tensor:
    """`layers`' outputs of `x`, joined along the last dimension: one input communication
    (`overlap`: the sequence-parallel one as ring steps behind chunks of the matmul)."""
    params = [layer.weight for layer in layers]
    params += [layer.bias for layer in layers if layer.bias is not None]
    weight_grads, gemm = layers[0].weight_grads, layers[0].gemm  # (a group is converted whole)
    if sequence_parallel and overlap:  # x: [b, s/tp, in]
        return overlapped_column(x, axis, len(layers), weight_grads, gemm, False, *params)
    if sequence_parallel:  # x: [b, s/tp, in]
        return _SequenceParallelLinear.apply(x, axis, len(layers), weight_grads, gemm, *params)
    if axis.size > 1 or len(layers) > 1:  # (several layers: do not save their joined weight)
        return ColumnParallelLinearFn.apply(x, axis, len(layers), weight_grads, gemm, *params)
    return linear(x, layers[0].weight, layers[0].bias, weight_grads, gemm)


class RowParallelLinearFn(torch.autograd.Function):
    """The matmul fused with g: the partial product is all-reduced in place (no copy);
    backward is local (its weight gradient deferred under `weight_grads`)."""

    @staticmethod
    def forward(ctx, x, weight, axis: MeshAxis, weight_grads: WeightGradients | None,
                gemm: DenseGemm):
        ctx.save_for_backward(x, weight)
        ctx.weight_grads, ctx.params, ctx.gemm = weight_grads, (weight,), gemm
        y = gemm.output(x, weight, None)
        comm.all_reduce(y, axis)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = ctx.gemm.grad_input(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight, = now_or_later(ctx.weight_grads, ctx.params, lambda: (
            ctx.gemm.grad_weight(grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])),))
        return grad_x, grad_weight, None, None, None


class _SequenceParallelLinear(torch.autograd.Function):
    """All-gather the `[b, s/tp, in]` input along the sequence, then the local matmul (of one
    or more layers' joined `params`, as `ColumnParallelLinearFn`).

    Only the s/tp shard is saved; backward all-gathers it again for the weight gradient (one
    extra all-gather, as in Megatron) and reduce-scatters the input gradient.
    """

    @staticmethod
    def forward(ctx, x, axis: MeshAxis, num_weights: int,
                weight_grads: WeightGradients | None, gemm: DenseGemm, *params):
        weights, biases = _save_column(ctx, x, axis, num_weights, weight_grads, gemm, params)
        return gemm.output(comm.all_gather(x, axis, dim=1), _joined(weights),
                           _joined(biases) if biases else None)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        grad_x = comm.reduce_scatter(ctx.gemm.grad_input(grad, _joined(weights)), ctx.axis,
                                     dim=1)
        # deferred, the all-gather runs at the weight-gradient action
        params = now_or_later(ctx.weight_grads, ctx.params, lambda: _column_grads(
            ctx, grad, comm.all_gather(x, ctx.axis, dim=1), weights))  # [b, s, in]
        return grad_x, None, None, None, None, *params


class _OverlappedColumnLinear(torch.autograd.Function):
    """`_SequenceParallelLinear` with its communication overlapped (`tp_overlap`): the
    all-gather of the `[b, s/tp, in]` input runs as ring steps, each behind the matmul of the
    chunk already here (`gather_matmul`); backward reduce-scatters the input gradient as ring
    steps behind the partial matmul of the next chunk (`matmul_reduce_scatter`) and re-gathers
    the input for the weight gradient along the same steps. A split backward that defers the
    weight gradient leaves the re-gather to the weight-gradient action (one all-gather, as
    unoverlapped). `save_gathered`: keep the gathered input for backward instead of the shard
    (the output layer, which saves it unoverlapped too: no re-gather)."""

    @staticmethod
    def forward(ctx, x, axis: MeshAxis, num_weights: int,
                weight_grads: WeightGradients | None, gemm: DenseGemm, save_gathered: bool,
                *params):
        weights, biases = _split_params(num_weights, params)
        weight, bias = _joined(weights), _joined(biases) if biases else None
        products, chunks = gather_matmul(x, axis, lambda chunk: gemm.output(chunk, weight, bias))
        ctx.save_for_backward(torch.cat(chunks, dim=1) if save_gathered else x, *weights)
        ctx.axis, ctx.has_bias, ctx.save_gathered = axis, bool(biases), save_gathered
        ctx.gemm = gemm
        ctx.weight_grads, ctx.params = weight_grads, params
        return torch.cat(products, dim=1)  # [b, s, out/tp]

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors  # x: [b, s/tp, in], or [b, s, in] if save_gathered
        axis, weight = ctx.axis, _joined(weights)
        deferred = ctx.weight_grads is not None and ctx.weight_grads.deferring
        carry = None if ctx.save_gathered or deferred else x
        grad_x, chunks = None, None
        if ctx.needs_input_grad[0]:
            grad_x, chunks = matmul_reduce_scatter(
                lambda j: ctx.gemm.grad_input(sequence_chunk(grad, axis, j), weight), axis,
                carry=carry)

        def gathered() -> torch.Tensor:  # [b, s, in]
            if ctx.save_gathered:
                return x
            if chunks is not None:
                return torch.cat(chunks, dim=1)
            return comm.all_gather(x, axis, dim=1)

        params = now_or_later(ctx.weight_grads, ctx.params,
                              lambda: _column_grads(ctx, grad, gathered(), weights))
        return grad_x, None, None, None, None, None, *params


class _OverlappedRowLinear(torch.autograd.Function):
    """The sequence-parallel row-parallel matmul and its reduce-scatter along the sequence as
    ring steps, each behind the partial matmul of the next chunk (`tp_overlap`); backward
    all-gathers the output gradient as ring steps behind the input-gradient matmul of the chunk
    already here, and keeps the gathered gradient for the weight gradient (deferred under
    `weight_grads`). The bias is added by the layer, after the sum."""

    @staticmethod
    def forward(ctx, x, weight, axis: MeshAxis, weight_grads: WeightGradients | None,
                gemm: DenseGemm):
        ctx.save_for_backward(x, weight)  # x: [b, s, in/tp]
        ctx.axis, ctx.weight_grads, ctx.params, ctx.gemm = axis, weight_grads, (weight,), gemm
        y, _ = matmul_reduce_scatter(
            lambda j: gemm.output(sequence_chunk(x, axis, j), weight, None), axis)
        return y  # [b, s/tp, out]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needed = ctx.needs_input_grad[0]
        gemm = ctx.gemm
        products, chunks = gather_matmul(
            grad, ctx.axis, lambda chunk: gemm.grad_input(chunk, weight) if needed else chunk)
        grad_x = torch.cat(products, dim=1) if needed else None  # [b, s, in/tp]
        full = torch.cat(chunks, dim=1)  # [b, s, out]
        grad_weight, = now_or_later(ctx.weight_grads, ctx.params, lambda: (
            gemm.grad_weight(full.reshape(-1, full.shape[-1]), x.reshape(-1, x.shape[-1])),))
        return grad_x, grad_weight, None, None, None


# Dynamo cannot trace the ring's point-to-point calls: under torch.compile each overlapped layer
# is one call that the graph breaks around and that runs eagerly (traced, it would break several
# times inside the ring instead).
overlapped_column = eager_under_compile(_OverlappedColumnLinear.apply)
overlapped_row = eager_under_compile(_OverlappedRowLinear.apply)
