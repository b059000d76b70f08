"""AdamW with the usual decay groups, its learning-rate schedule (linear warmup, then cosine,
linear, constant or warmup-stable-decay), and global-norm clipping that counts every parameter
exactly once across the mesh.

`OptimizerSettings` is every setting of the three, defined once: each field declares its help
text, its choices and its TOML table (`section`), from which the run config takes its flags,
keys and `--help` (`config.run_config`), as it does from `ParallelPlan`'s fields. It validates
itself (`validate`), travels whole from the run config through `parallelize` and the gradient
syncs to `build_adamw`, and computes the schedule (`lr_at`): a new AdamW knob is a field here and
its use in `build_adamw`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshtrain.errors import Code, SettingError, alternatives
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.sharding import primary_parameters
from meshtrain.precision import wide_dtype

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
"""The `lr_schedule` choices after the linear warmup: cosine or linear decay to `min_lr` at the
last step, constant `lr`, or warmup-stable-decay (constant, then linear decay to `min_lr` over
the last `lr_decay_fraction` of the steps after warmup)."""

LR_SCHEDULE_SETTINGS = ("lr", "min_lr", "warmup_steps", "lr_schedule", "lr_decay_fraction")
"""The fields `OptimizerSettings.lr_at` reads: what shapes the learning-rate schedule."""

FP32_MAX = 3.4028234663852886e38
"""The largest finite fp32: AdamW steps fp32 values, where a larger setting is inf."""


def _setting(default: Any, help: str, *, choices: tuple | None = None) -> Any:
    """An optimizer field and what it declares (module docstring); all sit in [train]."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "section": "train"})


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, its learning-rate schedule and gradient clipping; the defaults are a run's
    (GPT-3's and Megatron-LM's usual betas). Clipping is here because it is part of the
    update AdamW takes (Megatron-Core's `OptimizerConfig` holds it too), not of the loop."""

    lr: float = _setting(3e-3, "peak learning rate")
    min_lr: float = _setting(3e-4, "learning rate at the end of the decay")
    warmup_steps: int = _setting(20, "linear warmup steps")
    lr_schedule: str = _setting("cosine", "after warmup: cosine or linear decay to --min-lr,"
                                          " constant, or wsd (warmup-stable-decay: constant,"
                                          " then a linear decay over the last"
                                          " --lr-decay-fraction of the steps)",
                                choices=LR_SCHEDULES)
    lr_decay_fraction: float = _setting(0.2, "wsd: the fraction of the steps after warmup that"
                                             " decay")
    adam_beta1: float = _setting(0.9, "AdamW's first-moment decay")
    adam_beta2: float = _setting(0.95, "AdamW's second-moment decay")
    adam_eps: float = _setting(1e-8, "AdamW's epsilon, added to the second moment's square"
                                     " root")
    weight_decay: float = _setting(0.1, "AdamW weight decay (not applied to biases and"
                                        " LayerNorms)")
    clip_grad: float = _setting(1.0, "clip the global gradient norm to this (0 disables)")

    def validate(self) -> OptimizerSettings:
        """Every value AdamW and the schedule can run, or a `SettingError`; returns self."""
        for name in ("lr", "min_lr", "weight_decay", "clip_grad"):  # finite as fp32 values too
            if not abs(getattr(self, name)) <= FP32_MAX:
                raise SettingError(Code.RANGE, f"`{name}` must be a finite number (an fp32 one,"
                                               f" at most {FP32_MAX:.3g}), got"
                                               f" {getattr(self, name)}")
        if self.lr < 0 or self.min_lr < 0:
            raise SettingError(Code.RANGE, f"`lr` and `min_lr` must be >= 0, got {self.lr} and"
                                           f" {self.min_lr}")
        if self.min_lr > self.lr:
            raise SettingError(Code.MIN_LR_ABOVE_LR, f"`min_lr` ({self.min_lr}) must not exceed"
                                                     f" `lr` ({self.lr})")
        if self.weight_decay < 0 or self.clip_grad < 0:
            raise SettingError(Code.RANGE, "`weight_decay` and `clip_grad` must be >= 0")
        if self.warmup_steps < 0:
            raise SettingError(Code.RANGE, f"`warmup_steps` must be >= 0, got"
                                           f" {self.warmup_steps}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise SettingError(Code.CHOICE, f"`lr_schedule` must be"
                                            f" {alternatives(LR_SCHEDULES)}, got"
                                            f" {self.lr_schedule!r}")
        if not 0.0 < self.lr_decay_fraction <= 1.0:
            raise SettingError(Code.RANGE, f"`lr_decay_fraction` must be in (0, 1], got"
                                           f" {self.lr_decay_fraction}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise SettingError(Code.RANGE, f"`{name}` must be in [0, 1), got"
                                               f" {getattr(self, name)}")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            raise SettingError(Code.RANGE, f"`adam_eps` must be a positive number, got"
                                           f" {self.adam_eps}")
        return self

    def with_arguments(self, **loose: Any) -> OptimizerSettings:
        """These settings with AdamW's values given as loose arguments, as `parallelize` took
        them before this object (`lr`, `weight_decay`, `betas`, `eps`) or by field name, so
        scripts written for that signature keep working."""
        if "betas" in loose:
            loose["adam_beta1"], loose["adam_beta2"] = loose.pop("betas")
        if "eps" in loose:
            loose["adam_eps"] = loose.pop("eps")
        return dataclasses.replace(self, **loose)

    def lr_at(self, step: int, total_steps: int) -> float:
        """Learning rate for optimizer step `step` (0-based): linear warmup to `lr`, then
        `lr_schedule` down to `min_lr` at `total_steps`."""
        lr, warmup_steps = self.lr, self.warmup_steps
        if step < warmup_steps:
            return lr * (step + 1) / warmup_steps
        if self.lr_schedule == "constant":
            return lr
        decay_steps = max(1, total_steps - warmup_steps)
        start = warmup_steps
        if self.lr_schedule == "wsd":
            decay_steps = max(1, round(self.lr_decay_fraction * decay_steps))
            start = total_steps - decay_steps
            if step < start:
                return lr
        progress = min(1.0, (step - start) / decay_steps)
        if self.lr_schedule == "cosine":
            return self.min_lr + 0.5 * (lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))
        return lr - (lr - self.min_lr) * progress


ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")
"""The per-parameter states AdamW keeps besides its step count: what ZeRO shards, offloads and
exports, and what a checkpoint holds under `optim/`."""


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


