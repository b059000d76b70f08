"""What tells ZeRO's stages apart, as two choices that compose: how the gradients are kept and
how the parameters are kept.

    stage 1 = (FullGradients,    FullParameters)
    stage 2 = (ShardedGradients, FullParameters)
    stage 3 = (ShardedGradients, ShardedParameters)

`FullGradients` keeps the full gradient bucket, accumulates every micro-batch into it and
reduce-scatters it into its own shard once per step; `ShardedGradients` reduce-scatters each
micro-batch's bucket and keeps only the shard, from the step's first reduction to its update.
`FullParameters` keep the full buckets, bucketed by size and all-gathered after each step;
`ShardedParameters` keep the shard, a bucket per unit gathered around its computation
(`zero_gather.py`). `ZeroDataParallel` (`zero.py`) runs the flow over whichever pair its stage
names (`stage_pieces`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.data_parallel import reverse_buckets
from meshtrain.parallel.runtime.zero_bucket import BACKWARD, Bucket
from meshtrain.parallel.runtime.zero_gather import ParameterGatherer, TransientBytes, release

_IN_FLIGHT_REDUCTIONS = 2  # stage 2/3: buckets whose reduce-scatter may still be running


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FullGradients:
    """Stage 1: the full bucket lives for good; the last micro-batch's backward reduce-scatters
    each complete bucket in place (AVG), its shard being a slice of it."""

    full = True
    every_micro_batch = False

    def __init__(self, axis: MeshAxis, transient: TransientBytes):
        self.axis = axis

    def zero(self, b: Bucket) -> None:
        b.grad_flat.zero_()  # the shard is part of it

    def prepare(self, b: Bucket) -> None:
        """Before a gradient lands in b: the bucket is always there."""

    def launch(self, b: Bucket) -> None:
        b.work = comm.reduce_scatter_into(b.grad_shard, b.grad_flat, self.axis,
                                          op=dist.ReduceOp.AVG, async_op=True)

    def unreduced(self, b: Bucket) -> bool:
        """Whether `wait` must still reduce b (a bucket backward did not complete)."""
        return b.grad_flat is not None and not b.launched

    def settle(self, buckets: list[Bucket]) -> None:
        for b in buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None

    def updated(self, b: Bucket) -> None:
        """After the update read b's shard: it stays (part of the full bucket)."""

    def nbytes(self, b: Bucket) -> int:
        return _nbytes(b.grad_flat)


