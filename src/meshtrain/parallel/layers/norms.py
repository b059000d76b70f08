"""RMSNorm (also over each attention head), and LayerNorm and RMSNorm over hidden states whose
last dimension is split over a mesh axis (3D tensor parallelism holds `[b/q^2, s, h/q]`). One
RMSNorm kernel serves both: on a whole row its statistics are local means, on a split row
all-reduced sums.

Each rank normalises its slice of every row; the row statistics are local sums all-reduced over
the hidden axis (forward: the mean, then the centred sum of squares, or the sum of squares;
backward: one all-reduce of the two or one row sums the input gradient needs). The scale and
shift hold the rank's hidden slice and see only its tokens: their gradients are partial over the
`partial` axes. Statistics are computed in fp32 or wider, as `nn.LayerNorm` and
`RMSNorm` do; only the input and the row statistics are saved.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.sharding import Shard, shard_tensor
from meshtrain.precision import wide_dtype


def _row_sum(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Sum over the last dimension of the whole (split) row: `[..., 1]` on every rank."""
    total = x.sum(-1, keepdim=True)
    comm.all_reduce(total, axis)
    return total


def _row_mean(x: torch.Tensor, axis: MeshAxis | None, size: int) -> torch.Tensor:
    """Mean over the last dimension of a whole row (`axis` None: this rank holds it) or of a
    row split over `axis` (`size` elements in all)."""
    return x.mean(-1, keepdim=True) if axis is None else _row_sum(x, axis) / size


def _token_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum over every dimension but the last (a scale's or shift's gradient)."""
    return x.flatten(0, -2).sum(0).to(dtype)


class _LayerNormFn(torch.autograd.Function):
    """(x - mean) / sqrt(biased var + eps) * weight + bias, the affine part in the wide dtype and
    rounded once (as nn.LayerNorm's kernels)."""

    @staticmethod
    def forward(ctx, x, weight, bias, axis: MeshAxis, size: int, eps: float):
        wide = x.to(wide_dtype(x.dtype))
        mean = _row_sum(wide, axis) / size
        centred = wide - mean
        rstd = torch.rsqrt(_row_sum(centred * centred, axis) / size + eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.axis, ctx.size, ctx.has_bias = axis, size, bias is not None
        out = centred * rstd * weight
        return (out if bias is None else out + bias).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        wide_grad = grad.to(wide_dtype(x.dtype))
        normed = (x.to(wide_grad.dtype) - mean) * rstd
        g = wide_grad * weight
        sums = torch.cat([g.sum(-1, keepdim=True), (g * normed).sum(-1, keepdim=True)], dim=-1)
        comm.all_reduce(sums, ctx.axis)
        means = sums / ctx.size
        grad_x = rstd * (g - means[..., :1] - normed * means[..., 1:])
        grad_weight = _token_sum(wide_grad * normed, weight.dtype)
        grad_bias = _token_sum(wide_grad, weight.dtype) if ctx.has_bias else None
        return grad_x.to(x.dtype), grad_weight, grad_bias, None, None, None


class _RMSNormFn(torch.autograd.Function):
    """x / rms(x) * weight, computed in the wide dtype and rounded to x's before the weight
    multiplies it (as Llama's reference code); `axis` None for a whole row."""

    @staticmethod
    def forward(ctx, x, weight, axis: MeshAxis | None, size: int, eps: float):
        wide = x.to(wide_dtype(x.dtype))
        rstd = torch.rsqrt(_row_mean(wide.pow(2), axis, size) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        ctx.axis, ctx.size = axis, size
        return weight * (wide * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        wide = wide_dtype(x.dtype)
        normed = x.to(wide) * rstd
        grad_weight = _token_sum(grad.to(wide) * normed.to(x.dtype).to(wide), weight.dtype)
        g = (grad * weight).to(wide)
        grad_x = rstd * (g - normed * _row_mean(g * normed, ctx.axis, ctx.size))
        return grad_x.to(x.dtype), grad_weight, None, None, None


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) with a learned scale, computed in fp32
    (or wider); saves only its input and 1/rms."""

    def __init__(self, size: int, *, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, None, self.weight.shape[0], self.eps)


class HeadNorm(RMSNorm):
    """An RMSNorm over each attention head's dimension, one scale `[d]` shared by every head
    (Qwen3's query and key norms). It is whole on every rank while each rank attends only its
    own heads (and, in the grid schemes, its own batch chunk): its gradient is partial over the
    `partial` axes (`partial_axes`)."""

    def __init__(self, dense: RMSNorm, *, partial: tuple[str, ...]):
        super().__init__(dense.weight.shape[0], eps=dense.eps)
        with torch.no_grad():
            self.weight.copy_(dense.weight)
        self.partial_axes = {"weight": partial}


class _SplitNorm(nn.Module):
    """Shared construction: the dense norm's parameters, sliced along the hidden axis."""

    def __init__(self, dense: nn.Module, mesh: ParallelMesh, *, hidden_axis: str,
                 partial: tuple[str, ...]):
        super().__init__()
        self.mesh, self.axis = mesh, mesh.axis(hidden_axis)
        self.size = dense.weight.shape[0]
        spec = Shard(0, self.size, self.size, axes=(hidden_axis,))
        if self.size % self.axis.size:
            raise SettingError(Code.GRID_SHAPE,
                               f"the hidden size ({self.size}) must be divisible by the"
                               f" {hidden_axis} degree ({self.axis.size}): change the model or"
                               " `tp`")
        self.shards, self.partial_axes = {}, {}
        for name in ("weight", "bias"):
            full = getattr(dense, name, None)
            if full is None:
                self.register_parameter(name, None)
                continue
            self.register_parameter(name, nn.Parameter(shard_tensor(full.detach(), spec, mesh)))
            self.shards[name], self.partial_axes[name] = spec, partial


class SplitLayerNorm(_SplitNorm):
    """`nn.LayerNorm` (with its scale, and its shift if any) over a split hidden dimension."""

    def __init__(self, dense: nn.LayerNorm, mesh: ParallelMesh, *, hidden_axis: str,
                 partial: tuple[str, ...]):
        if dense.weight is None or len(dense.normalized_shape) != 1:
            raise SettingError(Code.MODEL_UNSUPPORTED,
                               "a split LayerNorm needs a learned scale (`elementwise_affine`)"
                               " over the last dimension")
        super().__init__(dense, mesh, hidden_axis=hidden_axis, partial=partial)
        self.eps = dense.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LayerNormFn.apply(x, self.weight, self.bias, self.axis, self.size, self.eps)


class SplitRMSNorm(_SplitNorm):
    """`RMSNorm` over a split hidden dimension."""

    def __init__(self, dense: nn.Module, mesh: ParallelMesh, *, hidden_axis: str,
                 partial: tuple[str, ...]):
        super().__init__(dense, mesh, hidden_axis=hidden_axis, partial=partial)
        self.eps = dense.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.axis, self.size, self.eps)
