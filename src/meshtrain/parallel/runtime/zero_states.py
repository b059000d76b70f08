"""Where ZeRO's optimizer states live: the fp32 master shard of each bucket and its Adam moments.

One interface, `StateStore`, three places: `DeviceStates` (beside the parameters; the master is
the parameter shard itself when parameters are fp32), `HostStates` (separate host copies, the
update runs there; on a CPU-only machine the same memory, and bitwise the same run) and
`FileStates` (in files, `nvme_offload.py`: the update runs bucket by bucket through a window of
host slabs, the next bucket read and the previous written while one steps; AdamW is
elementwise, so stepping bucket by bucket is bitwise the step over all pieces at once).

A reducer asks the store for two things: `resident(k, ...)`, a block inside which bucket k's
master and moments are in memory (for the step, a checkpoint's export or load), and
`step(...)`, the optimizer step over all buckets in the order the place allows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from meshtrain.parallel.runtime.nvme_offload import NvmeStore
from meshtrain.parallel.runtime.optim import ADAMW_MOMENTS
from meshtrain.parallel.runtime.zero_bucket import Bucket

_EVICTED = torch.empty(0)  # what an offloaded master piece or moment points at between uses

Pieces = list[nn.Parameter]  # a bucket's master pieces, the parameters the optimizer steps
StepBucket = Callable[[Bucket], None]


class StateStore:
    """The interface, and what a place in memory does: always resident, one optimizer step
    over every bucket's pieces."""

    on_host = False
    """Whether the master is a separate host copy (the update runs on the host)."""

    def adopt(self, k: int, b: Bucket, pieces: Pieces) -> None:
        """Bucket k was just made (its master holds the initial values)."""

    @contextmanager
    def resident(self, k: int, b: Bucket, pieces: Pieces, optimizer: torch.optim.Optimizer,
                 *, dirty: bool) -> Iterator[None]:
        """Bucket k's master and moments in memory for the block; kept when `dirty`."""
        yield

    def step(self, buckets: list[Bucket], pieces: dict[int, Pieces],
             optimizer: torch.optim.Optimizer, give: StepBucket, take: StepBucket) -> None:
        """`give` each bucket its gradients, step the optimizer, `take` the updated masters."""
        for b in buckets:
            give(b)
        optimizer.step()
        for b in buckets:
            take(b)

    def offloaded(self) -> dict[str, int]:
        """Bytes held outside memory, by kind (none here)."""
        return {}

    def close(self) -> None:
        """Release what the store holds outside the process (nothing here)."""


class DeviceStates(StateStore):
    """Beside the parameters (`offload_optimizer = "none"`)."""


class HostStates(StateStore):
    """Separate fp32 host copies of the masters and moments (`offload_optimizer = "cpu"`)."""

    on_host = True


class FileStates(StateStore):
    """Masters and moments in `files`, in memory only while a bucket steps, is exported or is
    loaded (`offload_optimizer = "nvme"`)."""

    on_host = True

    def __init__(self, directory: Path, shard_sizes: list[int]):
        self.files = NvmeStore(directory, shard_sizes)

    def adopt(self, k: int, b: Bucket, pieces: Pieces) -> None:
        # each bucket's states go to disk as it is made, so they are never all in memory
        self.files.create(k, b.master)
        _evict(b, pieces, None)

    @contextmanager
    def resident(self, k, b, pieces, optimizer, *, dirty):
        states = self.files.load(k)
        _bind(b, pieces, states, optimizer)
        try:
            yield
            _bind(b, pieces, states, optimizer)  # moments AdamW or `load` just made move in
        finally:
            _evict(b, pieces, optimizer)
            self.files.release(k, dirty=dirty)

    def step(self, buckets, pieces, optimizer, give, take) -> None:
        """One bucket at a time (pieces without a gradient are left alone by AdamW), the next
        one read ahead."""
        self.files.prefetch(0)
        for k, b in enumerate(buckets):
            with self.resident(k, b, pieces[id(b)], optimizer, dirty=True):
                if k + 1 < len(buckets):
                    self.files.prefetch(k + 1)
                give(b)
                optimizer.step()
                take(b)

    def offloaded(self) -> dict[str, int]:
        return {"offloaded": self.files.offloaded_bytes}

    def close(self) -> None:
        self.files.close()


def state_store(*, offload: bool, offload_dir: Path | None,
                shard_sizes: list[int]) -> StateStore:
    """The store for the `offload_optimizer` choice: files when a folder is given, else host
    copies when offloaded, else beside the parameters."""
    if offload_dir is not None:
        return FileStates(offload_dir, shard_sizes)
    return HostStates() if offload else DeviceStates()


def _bind(b: Bucket, pieces: Pieces, states: torch.Tensor,
          optimizer: torch.optim.Optimizer) -> None:
    """Point the master, its pieces and their moments at a slab `states` = [master | exp_avg |
    exp_avg_sq], copying in moments held elsewhere (fresh from AdamW or `load`)."""
    n = b.shard_size
    b.master = states[:n]
    for piece, (_, a, m) in zip(pieces, b.pieces, strict=True):
        piece.data = states[a:a + m]
        state = optimizer.state.get(piece)
        for i, name in enumerate(ADAMW_MOMENTS if state else ()):
            view = states[(i + 1) * n + a:(i + 1) * n + a + m]
            if state[name].numel() and state[name].data_ptr() != view.data_ptr():
                view.copy_(state[name])
            state[name] = view


def _evict(b: Bucket, pieces: Pieces, optimizer: torch.optim.Optimizer | None) -> None:
    b.master = _EVICTED
    for piece in pieces:
        piece.data = _EVICTED
        state = optimizer.state.get(piece) if optimizer is not None else None
        for name in ADAMW_MOMENTS if state else ():
            state[name] = _EVICTED
