"""Measuring memory: bytes autograd saves for backward (activations)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def saved_activation_bytes(fn: Callable[[], object],
                           exclude: Iterable[torch.Tensor] = ()) -> tuple[int, object]:
    """Run `fn()` and count the bytes autograd saves for its backward.

    Each storage counts once (views of one tensor share it); storages of `exclude` (the model's
    parameters, whose transposes autograd also saves) do not count. Returns (bytes, fn's result).
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return sum(storages.values()), result


def layer_activation_formula(*, s: int, b: int, h: int, a: int, tp: int = 1,
                             sequence_parallel: bool = False, recompute: str = "none",
                             element_size: int = 2, mask_size: int = 1,
                             dropout: bool = True) -> float:
    """Bytes one transformer layer saves for backward (Korthikanti et al., seed 002 section 5),
    in a dtype-aware form (docs/design.md): e bytes per activation, mu per dropout-mask element.

    No parallelism: sbh(16e + 2mu) + as^2b(2e + mu). TP: the 4e + 2mu of LayerNorm/dropout/
    residual regions stay whole, the rest is divided by t. SP divides everything by t.
    Selective recompute drops the as^2b term; full recompute keeps only the layer input sbh e.
    Without dropout the masks and the attention dropout's output are not saved: 4e replicated,
    as^2b e.
    """
    e, mu, t = element_size, mask_size if dropout else 0, tp
    if recompute == "full":
        return s * b * h * e / (t if sequence_parallel else 1)
    replicated = s * b * h * (4 * e + 2 * mu)
    split = s * b * h * 12 * e / t
    attention = 0.0 if recompute == "selective" else \
        a * s * s * b * ((2 if dropout else 1) * e + mu) / t
    return (replicated / (t if sequence_parallel else 1)) + split + attention


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def model_state_bytes(*, params: Iterable[torch.Tensor], grads: Iterable[torch.Tensor],
                      optimizer: torch.optim.Optimizer,
                      masters: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer states (fp32 master weights
    count as optimizer state, as in the ZeRO paper), summing the storages actually alive."""
    states = [t for state in optimizer.state.values() for t in state.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"parameters": _storage_bytes(params), "gradients": _storage_bytes(grads),
            "optimizer_states": _storage_bytes([*states, *masters])}


def zero_formula_bytes(num_params: int, *, param_bytes: int, grad_bytes: int, state_bytes: int,
                       dp: int = 1, stage: int = 0) -> float:
    """The ZeRO paper's per-rank model-state bytes: baseline (p+g+K)Psi, stage 1 (p+g+K/N)Psi,
    stage 2 (p+(g+K)/N)Psi, stage 3 (p+g+K)Psi/N."""
    p, g, k, n = param_bytes, grad_bytes, state_bytes, dp
    per_param = {0: p + g + k, 1: p + g + k / n, 2: p + (g + k) / n, 3: (p + g + k) / n}[stage]
    return per_param * num_params
