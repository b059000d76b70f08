"""FP8 training: the local matmuls of the 1D tensor-parallel linears in float8, through torchao.

`convert_to_float8(model, recipe)` gives the column- and row-parallel linears of attention and
the MLP a `Float8Gemm` as their `gemm`: each of a layer's three local matmuls (output, input
gradient, weight gradient) casts its two operands to float8 with the recipe's dynamic scaling
and multiplies them with torch's scaled matmul, returning the operands' own dtype. Everything
around those matmuls is unchanged: f and g, the sequence-parallel gathers and scatters, the input
gradient's all-reduce overlapping the weight gradient, deferred weight gradients. So are the
parameters: they keep their dtype and names (the optimizer still steps fp32 masters of 16-bit
parameters), so a checkpoint does not say whether it was trained in float8 and loads into a
model that was not converted, and back.

Recipes (torchao's `Float8LinearConfig.from_recipe_name`, in `FP8_RECIPES`):
- tensorwise: one scale per tensor; e4m3 inputs and weights, e5m2 output gradients.
- rowwise: one scale per row of each operand along the dimension the matmul contracts; e4m3
  throughout, scales rounded down to powers of two.

Left in the parameters' dtype, as torchao's filters and torchtitan leave them:
- the vocabulary embedding and the output layer (a lookup, and the logits the loss reads, the
  matmul least tolerant of rounding; torchtitan keeps `output` out of float8);
- MoE routers (plain `nn.Linear`s of a few outputs whose softmax picks experts) and the experts
  (an expert multiplies however many tokens were routed to it, none included, which per-tensor
  scaling and the scaled matmul's shape rules do not take);
- norms and position embeddings (no matmul);
- a layer whose local weight (sharded at tp > 1) has a dimension that is not a multiple of 16:
  the scaled matmul's requirement, and torchao's filter's first rule.

torchao is imported only when a model is converted (`pip install 'meshtrain[fp8]'`). The casting
functions used here are not among torchao's public names, so that extra pins one version.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import torch
from torch import nn

from meshtrain.errors import Code, SettingError, alternatives
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.layers.linear_functions import DenseGemm
from meshtrain.parallel.layers.tensor import (
    ColumnParallelGroup,
    ColumnParallelLinear,
    RowParallelLinear,
)

FP8_RECIPES = ("none", "tensorwise", "rowwise")
"""The `fp8` setting's choices: none keeps every matmul in the parameters' dtype."""

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 tensor cores (Ada; Hopper is 9.0)."""

ALIGNMENT = 16
"""The scaled matmul needs both dimensions of its second operand, and the contracted one of
its first, to be multiples of this."""


def check_fp8_device(device: torch.device, recipe: str) -> None:
    """Refuse `fp8` on a device without FP8 tensor cores (the CPU, CUDA capability < 8.9)."""
    if device.type != "cuda":
        raise SettingError(Code.FP8_DEVICE, (
            f"`fp8` {recipe} needs a GPU with FP8 tensor cores (CUDA capability 8.9 or newer)"
            f" and this run's device is the {device.type.upper()}: drop `fp8`"))
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise SettingError(Code.FP8_DEVICE, (
            f"`fp8` {recipe} needs FP8 tensor cores (CUDA capability 8.9 or newer: Ada,"
            f" Hopper, Blackwell); {torch.cuda.get_device_name(device)} has {major}.{minor}:"
            " drop `fp8`"))
    _require_torchao()  # (before ranks start, where the device can run it)


def _require_torchao() -> None:
    if importlib.util.find_spec("torchao") is None:
        raise SettingError(Code.FP8_PACKAGE, (
            "`fp8` needs the torchao package: pip install 'meshtrain[fp8]', or drop `fp8`"))


@functools.cache
def _torchao():
    """torchao's float8 package and its dynamic cast. Its import logs a warning for each of its
    compiled kernels that cannot load here (none of which float8 training calls) and torch one
    about its enums: they are silenced for the import only."""
    _require_torchao()
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return float8, hp_tensor_to_float8_dynamic


