"""Mixed precision: 16-bit parameters for compute, fp32 master weights for the optimizer, and
dynamic loss scaling for fp16.

The model's parameters (and so its activations and gradients) are bf16 or fp16. Gradients are
accumulated into fp32 buffers by default (the GradientReducer adds each 16-bit gradient into its
fp32 bucket and frees it), the optimizer steps fp32 copies of the parameters, and the model gets
the rounded result. fp16 needs loss scaling: the loss is multiplied by a scale before backward,
gradients are divided by it afterwards, and a step whose gradients overflowed on any rank is
skipped on every rank (the scale halves); after `growth_interval` clean steps it doubles.
A non-finite loss (or, without a loss scale, gradient norm) is a failure instead: the run ends,
or skips up to `max_nonfinite_steps` in a row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
"""The `precision` (and `grad_dtype`) choices and their torch dtypes."""


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums and statistics of `dtype` values run in: fp32, or the dtype itself when
    wider (fp64 runs stay fp64 throughout)."""
    return torch.promote_types(dtype, torch.float32)


class MasterWeights:
    """fp32 copies of 16-bit parameters; `params` are what the optimizer steps."""

    def __init__(self, model_params: list[nn.Parameter]):
        self.model_params = model_params
        self.params = [nn.Parameter(p.detach().float().clone()) for p in model_params]
        self.master_of = {id(p): m for p, m in zip(model_params, self.params, strict=True)}

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for param, master in zip(self.model_params, self.params, strict=True):
            param.copy_(master)


class LossScaler:
    """Dynamic loss scale (fp16); a constant 1 that never skips when disabled."""

    def __init__(self, *, enabled: bool, initial: float = 2.0**16, growth_interval: int = 1000):
        self.enabled = enabled
        self.scale = initial if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def unscale_(self, grads: Iterable[torch.Tensor],
                 agree: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Divide the gradients by the scale; returns 1.0 if an inf/nan is anywhere on any rank,
        else 0.0, on the device. `agree` reduces the flag to its maximum over every rank: all
        must skip the same step."""
        grads = list(grads)
        for grad in grads:
            grad.mul_(1.0 / self.scale)
        finite = torch.stack([grad.isfinite().all() for grad in grads]).all()
        found = (~finite).float()
        agree(found)
        return found

    def decides_first(self, max_nonfinite_steps: int) -> bool:
        """Whether the step's scalars are read before the optimizer step, to skip it: with a
        loss scale, or when non-finite steps may be skipped. Otherwise the read comes after the
        update, so the device queue never drains mid-step (a non-finite step then ends the run
        before anything is saved)."""
        return self.enabled or max_nonfinite_steps > 1

    def settle(self, values: dict[str, float]) -> dict[str, float]:
        """The row's fields of a step whose scalars were read before its update (`values`: the
        loss, the gradient norm and, with a loss scale, the overflow flag, which it removes):
        `skipped`, `loss_scale` (the one the step ran with; then updated) and `nonfinite`. An
        overflowed step's gradient norm becomes NaN: the step did not happen."""
        bad, overflow = nonfinite(values, scaled=self.enabled), values.pop("overflow", 0) > 0
        fields = {"skipped": int(bad or overflow)}
        if overflow:
            values["grad_norm"] = float("nan")
        if self.enabled:
            fields["loss_scale"] = self.scale
            self.update(overflow)
        return fields | ({"nonfinite": 1} if bad else {})

    def update(self, found_overflow: bool) -> None:
        if not self.enabled:
            return
        if found_overflow:
            self.scale /= 2.0
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def nonfinite(values: dict[str, float], *, scaled: bool) -> bool:
    """Whether the step's loss (or, without a loss scale, its gradient norm) is inf or NaN.
    Both are reduced over every rank before the read, so every rank decides alike. An fp16
    gradient overflow is the loss scale's business (skip and rescale), not a failure."""
    finite = math.isfinite(values["loss"])
    if not scaled:
        finite = finite and math.isfinite(values["grad_norm"])
    return not finite
