"""ZeRO (seed 002 section 2.4): data parallelism that shards the optimizer states (stage 1), also
the gradients (stage 2), and also the parameters (stage 3) over the data-parallel axis.

Layout. Parameters are packed into flat buckets: under stages 1 and 2 by size (reverse order,
like the all-reduce buckets), under stage 3 one bucket per unit (the embedding, final norm and
head together; each transformer block). A bucket is padded to a multiple of N, the axis size,
and rank r owns its r-th contiguous 1/N - the layout of Megatron's distributed optimizer, so
every collective works on one contiguous buffer. A parameter's part inside a rank's shard is a
*piece*; the optimizer steps pieces of the fp32 master shard, so AdamW's elementwise update
equals the unsharded one.

One optimizer step:
- stage 1: gradients accumulate in the full bucket; during the last micro-batch's backward each
  complete bucket is reduce-scattered in place (AVG);
- stage 2: every micro-batch's backward reduce-scatters each complete bucket into a gradient
  shard and frees the bucket; the shard exists from the step's first reduction to its update;
- stage 3: as stage 2, and a unit's parameters exist in full only while it computes: gathered
  before its forward (the next unit prefetched), freed after it, gathered again when the
  gradient of its output arrives (the previous unit prefetched), freed once its gradients are
  reduced;
- then the master pieces step, each rank copies its updated shard into its parameter shard, and
  stages 1 and 2 all-gather the buckets (stage 3 keeps only the shard).

The pieces, each a concept of its own module: the bucket (`zero_bucket.py`), what tells the
stages apart - how gradients and parameters are kept (`zero_stage.py`) -, where the master
shards and Adam moments live - beside the parameters, on the host or in files - behind one
store interface (`zero_states.py`), stage 3's gathering of parameters around computation
(`zero_gather.py`), and the states in and out of checkpoints (`zero_export.py`). This class
is the flow: gradients into buckets, their reductions, the step.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.data_parallel import check_grad_views
from meshtrain.parallel.runtime.zero_bucket import Bucket, shard_numel
from meshtrain.parallel.runtime.zero_export import export_states, load_states
from meshtrain.parallel.runtime.zero_gather import ParameterGatherer, TransientBytes
from meshtrain.parallel.runtime.zero_stage import stage_pieces
from meshtrain.parallel.runtime.zero_states import state_store

ZERO_STAGES = (0, 1, 2, 3)
"""The `zero` choices: nothing sharded, optimizer states, + gradients, + parameters."""
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
"""The `offload_optimizer` choices."""


class ZeroDataParallel:
    """Shard `units` (lists of parameters, in forward order) over `axis` at ZeRO `stage`.

    The trainer-facing protocol is the GradientReducer's: `zero_grad()`, `sync` before each
    backward (stage 1 communicates on the last micro-batch only; 2 and 3 on every one), `wait()`
    after the last backward, `grad(p)` (this rank's reduced piece of p's gradient, None if it
    owns none); then `step_pieces()` to hand to the optimizer, and `step(optimizer)` to step.
    `offload_dir` (nvme offload): the folder of this reducer's state files.
    `deferred` is a parameter whose local gradient must first be summed over another axis
    (the tied embedding held by two pipeline stages), or (axis None) that gets its gradient in
    two backward passes (`ParameterRoles.reused`): its bucket is reduced in `wait()`.
    Stage 3 also needs `attach(units)` to gather parameters around computation.
    `replicas` (hybrid sharding): the axis of the ranks holding the same shard in other
    groups, over which the step's reduced gradient shards are averaged once, in `wait()`.
    """

    def __init__(self, units: list[list[nn.Parameter]], axis: MeshAxis, *, stage: int,
                 bucket_bytes: int = 25 * 2**20, grad_dtype: torch.dtype = torch.float32,
                 scale: float = 1.0, offload: bool = False, offload_dir: Path | None = None,
                 deferred: tuple[nn.Parameter, MeshAxis | None] | None = None,
                 replicas: MeshAxis | None = None):
        if stage not in (1, 2, 3):
            raise SettingError(Code.CHOICE, f"`zero` must be 0, 1, 2 or 3, got {stage}")
        self.axis, self.scale, self.replicas = axis, scale, replicas
        self.transient = TransientBytes()
        self.gradients, self.parameters = stage_pieces(stage, axis, self.transient)
        self._sync = True
        units = [[p for p in unit if p.requires_grad] for unit in units]
        self.params = [p for unit in units for p in unit]
        self.deferred_axis = deferred[1] if deferred else None
        groups = self._group(units, bucket_bytes, grad_dtype,
                             deferred[0] if deferred else None)
        self.states = state_store(offload=offload, offload_dir=offload_dir,
                                  shard_sizes=[shard_numel(g, axis.size) for g in groups])
        self.buckets = []
        self._pieces = {}
        for g in groups:
            b = Bucket(g, axis, full_gradients=self.gradients.full,
                       sharded_parameters=self.parameters.sharded, grad_dtype=grad_dtype,
                       offload=self.states.on_host)
            self._pieces[id(b)] = [nn.Parameter(b.master[a:a + n]) for _, a, n in b.pieces]
            self.states.adopt(len(self.buckets), b, self._pieces[id(b)])
            self.buckets.append(b)
        self.deferred = next((b for b in self.buckets if deferred and b.params[0] is deferred[0]),
                             None)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.gatherer: ParameterGatherer | None = None  # stage 3, once `attach`ed
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _group(self, units, bucket_bytes, grad_dtype, deferred) -> list[list[nn.Parameter]]:
        """The buckets' parameters as the stage's parameters piece groups them; the deferred
        parameter always has a bucket of its own (after the others)."""
        rest = [[p for p in unit if p is not deferred] for unit in units]
        itemsize = torch.empty((), dtype=grad_dtype).element_size()
        groups = self.parameters.group(rest, bucket_bytes, itemsize)
        return groups + ([[deferred]] if deferred is not None else [])

    @property
    def sync(self) -> bool:
        return self._sync

    @sync.setter
    def sync(self, last_micro_batch: bool) -> None:
        # stage 1 communicates once per step; stages 2 and 3 reduce every micro-batch (so no
        # full gradient outlives its backward). Set before each backward, so it also restarts
        # the count of gradients each bucket waits for.
        self._sync = last_micro_batch or self.gradients.every_micro_batch
        for b in self.buckets:
            b.pending = len(b.params)

    # ------------------------------------------------------------------ gradients
    def grad(self, param: nn.Parameter) -> torch.Tensor | None:
        return self._bucket_of[id(param)].grad_pieces.get(id(param))

    def zero_grad(self) -> None:
        for b in self.buckets:
            self.gradients.zero(b)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        b = self._bucket_of[id(param)]
        self.gradients.prepare(b)
        if not b.as_grads:
            b.add_grad(param)
            param.grad = None
        if not self.sync or b is self.deferred:
            return
        b.pending -= 1
        if b.pending == 0:
            self._reduce(b)

    def _reduce(self, b: Bucket) -> None:
        b.pending = len(b.params)
        b.launched = True
        self.gradients.launch(b)
        self.parameters.reduced(b)

    def wait(self) -> None:
        """Finish the step's reductions (also of buckets backward did not complete)."""
        for b in self.buckets:
            if b.as_grads:
                check_grad_views(b.params, b.grad_flat)
        if self.deferred_axis is not None and self.deferred.grad_flat is not None:
            self.deferred.fill_unwritten()
            comm.all_reduce(self.deferred.grad_flat, self.deferred_axis)
        if self.sync:
            for b in self.buckets:
                if self.gradients.unreduced(b):
                    self._reduce(b)
        self.gradients.settle(self.buckets)
        for b in self.buckets:
            b.launched = False
            b.pending = len(b.params)
        self.parameters.settle(self.buckets)
        for b in self.buckets:
            b.ensure_grad_shard()
            if self.sync and self.replicas is not None:  # hybrid: once per step, the shards
                comm.all_reduce(b.grad_shard, self.replicas, op=dist.ReduceOp.AVG)
        if self.scale != 1.0:
            for b in self.buckets:
                b.grad_shard.mul_(self.scale)

    # ------------------------------------------------------------------ optimizer step
    def step_pieces(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(model parameter, the fp32 master piece the optimizer steps) for this rank."""
        return [(p, piece) for b in self.buckets
                for (p, _, _), piece in zip(b.pieces, self._pieces[id(b)], strict=True)]

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step this rank's master pieces with the (unscaled, clipped) gradient shards, copy
        them into the parameter shards and (stages 1, 2) gather the full parameters; in the
        order the states' store allows (`StateStore.step`)."""
        self.states.step(self.buckets, self._pieces, optimizer, self._give_grads, self._take)
        self.parameters.after_step(self.buckets, self.axis)

    def _give_grads(self, b: Bucket) -> None:
        grad = b.grad_shard if b.grad_in_place else \
            b.grad_shard.to(b.master.device, torch.float32, copy=True)
        for piece, (_, a, n) in zip(self._pieces[id(b)], b.pieces, strict=True):
            piece.grad = grad[a:a + n]

    def _take(self, b: Bucket) -> None:
        for piece in self._pieces[id(b)]:
            piece.grad = None  # frees an fp32 gradient copy
        if b.master is not b.param_shard:
            b.param_shard.copy_(b.master)
        self.gradients.updated(b)

    # ------------------------------------------------------------------ stage 3 gathering
    def attach(self, units: list[nn.Module], *, root: bool = True) -> None:
        """Gather each unit's parameters around its computation (`ParameterGatherer`; `root`:
        unit 0 is the model itself)."""
        self.gatherer = self.parameters.attach(self.buckets, self.axis, units, root=root)

    # ------------------------------------------------------------------ memory and state
    @property
    def transient_bytes(self) -> int:
        return self.transient.now

    @property
    def peak_transient_bytes(self) -> int:
        return self.transient.peak

    def memory(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes of the model states: parameters (full buckets, or the shard at stage 3),
        gradients (full buckets at stage 1, else the shard, which stages 2 and 3 hold only from
        a step's first reduction to its update) and optimizer states (master shard unless it is
        the parameter shard itself, Adam moments; none in memory when offloaded to nvme:
        `offloaded` counts the bytes of its files)."""
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        params = sum(self.parameters.nbytes(b) for b in self.buckets)
        grads = sum(self.gradients.nbytes(b) for b in self.buckets)
        states = sum(nbytes(b.master) for b in self.buckets if b.master is not b.param_shard)
        pieces = [piece for b in self.buckets for piece in self._pieces[id(b)]]
        states += sum(nbytes(t) for piece in pieces
                      for t in optimizer.state.get(piece, {}).values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
        held = {"parameters": params, "gradients": grads, "optimizer_states": states}
        return held | self.states.offloaded()

    def export(self, optimizer: torch.optim.Optimizer, *,
               stepped: bool) -> tuple[dict, dict | None]:
        """Full (this TP rank's) fp32 values and moments by parameter id (`zero_export`)."""
        return export_states(self.buckets, self._pieces, self.states, self.axis, optimizer,
                             stepped=stepped)

    def load(self, optimizer: torch.optim.Optimizer, values: dict[int, torch.Tensor],
             states: dict[int, dict[str, torch.Tensor]] | None,
             step: torch.Tensor | None) -> None:
        """Take this rank's shard of full per-parameter values (and moments)."""
        load_states(self.buckets, self._pieces, self.states, optimizer, values, states, step)