class Float8Gemm(DenseGemm):
    """`DenseGemm`'s three matmuls with float8 operands, scaled as torchao's recipe says: each
    operand is cast on the fly from the saved high-precision tensor (nothing float8 is kept
    between forward and backward), with the roles and scaling axes of torchao's `Float8Linear`.
    `emulate` dequantises and multiplies in fp32 instead of calling the scaled matmul: the same
    rounding, on any device (what tests on a CPU use)."""

    def __init__(self, recipe: str, *, emulate: bool = False):
        if recipe not in FP8_RECIPES[1:]:
            raise SettingError(Code.CHOICE, f"`fp8` must be {alternatives(FP8_RECIPES)}, got"
                                            f" {recipe!r}")
        float8, _ = _torchao()
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        if emulate:
            config = dataclasses.replace(config, emulate=True)
        self.recipe, self.config = recipe, config

        def scaled_mm(gemm) -> float8.ScaledMMConfig:
            return float8.ScaledMMConfig(config.emulate, gemm.use_fast_accum, False,
                                         config.pad_inner_dim)

        self.mm_config = float8.LinearMMConfig(scaled_mm(config.gemm_config_output),
                                               scaled_mm(config.gemm_config_grad_input),
                                               scaled_mm(config.gemm_config_grad_weight))

    def __repr__(self) -> str:
        return f"Float8Gemm({self.recipe!r}, emulate={self.config.emulate})"

    def _cast(self, t: torch.Tensor, role: str, cast, axis: int) -> torch.Tensor:
        """`t` as a float8 tensor of `role` (input, weight, grad_output) scaled as `cast` says:
        per tensor, or (rowwise) per slice along `axis`, the dimension the matmul contracts."""
        float8, to_float8 = _torchao()
        rowwise = cast.scaling_granularity is float8.ScalingGranularity.AXISWISE
        return to_float8(t, cast.target_dtype, self.mm_config,
                         gemm_input_role=float8.GemmInputRole(role),
                         scaling_granularity=cast.scaling_granularity,
                         axiswise_dim=axis if rowwise else None,
                         round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)

    def output(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        c = self.config
        a = self._cast(x.reshape(-1, x.shape[-1]), "input", c.cast_config_input, -1)
        b = self._cast(weight.t(), "weight", c.cast_config_weight, 0)  # [in, out]
        y = torch.mm(a, b).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        c = self.config
        a = self._cast(grad.reshape(-1, grad.shape[-1]), "grad_output",
                       c.cast_config_grad_output, -1)
        b = self._cast(weight.t(), "weight", c.cast_config_weight_for_grad_input, -1).t()
        return torch.mm(a, b).reshape(*grad.shape[:-1], weight.shape[1])

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        a = self._cast(grad, "grad_output", c.cast_config_grad_output_for_grad_weight, 0).t()
        b = self._cast(x, "input", c.cast_config_input_for_grad_weight, 0)
        return torch.mm(a, b)  # [out, tokens] x [tokens, in], contracted over the tokens


def _aligned(weight_shape: tuple[int, int]) -> bool:
    return all(size % ALIGNMENT == 0 for size in weight_shape)


def convert_to_float8(model: nn.Module, recipe: str, *, emulate: bool = False) -> list[str]:
    """Give the column- and row-parallel linears of `model`'s attention and MLPs float8 matmuls
    (`Float8Gemm` of `recipe`), in place; the module docstring says which layers stay as they
    are and why. A column group (Llama's q and kv) is converted whole or not at all, on the
    shape of its joined weight. Returns the names of the layers converted."""
    gemm = Float8Gemm(recipe, emulate=emulate)
    converted: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, MoE):
                continue
            if isinstance(child, ColumnParallelGroup):
                layers = dict(child.named_children())
                weights = [layer.weight for layer in layers.values()]
                if _aligned((sum(w.shape[0] for w in weights), weights[0].shape[1])):
                    for member, layer in layers.items():
                        layer.gemm = gemm
                        converted.append(f"{path}.{member}")
            elif isinstance(child, ColumnParallelLinear | RowParallelLinear):
                if _aligned(child.weight.shape):
                    child.gemm = gemm
                    converted.append(path)
            else:
                visit(child, f"{path}.")

    visit(model, "")
    return converted