class ShardedGradients:
    """Stages 2 and 3: every micro-batch's backward reduce-scatters each complete bucket and
    frees it, at most `_IN_FLIGHT_REDUCTIONS` reductions running; the landed slices add up in
    the shard, which exists from the step's first reduction to its update."""

    full = False
    every_micro_batch = True

    def __init__(self, axis: MeshAxis, transient: TransientBytes):
        self.axis, self.transient = axis, transient
        self._in_flight: list[Bucket] = []

    def zero(self, b: Bucket) -> None:
        b.drop_grad_shard()  # the step's first reduction makes it (a skipped step left one)

    def prepare(self, b: Bucket) -> None:
        """A fresh bucket for this micro-batch (the previous one's reduction landed first)."""
        if b.grad_flat is not None:
            return
        if b.reduced is not None:
            self._in_flight.remove(b)
            self._complete(b)
        b.fresh_grad_flat()
        self.transient.add(_nbytes(b.grad_flat))

    def launch(self, b: Bucket) -> None:
        b.fill_unwritten()
        # in place, into the bucket's own shard slice (gloo is markedly faster so than into a
        # separate tensor); the slice is added to the persistent shard when it lands
        b.reduced = b.grad_flat[b.lo:b.lo + b.shard_size]
        b.work = comm.reduce_scatter_into(b.reduced, b.grad_flat, self.axis,
                                          op=dist.ReduceOp.AVG, async_op=True)
        b.grad_flat, b.grad_views = None, {}  # the collective holds it until done
        self._in_flight.append(b)
        while len(self._in_flight) > _IN_FLIGHT_REDUCTIONS:  # the oldest land
            self._complete(self._in_flight.pop(0))

    def _complete(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
        b.take_reduced(b.reduced)
        self.transient.add(-b.padded * b.grad_shard.element_size())
        b.work, b.reduced = None, None

    def unreduced(self, b: Bucket) -> bool:
        return b.grad_flat is not None

    def settle(self, buckets: list[Bucket]) -> None:
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def updated(self, b: Bucket) -> None:
        b.drop_grad_shard()

    def nbytes(self, b: Bucket) -> int:
        return b.shard_size * b.grad_dtype.itemsize


class FullParameters:
    """Stages 1 and 2: full buckets closed by size in reverse order (like the all-reduce
    buckets), each all-gathered from the updated shards after the step."""

    sharded = False

    def __init__(self, transient: TransientBytes):
        self.unit_of: list[int] = []

    def group(self, units: list[list[nn.Parameter]], bucket_bytes: int,
              itemsize: int) -> list[list[nn.Parameter]]:
        return [same for group in reverse_buckets([p for unit in units for p in unit],
                                                  bucket_bytes, itemsize)
                for same in by_dtype(group)]

    def reduced(self, b: Bucket) -> None:
        """After b's reduction started: its parameters stay."""

    def settle(self, buckets: list[Bucket]) -> None:
        """At the end of backward: nothing is gathered beyond the full buckets."""

    def after_step(self, buckets: list[Bucket], axis: MeshAxis) -> None:
        works = [comm.all_gather_into(b.param_flat, b.param_shard, axis, async_op=True)
                 for b in buckets]
        for work in works:
            if work is not None:
                work.wait()

    def nbytes(self, b: Bucket) -> int:
        return _nbytes(b.param_flat)

    def attach(self, buckets, axis, modules, *, root: bool) -> None:
        raise AssertionError("only stage 3 gathers parameters around computation")


class ShardedParameters:
    """Stage 3: a bucket per unit (the embedding, final norm and head together; each block),
    holding only its shard between the unit's computations (`ParameterGatherer`); a unit's
    parameters are freed once its gradients are reduced, or at the end of backward."""

    sharded = True

    def __init__(self, transient: TransientBytes):
        self.transient = transient
        self.unit_of: list[int] = []  # each bucket's unit

    def group(self, units: list[list[nn.Parameter]], bucket_bytes: int,
              itemsize: int) -> list[list[nn.Parameter]]:
        by_unit = [by_dtype(unit) for unit in units if unit]
        self.unit_of = [k for k, unit in enumerate(by_unit) for _ in unit]
        return [same for unit in by_unit for same in unit]

    def reduced(self, b: Bucket) -> None:
        if b.state == BACKWARD:
            release(b, self.transient)

    def settle(self, buckets: list[Bucket]) -> None:
        for b in buckets:  # a unit whose parameters got no gradient is still gathered
            release(b, self.transient)

    def after_step(self, buckets: list[Bucket], axis: MeshAxis) -> None:
        """The updated shard is all that is kept."""

    def nbytes(self, b: Bucket) -> int:
        return _nbytes(b.param_shard)

    def attach(self, buckets: list[Bucket], axis: MeshAxis, modules: list[nn.Module], *,
               root: bool) -> ParameterGatherer:
        by_unit = [[b for b, k in zip(buckets, self.unit_of, strict=True) if k == unit]
                   for unit in range(len(modules))]
        return ParameterGatherer(by_unit, axis, modules, self.transient, root=root)


_STAGES = {1: (FullGradients, FullParameters), 2: (ShardedGradients, FullParameters),
           3: (ShardedGradients, ShardedParameters)}


def stage_pieces(stage: int, axis: MeshAxis, transient: TransientBytes):
    """The (gradients, parameters) pieces of ZeRO `stage` (1, 2 or 3)."""
    gradients, parameters = _STAGES[stage]
    return gradients(axis, transient), parameters(transient)


def by_dtype(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` as groups of one dtype each, in order of first appearance (a flat buffer has
    one dtype; the MoE router stays fp32 in a 16-bit model)."""
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.dtype, []).append(p)
    return list(groups.values())
