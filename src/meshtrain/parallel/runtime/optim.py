"""AdamW with the usual decay groups, warmup + cosine learning rate, and global-norm clipping
that counts every parameter exactly once across the mesh."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.sharding import primary_parameters
from meshtrain.precision import wide_dtype

BETAS, EPS = (0.9, 0.95), 1e-8
"""AdamW's defaults here (GPT-3's and Megatron-LM's usual betas)."""


ADAMW_KERNELS = {"cuda": "fused", "cpu": "fused"}
"""The AdamW implementation each device type steps with: torch's fused kernel (on the CPU since
torch 2.4; every floating dtype) reads and writes each element once, where `foreach` makes about
ten passes over parameter, gradient and moments. `benchmarks/bench_optimizer.py` measured it on
this CPU host (docs/benchmarks.md): 2.6-3x faster on the tiny model's parameters, 5.8-6.8x at
68M-124M. Both agree within 1e-6 (tests/test_optimizer.py). Other device types (and
non-floating parameters) step with `foreach`."""


def adamw_kernel(params: list[torch.Tensor]) -> str:
    """`fused` or `foreach`: `ADAMW_KERNELS`' choice for the device type the parameters live
    on (the model's device, or the host for CPU-offloaded ZeRO states); `foreach` when they are
    not all floating tensors of one device type."""
    kinds = {p.device.type for p in params}
    if len(kinds) != 1 or not all(p.is_floating_point() for p in params):
        return "foreach"
    return ADAMW_KERNELS.get(kinds.pop(), "foreach")


def build_adamw(params: Iterable[nn.Parameter], *, lr: float, weight_decay: float,
                betas: tuple[float, float] = BETAS, eps: float = EPS,
                no_decay: set[int] | None = None) -> torch.optim.AdamW:
    """Decay matrices and embeddings; never biases or LayerNorm parameters (all 1-D). ZeRO's
    flat pieces are 1-D whatever they came from: `no_decay` then names them (ids). Every AdamW
    of a run is built here, so `adamw_kernel` picks the implementation in one place."""
    params = [p for p in params if p.requires_grad]
    skip = no_decay if no_decay is not None else {id(p) for p in params if p.dim() < 2}
    decay = [p for p in params if id(p) not in skip]
    no_decay = [p for p in params if id(p) in skip]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps,
                             **{adamw_kernel(params): True})


def restored_step(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                  step: torch.Tensor) -> torch.Tensor:
    """A checkpoint's step count as `optimizer` keeps it for `param`: the fused kernel reads
    it as fp32 on the parameter's device, `foreach` as a host scalar."""
    step = step.reshape(()).clone()
    return step.to(param.device, torch.float32) if optimizer.defaults.get("fused") else step


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""The `lr_schedule` choices after the linear warmup: cosine or linear decay to `min_lr` at the
last step, constant `lr`, or warmup-stable-decay (constant, then linear decay to `min_lr` over
the last `lr_decay_fraction` of the steps after warmup)."""


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to `lr`, then
    `schedule` (one of `LR_SCHEDULES`) down to `min_lr` at `total_steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = max(1, total_steps - warmup_steps)
    start = warmup_steps
    if schedule == "wsd":
        decay_steps = max(1, round(decay_fraction * decay_steps))
        start = total_steps - decay_steps
        if step < start:
            return lr
    progress = min(1.0, (step - start) / decay_steps)
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress


def global_grad_norm(model: nn.Module, mesh: ParallelMesh,
                     grads: dict[int, torch.Tensor] | None = None, *,
                     counted_elsewhere: set[int] = frozenset(), experts: set[int] = frozenset(),
                     sharded: bool = False) -> torch.Tensor:
    """L2 norm of the whole model's gradient, each logical parameter counted once.

    TP-sharded parameters: every rank's shard counts (summed over TP; a shard several TP ranks
    share counts on the first of them). Replicated parameters (norms, row-parallel biases,
    positions): counted on TP rank 0 only. Pipeline stages hold different layers and are summed
    over PP. DP replicas hold the same averaged gradient, so nothing is summed over DP; `experts`
    are summed over EP (each EP rank holds different experts) but not over their replicas (edp).
    `grads` maps id(parameter) to its gradient where it does not live in `.grad` (fp32 buffers
    of 16-bit parameters); `counted_elsewhere` are copies counted on another rank (the last
    pipeline stage's tied embedding). `sharded`: ZeRO gradients, each DP rank holding a
    different piece, so the squares are also summed over the data-parallel axes (dp x cp for
    dense parameters, edp for experts).
    """
    counted = primary_parameters(model, mesh)
    first = next(model.parameters())
    dtype = wide_dtype(first.dtype)
    dense = torch.zeros((), dtype=dtype, device=first.device)
    expert = torch.zeros((), dtype=dtype, device=first.device)
    for p in model.parameters():
        grad = p.grad if grads is None else grads.get(id(p))
        if grad is None or id(p) in counted_elsewhere or id(p) not in counted:
            continue
        square = grad.detach().to(dtype).pow(2).sum()
        if id(p) in experts:
            expert += square
        else:
            dense += square
    if sharded:
        comm.all_reduce(dense, mesh.dp_cp)
        comm.all_reduce(expert, mesh.axis("edp"))
    comm.all_reduce(expert, mesh.ep)  # EP ranks hold different experts
    total = dense + expert
    comm.all_reduce(total, mesh.tp)
    comm.all_reduce(total, mesh.pp)
    return total.sqrt()


def clip_grad_norm_(model: nn.Module, mesh: ParallelMesh, max_norm: float,
                    grads: dict[int, torch.Tensor] | None = None, **counting) -> torch.Tensor:
    """Scale gradients so the global norm is at most `max_norm` (0 disables); returns the norm
    before clipping. `counting`: `global_grad_norm`'s keyword arguments."""
    norm = global_grad_norm(model, mesh, grads, **counting)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        tensors = list(grads.values()) if grads is not None else \
            [p.grad for p in model.parameters() if p.grad is not None]
        for grad in tensors:
            grad.mul_(coef)
    return norm
