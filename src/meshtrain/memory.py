"""Measuring memory: bytes autograd saves for backward (activations), the model states a rank
holds, and the peak of everything live over a region (`measure_peak`)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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


HELD, ALLOCATED = "held", "allocated"
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


@dataclasses.dataclass
class PeakMemory:
    """What `measure_peak` found: filled in when its region ends."""

    peak: int = 0
    """Bytes live at the region's high-water mark (CUDA: `max_memory_allocated`)."""
    at_peak: dict[str, int] = dataclasses.field(default_factory=dict)
    """The peak by kind: each `baseline` group, `held` (other storages live at the start) and
    `allocated` (storages the region made or first showed)."""
    slack: int = 0
    """CUDA: bytes the caching allocator reserved beyond the peak (fragmentation); 0 on CPU."""


class _LiveStorages(TorchDispatchMode):
    """What is live at the start: the `baseline` groups, then every other tensor the garbage
    collector finds (`held`). Then every op's tensors: a storage not seen before is the region's
    allocation (so is a buffer a communication backend made outside Python and hands over, as
    gloo's reduce-scatter does with its copy of a bucket). Each storage counts once (views share
    it), at its current size (ZeRO-3 resizes its gathered buffers in place), while a weak
    reference to the C++ storage says it is alive."""

    def __init__(self, baseline: dict[str, Iterable[torch.Tensor]]):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, str, int]] = {}
        self.result = PeakMemory()
        for kind, tensors in baseline.items():
            for tensor in tensors:
                self._track(tensor, kind)
        for found in gc.get_objects():  # every other plain tensor Python holds
            if type(found) in PLAIN_TENSORS:  # not subclasses: a compile's fake tensors have
                self._track(found, HELD)      # no data, a DTensor's local shard is found alone
        self._measure()

    def _track(self, tensor: torch.Tensor, kind: str) -> int:
        """Track `tensor`'s storage if new; returns its bytes when it was new, else 0."""
        storage = _storage(tensor)
        if storage is None:
            return 0
        entry = self.live.get(storage._cdata)
        if entry is not None and not entry[0].expired():
            return 0
        self.live[storage._cdata] = (StorageWeakRef(storage), kind, storage.nbytes())
        return storage.nbytes()

    def _measure(self) -> None:
        """Sum what is live now; keep it if it is the high-water mark."""
        now: dict[str, int] = {}
        for key, (ref, kind, _) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                continue
            nbytes = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
            self.live[key] = (ref, kind, nbytes)
            now[kind] = now.get(kind, 0) + nbytes
        if sum(now.values()) >= self.result.peak:
            self.result.peak, self.result.at_peak = sum(now.values()), now

    def _resized(self, tensors: list[torch.Tensor]) -> bool:
        for tensor in tensors:
            storage = _storage(tensor)
            entry = self.live.get(storage._cdata) if storage is not None else None
            if entry is not None and entry[2] != storage.nbytes():
                return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        new = sum(self._track(t, ALLOCATED) for t in inputs + outputs)
        if new or self._resized(inputs + outputs):
            self._measure()
        return out


@contextlib.contextmanager
def measure_peak(device: torch.device | None = None,
                 baseline: dict[str, Iterable[torch.Tensor]] | None = None
                 ) -> Iterator[PeakMemory]:
    """The high-water mark of bytes in tensors over the `with` block, filled into the yielded
    `PeakMemory` at its end. CPU: the live tensor storages (`_LiveStorages`; `baseline` names
    groups of tensors live at the start so the peak shows their share, e.g. parameters); it
    slows every op, so measure a step, not a run. CUDA: the allocator's own peak, reset at the
    start, and the reserved memory beyond it."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = PeakMemory()
        yield result
        torch.cuda.synchronize(device)
        result.peak = torch.cuda.max_memory_allocated(device)
        result.at_peak = {HELD: start, ALLOCATED: result.peak - start}
        result.slack = torch.cuda.max_memory_reserved(device) - result.peak
        return
    mode = _LiveStorages(baseline or {})
    with mode:
        yield mode.result
    mode._measure()


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The CPU storage behind `tensor`, if it has one (not a GPU's, a meta or sparse tensor's)."""
    if tensor.device.type != "cpu":
        return None
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse, wrapper subclasses
        return None
    return storage if storage.device.type == "cpu" else None  # a fake tensor's is on meta
