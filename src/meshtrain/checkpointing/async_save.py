"""Checkpoints written in the background (`async_save`): the step loop blocks only for a host
copy of this rank's pieces; a writer thread writes and fsyncs the rank file while training
goes on, and the checkpoint is published at the next save or at the end.

Completion is agreed in the main thread, at a step boundary (`settle`), with the same
all-gather every rank's synchronous save uses: the writer thread issues no collective at all,
so it can never interleave with the training process groups' collectives (gloo and NCCL need
every rank to issue them in one order) and needs no group of its own. The cost: `latest` moves
at the next save (or the end) rather than the moment the last rank's file is written; a crash
in between leaves the previous checkpoint as `latest`, and the unpublished directory is removed
as a leftover by the next save.

One write is in flight at a time: a new save first waits for the previous one and publishes
it, so every interval's checkpoint is kept (skipping would silently lose one); the wait costs
time only when a write takes longer than a save interval.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from meshtrain.checkpointing.checkpoint import (
    CheckpointWriteError,
    PendingCheckpoint,
    finish_checkpoint,
    write_rank_file,
)
from meshtrain.checkpointing.verify import CheckpointError, latest_checkpoint
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.communication import comm

MAX_FAILURES = 3  # consecutive failed background saves before the run stops


class AsyncSaver:
    """One rank's background checkpoint writer. `write` is the seam tests replace to inject
    failures (default: `write_rank_file`)."""

    def __init__(self, mesh: ParallelMesh,
                 write: Callable[[PendingCheckpoint], str] = write_rank_file):
        self.mesh, self.write = mesh, write
        self.pending: PendingCheckpoint | None = None
        self.thread: threading.Thread | None = None
        self.outcome: tuple[str | None, str | None] = (None, None)  # (digest, failure)
        self.failures = 0
        self.buffers: dict[str, torch.Tensor] = {}  # host snapshot buffers, reused per save

    def start(self, pending: PendingCheckpoint) -> None:
        """Snapshot `pending`'s tensors and write them in the background; the previous write
        must be settled."""
        assert self.pending is None, "settle() the previous save first"
        pending.tensors = self._snapshot(pending.tensors)
        self.pending, self.outcome = pending, (None, None)
        self.thread = threading.Thread(target=self._run, name="meshtrain-async-save",
                                       daemon=False)
        self.thread.start()

    def _snapshot(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies training cannot change, into host buffers kept from the previous save: a
        fresh allocation's first touch (page faults) costs more than the copy itself."""
        for key, tensor in tensors.items():
            held = self.buffers.get(key)
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                self.buffers[key] = held = torch.empty_like(tensor, device="cpu")
            held.copy_(tensor)
        for key in self.buffers.keys() - tensors.keys():
            del self.buffers[key]
        return dict(self.buffers)

    def _run(self) -> None:
        try:
            self.outcome = (self.write(self.pending), None)
        except Exception as e:  # reported by settle() in the main thread, on every rank
            self.outcome = (None, f"{type(e).__name__}: {' '.join(str(e).split())}")

    def settle(self) -> Path | None:
        """Collective (every rank, main thread): wait for the write in flight and publish it
        when every rank's file is written; returns the published checkpoint, or None when
        nothing was in flight or the save failed (one line on stderr; the previous checkpoint
        stays `latest`). Raises CheckpointWriteError after `MAX_FAILURES` consecutive failures."""
        if self.pending is None:
            return None
        self.thread.join()
        pending, (digest, failure) = self.pending, self.outcome
        self.pending = self.thread = None
        failed = [(rank, f) for rank, f in enumerate(comm.all_gather_objects(
            failure, self.mesh.world)) if f is not None]
        if not failed:
            self.failures = 0
            return finish_checkpoint(pending, digest, self.mesh)
        self.failures += 1
        rank, reason = failed[0]
        where = f"{pending.tmp / f'rank_{rank:05d}.safetensors'} (rank {rank}: {reason})"
        if self.failures >= MAX_FAILURES:
            raise CheckpointWriteError(f"{self.failures} background checkpoint saves in a row"
                                       f" failed, the last writing {where}")
        if self.mesh.rank == 0:
            try:
                previous = latest_checkpoint(pending.root)
            except CheckpointError:
                previous = None
            kept = f"the previous checkpoint {previous.name} is intact" if previous else \
                "no checkpoint of this run is saved yet"
            print(f"meshtrain: warning: background save of {pending.final.name} failed writing"
                  f" {where}; {kept}; retrying at the next save", file=sys.stderr)
        return None

    def wait(self) -> None:
        """Join the writer without publishing (a run ending by an error: peers may be gone, so
        no collective); its unpublished directory is a leftover the next save removes."""
        if self.thread is not None:
            self.thread.join()
