"""ZeRO-3's parameter gathering: a unit's parameters exist in full only while it computes.

Gathered over the sharding axis before the unit's forward (the next unit prefetched), freed
after it, gathered again when the gradient of its output arrives (the previous unit
prefetched), freed once its gradients are reduced (`release`, called by the reducer).
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.zero_bucket import BACKWARD, FORWARD, FREE, Bucket


class TransientBytes:
    """Bytes of a reducer's buffers that exist only during a step (gathered parameters,
    gradient buckets), and their peak."""

    def __init__(self):
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


def release(b: Bucket, transient: TransientBytes) -> None:
    """Free b's full parameters (its shard stays)."""
    if b.resident:
        b.param_flat.untyped_storage().resize_(0)
        transient.add(-b.padded * b.param_flat.element_size())
        b.resident = False
    b.state = FREE


class ParameterGatherer:
    """Gather unit k's buckets (`units[k]`'s parameters, one bucket per dtype: the model itself,
    whose own parameters are the embedding, final norm and output layer, then each block:
    `ParameterRoles.units`) around its computation, all-gathering over `axis`. `root`: whether
    unit 0 is the model itself (the dense parameters); the experts' units are blocks only."""

    def __init__(self, buckets: list[list[Bucket]], axis: MeshAxis, units: list[nn.Module],
                 transient: TransientBytes, *, root: bool = True):
        assert len(units) == len(buckets)
        self.buckets, self.axis, self.transient = buckets, axis, transient
        self.root = root
        for k, module in enumerate(units):
            module.register_forward_pre_hook(
                lambda _m, _a, k=k: self._before_forward(k))
            module.register_forward_hook(
                lambda _m, _a, out, k=k: self._after_forward(k, out))

    def _start(self, k: int) -> None:
        for b in self.buckets[k]:
            if b.resident or b.gathering is not False:
                continue
            nbytes = b.padded * b.param_flat.element_size()
            b.param_flat.untyped_storage().resize_(nbytes)
            self.transient.add(nbytes)
            # through .data: writing the storage must not bump the version counter that the
            # saved views share (autograd would take them for modified)
            flat = b.param_flat.data
            own = flat[b.lo:b.lo + b.shard_size]
            own.copy_(b.param_shard)  # in place: faster on gloo than gathering from another
            b.gathering = comm.all_gather_into(flat, own, self.axis, async_op=True)

    def _gathered(self, k: int, state: str) -> None:
        self._start(k)
        for b in self.buckets[k]:
            if b.gathering is not False:
                if b.gathering is not None:
                    b.gathering.wait()
                b.gathering, b.resident = False, True
            b.state = state

    def release(self, k: int) -> None:
        for b in self.buckets[k]:
            release(b, self.transient)

    def _before_forward(self, k: int) -> None:
        if any(b.state == BACKWARD for b in self.buckets[k]):  # recomputation inside backward
            return
        self._gathered(k, FORWARD)
        if k + 1 < len(self.buckets):
            self._start(k + 1)

    def _after_forward(self, k: int, out) -> None:
        if any(b.state != FORWARD for b in self.buckets[k]):
            return
        self.release(k)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad, k=k: self._before_backward(k))

    def _before_backward(self, k: int) -> None:
        self._gathered(k, BACKWARD)
        if not self.root:  # blocks only: the one before computes next
            if k > 0:
                self._start(k - 1)
            return
        if k == len(self.buckets) - 1 > 0:
            # the last block's output gradient: the output layer's and final norm's backward
            # are done, and unit 0 is not read again - the embedding's backward is a lookup's,
            # which needs only the ids (a saved view of a freed parameter would fail loudly in
            # backward, never read stale values). Its gradient bucket stays until the
            # embedding's gradient lands; freeing the parameters here takes them off every
            # block's backward (bench_zero: 16.5 MiB, as much as FSDP2's root keeps).
            self.release(0)
        # prefetch the block before, which backward computes next. Not at the head (k = 0):
        # its backward is the step's memory peak (the logits' gradient and the output
        # layer's weight gradient alive), so the last block is gathered only when it starts
        # (bench_zero: 12 MiB off the peak). The first block is followed by the embedding,
        # whose unit stays gathered.
        if k > 1:
            self._start(k - 1)