def build_adamw(params: Iterable[nn.Parameter], optimizer: OptimizerSettings, *,
                no_decay: set[int] | None = None) -> torch.optim.AdamW:
    """`optimizer`'s AdamW over `params`. Decay matrices and embeddings; never biases or
    LayerNorm parameters (all 1-D). ZeRO's flat pieces are 1-D whatever they came from:
    `no_decay` then names them (ids). Every AdamW of a run is built here, so `adamw_kernel`
    picks the implementation in one place."""
    params = [p for p in params if p.requires_grad]
    skip = no_decay if no_decay is not None else {id(p) for p in params if p.dim() < 2}
    decay = [p for p in params if id(p) not in skip]
    no_decay = [p for p in params if id(p) in skip]
    groups = [{"params": decay, "weight_decay": optimizer.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optimizer.lr,
                             betas=(optimizer.adam_beta1, optimizer.adam_beta2),
                             eps=optimizer.adam_eps, **{adamw_kernel(params): True})


def restored_step(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                  step: torch.Tensor) -> torch.Tensor:
    """A checkpoint's step count as `optimizer` keeps it for `param`: the fused kernel reads
    it as fp32 on the parameter's device, `foreach` as a host scalar."""
    step = step.reshape(()).clone()
    return step.to(param.device, torch.float32) if optimizer.defaults.get("fused") else step


@dataclass(frozen=True)
class GradientLayout:
    """Where this rank's gradients are and how the mesh shares them: what a gradient sync
    reports after its reduction (`GradientSync.wait`), and all that clipping needs to count
    each logical parameter once."""

    grads: dict[int, torch.Tensor] | None = None
    """id(parameter) -> its gradient where it does not live in `.grad` (fp32 buffers of 16-bit
    parameters, ZeRO's pieces); None: every gradient is in `.grad`."""
    sharded: bool = False
    """ZeRO: each data-parallel rank holds a different piece of each gradient."""
    counted_elsewhere: frozenset[int] = frozenset()
    """Copies counted on another rank (the last pipeline stage's tied embedding)."""
    experts: frozenset[int] = frozenset()
    """Expert parameters: each EP rank holds different ones."""

    def tensors(self, model: nn.Module) -> list[torch.Tensor]:
        """Every gradient this rank holds."""
        if self.grads is not None:
            return list(self.grads.values())
        return [p.grad for p in model.parameters() if p.grad is not None]


def clip_grad_norm_(model: nn.Module, mesh: ParallelMesh, layout: GradientLayout = GradientLayout(),
                    max_norm: float = 0.0) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, each logical parameter counted once; scales
    the gradients so it is at most `max_norm` (0: only the norm). Returns the norm before
    clipping.

    TP-sharded parameters: every rank's shard counts (summed over TP; a shard several TP ranks
    share counts on the first of them). Replicated parameters (norms, row-parallel biases,
    positions): counted on TP rank 0 only. Pipeline stages hold different layers and are summed
    over PP. DP replicas hold the same averaged gradient, so nothing is summed over DP unless
    the layout is `sharded` (then ZeRO's shard axis for dense parameters - dp x cp unless
    hybrid - and edp for experts); `experts` are
    summed over EP but not over their replicas (edp); at `etp` 1 they are whole on every tp
    rank and their ep group spans tp, so each counts on its rank and is not summed over tp."""
    counted = primary_parameters(model, mesh)
    if mesh.whole_experts:
        counted |= layout.experts
    first = next(model.parameters())
    dtype = wide_dtype(first.dtype)
    dense = torch.zeros((), dtype=dtype, device=first.device)
    expert = torch.zeros((), dtype=dtype, device=first.device)
    for p in model.parameters():
        grad = p.grad if layout.grads is None else layout.grads.get(id(p))
        if grad is None or id(p) in layout.counted_elsewhere or id(p) not in counted:
            continue
        square = grad.detach().to(dtype).pow(2).sum()
        if id(p) in layout.experts:
            expert += square
        else:
            dense += square
    if layout.sharded:
        comm.all_reduce(dense, mesh.axis("zero_shard"))  # (its replicas hold the same)
        comm.all_reduce(expert, mesh.axis("edp"))
    comm.all_reduce(expert, mesh.ep)  # EP ranks hold different experts
    if mesh.whole_experts:  # every rank now holds all experts' sum
        comm.all_reduce(dense, mesh.tp)
        total = dense + expert
    else:
        total = dense + expert
        comm.all_reduce(total, mesh.tp)
    comm.all_reduce(total, mesh.pp)
    norm = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in layout.tensors(model):
            grad.mul_(coef)
    return norm
