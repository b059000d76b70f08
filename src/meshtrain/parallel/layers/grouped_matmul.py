"""One linear map per group of consecutive rows, all groups in one computation: the projections
of an MoE layer's local experts over rows sorted by expert.

Three ways, equal in value: `loop` (one matmul per group, what a per-expert module does),
`padded` (the groups padded to the largest into `[G, max_rows, in]` and one batched matmul) and
`grouped` (torch's grouped matmul over the jagged rows, forward and backward). `expert_gemm`
is the one place a setting becomes a backend: `auto` takes the measured best per device
(docs/benchmarks.md, "MoE experts computed together"); `grouped` where torch lacks it, or
cannot take the operands (dtype, 16-byte strides), runs `padded` instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEMMS = ("auto", "loop", "padded", "grouped")
"""The `moe_gemm` choices."""

# Measured on a quiet host (docs/benchmarks.md): on a CPU the per-expert loop is the fastest
# of the three (padded the slowest); grouped matmul is the kernel GPUs have.
_AUTO = {"cpu": "loop", "cuda": "grouped"}
_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16),
                   "cuda": (torch.bfloat16,)}


def grouped_mm_function():
    """torch's grouped matmul (`F.grouped_mm`, earlier `torch._grouped_mm`), or None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def expert_gemm(setting: str, device: torch.device) -> str:
    """The backend `setting` means on `device`: `auto` -> the measured choice there."""
    if setting == "auto":
        setting = _AUTO.get(device.type, "loop")
    if setting == "grouped" and grouped_mm_function() is None:
        return "padded"
    return setting


def _grouped_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes these operands: a dtype it has on this device and
    rows of both sides a multiple of 16 bytes long."""
    width = x.element_size()
    return (x.dtype in _GROUPED_DTYPES.get(x.device.type, ()) and weight.dtype == x.dtype
            and all(n * width % 16 == 0 for n in weight.shape[1:]))


class _GroupedLinear(torch.autograd.Function):
    """`x W_g^T` for the rows of each group g (ends `offsets`, int32), by grouped matmuls in
    forward and backward (contiguous gradients: the kernel needs real strides)."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return grouped_mm_function()(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        grad, mm = grad.contiguous(), grouped_mm_function()
        grad_x = mm(grad, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        grad_w = mm(grad.t(), x, offs=offsets) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def _loop(x, weight, bias, sizes):
    return torch.cat([F.linear(rows, weight[g], None if bias is None else bias[g])
                      for g, rows in enumerate(x.split(sizes))])


def _padded(x, weight, bias, sizes):
    longest = max(sizes)
    within = torch.arange(x.shape[0], device=x.device) - torch.repeat_interleave(
        _starts(sizes, x.device), _sizes(sizes, x.device), output_size=x.shape[0])
    slots = groups_of(sizes, x.device, x.shape[0]) * longest + within
    padded = x.new_zeros(len(sizes) * longest, x.shape[1]).index_copy(0, slots, x)
    padded = padded.view(len(sizes), longest, -1)
    out = torch.bmm(padded, weight.transpose(1, 2)) if bias is None else \
        torch.baddbmm(bias.unsqueeze(1), padded, weight.transpose(1, 2))
    return out.view(-1, weight.shape[1]).index_select(0, slots)


def _grouped(x, weight, bias, sizes):
    offsets = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
    out = _GroupedLinear.apply(x, weight, offsets)
    return out if bias is None else add_per_group(out, bias, sizes)


def add_per_group(x: torch.Tensor, bias: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """`bias[g]` added to group g's rows, each group's bias gradient summed over its own rows
    alone (as a per-expert layer's is: the same sums, bitwise)."""
    return torch.cat([rows + b for rows, b in zip(x.split(sizes), bias, strict=True)])


def _sizes(sizes: list[int], device) -> torch.Tensor:
    return torch.tensor(sizes, device=device)


def _starts(sizes: list[int], device) -> torch.Tensor:
    return _sizes([0] + sizes[:-1], device).cumsum(0)


def groups_of(sizes: list[int], device, rows: int) -> torch.Tensor:
    """Each row's group."""
    return torch.repeat_interleave(torch.arange(len(sizes), device=device),
                                   _sizes(sizes, device), output_size=rows)


_BACKENDS = {"loop": _loop, "padded": _padded, "grouped": _grouped}


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   sizes: list[int], backend: str) -> torch.Tensor:
    """`x` [N, in], its rows in groups of `sizes` (sum N), through group g's linear map
    (`weight` [G, out, in], `bias` [G, out] or None) -> [N, out]; `backend` from
    `expert_gemm`."""
    if x.shape[0] == 0:  # (the loop gives every weight its zero gradient)
        backend = "loop"
    if backend == "grouped" and not _grouped_fits(x, weight):
        backend = "padded"
    return _BACKENDS[backend](x, weight, bias, sizes)
