"""Running one optimizer step's micro-batches on this rank, and evaluation.

`LocalExecutor` runs forward and backward of each micro-batch in turn (no pipeline);
`PipelineExecutor` runs this rank's action list of a schedule that flushes (setting up the
split backward of one that has it); `PipeDreamExecutor` runs the segments of one that does not
(PipeDream-2BW), which carry micro-batches across steps and keep two weight versions. Under
context parallelism every executor feeds the model this rank's load-balanced slice of each
sequence, with the true positions of its tokens. Packed documents
(`Packing`) add each token's document for the attention mask, positions restarting at each
document, or targets without the end-of-document token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.contracts import AuxiliaryOutputs, MicroBatch
from meshtrain.data.corpus import to_device
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.context_parallel import context_parallel_positions
from meshtrain.parallel.layers.cp_balance import work_balanced
from meshtrain.parallel.layers.loss import IGNORE_INDEX
from meshtrain.parallel.layers.masks import document_ids, document_positions
from meshtrain.parallel.layers.routing import RoutingStats
from meshtrain.parallel.layers.weight_grads import defer_weight_gradients
from meshtrain.parallel.runtime.pipeline import PipeDream2BW, ScheduleRun, run_schedule
from meshtrain.parallel.schedules.actions import (
    FORWARD,
    RECV_ACTIVATION,
    SEND_ACTIVATION,
    Action,
)
from meshtrain.parallel.schedules.releases import Releases, send_releases
from meshtrain.parallel.schedules.schedule import PipelineSchedule
from meshtrain.parallel.schedules.zero_bubble import estimated_costs
from meshtrain.precision import wide_dtype

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Packing:
    """How documents packed into one sequence are seen (all off: one token stream). `eod_id`
    ends a document; `document_mask` keeps attention within it; `reset_positions` restarts
    the embedded positions at its first token; `eod_mask_loss` puts no loss on predicting it;
    `cp_balance` "work" assigns a masked micro-batch's tokens to the context-parallel ranks by
    its documents' attention work (`layers/cp_balance.py`), "head-tail" keeps the fixed split."""

    eod_id: int | None = None
    document_mask: bool = False
    reset_positions: bool = False
    eod_mask_loss: bool = False
    cp_balance: str = "work"

    def balanced(self, cp: int) -> bool:
        """Whether micro-batches are assigned to `cp` ranks by their documents' work."""
        return cp > 1 and self.document_mask and self.cp_balance == "work"


ONE_STREAM = Packing()
"""No documents: the tokens are one stream (the default)."""


@dataclass
class StepResult:
    loss: torch.Tensor  # mean cross-entropy of this rank's micro-batches (every pipeline stage)
    routing: RoutingStats


class LocalExecutor:
    """Micro-batches one after another; gradients accumulate, the last backward syncs."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, seq_len: int,
                 packing: Packing = ONE_STREAM):
        self.model, self.mesh, self.packing = model, mesh, packing
        self.loss_dtype = wide_dtype(next(model.parameters()).dtype)  # the logged loss's
        self.positions = context_parallel_positions(seq_len, mesh.cp.size, mesh.cp.rank)
        self.device_positions = self.positions.to(mesh.device)

    def local_slices(self, batches: Batches) -> list[MicroBatch]:
        """This context-parallel rank's tokens of each (inputs, targets), on the device."""
        packing, device, cp = self.packing, self.mesh.device, self.mesh.cp
        if not (packing.document_mask or packing.eod_mask_loss):
            moved = to_device([(x[:, self.positions], y[:, self.positions]) for x, y in batches],
                              device)
            return [MicroBatch(x, y, self.device_positions) for x, y in moved]
        documents = [document_ids(x, packing.eod_id) if packing.document_mask else None
                     for x, _ in batches]
        layouts = [work_balanced(d, cp.size) if packing.balanced(cp.size) else None
                   for d in documents]
        mine = [self.positions if layout is None else layout.ranks[cp.rank] for layout in layouts]
        moved = to_device([(x[:, m], y[:, m]) for (x, y), m in zip(batches, mine, strict=True)],
                          device)
        loss_tokens = self._loss_tokens_per_share(batches) if packing.eod_mask_loss else None
        return [self._packed_slice(*parts, loss_tokens)
                for parts in zip(moved, documents, layouts, mine, strict=True)]

    def _packed_slice(self, moved, documents, layout, mine, loss_tokens) -> MicroBatch:
        """One packed micro-batch's share on this rank (its tokens `moved`, at sequence indices
        `mine` of the work-balanced `layout` or head-tail): the positions it embeds, the
        documents, the targets with a loss."""
        packing, device = self.packing, self.mesh.device
        local_x, local_y = moved
        if packing.reset_positions:
            positions = document_positions(documents)[:, mine].to(device)
        else:
            positions = self.device_positions if layout is None else mine.to(device)
        if packing.eod_mask_loss:
            local_y = local_y.masked_fill(local_y == packing.eod_id, IGNORE_INDEX)
        return MicroBatch(local_x, local_y, positions, None if documents is None
                          else documents.to(device), loss_tokens, layout)

    def _loss_tokens_per_share(self, batches: Batches) -> torch.Tensor:
        """The targets with a loss (not end-of-document) in the whole global batch, summed over
        the dp ranks, over its m x dp x cp shares: each micro-batch's loss is its sum over this,
        so averaging over micro-batches, dp and cp ranks gives the batch's per-token mean, the
        same however the batch is split (a mean of micro-batch means would weight a token by
        how many others share its micro-batch)."""
        mesh = self.mesh
        count = torch.tensor([sum(int((y != self.packing.eod_id).sum()) for _, y in batches)],
                             dtype=torch.float64, device=mesh.device)
        comm.all_reduce(count, mesh.dp)
        return (count[0] / (len(batches) * mesh.dp.size * mesh.cp.size)).float()

    def forward_backward(self, step: int, batches: Callable[[int], Batches], sync, *,
                         loss_scale: float, timeline: list | None = None) -> StepResult:
        micro_batches = self.local_slices(batches(step))
        m = len(micro_batches)
        loss_sum = torch.zeros((), dtype=self.loss_dtype, device=self.mesh.device)
        routing = RoutingStats(self.mesh.device)
        for i, batch in enumerate(micro_batches):
            sync.before_backward(i == m - 1)
            aux = AuxiliaryOutputs()
            cross_entropy = self.cross_entropy(batch, aux)
            routing.add(aux.routing)  # before a recomputing backward appends its replays
            ((cross_entropy + aux.loss) / m * loss_scale).backward()
            loss_sum += cross_entropy.detach().to(self.loss_dtype) / m
        return StepResult(loss_sum, routing)

    def cross_entropy(self, batch: MicroBatch, aux: AuxiliaryOutputs | None = None
                      ) -> torch.Tensor:
        """Mean cross-entropy of this rank's tokens (equal counts on every dp x cp rank, so
        averaging over them gives the global mean)."""
        logits = self.model(batch.inputs, batch.positions, aux=aux, documents=batch.documents,
                            layout=batch.layout)
        return self.batch_loss(logits, batch)

    def batch_loss(self, logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
        """The cross-entropy of `batch`'s targets given the model's local logits."""
        return self.model.cross_entropy(logits, batch.targets, loss_tokens=batch.loss_tokens)

    @torch.no_grad()
    def evaluate(self, batches: Batches) -> torch.Tensor:
        total = torch.zeros((), dtype=self.loss_dtype, device=self.mesh.device)
        for batch in self.local_slices(batches):
            total += self.cross_entropy(batch)
        return total / len(batches)

    def optimizer_step(self, apply: Callable[[], None]) -> None:
        apply()

    def saved_state(self) -> dict[str, torch.Tensor] | None:
        """What a checkpoint must keep beyond the weights and optimizer (2BW's older weights)."""
        return None

    def load_state(self, previous: dict[str, torch.Tensor] | None) -> None:
        """Take `saved_state`'s tensors back from a checkpoint."""


class PipelineExecutor(LocalExecutor):
    """This rank's stage of a flush schedule; `count_saved_bytes` measures autograd's saved
    bytes per in-flight chunk, and `last_run` keeps the latest step's peaks."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, seq_len: int,
                 schedule: PipelineSchedule, activation_shape: tuple[int, ...],
                 packing: Packing = ONE_STREAM, chunk_layers: tuple[int, ...] = ()):
        super().__init__(model, mesh, seq_len=seq_len, packing=packing)
        self.schedule, self.activation_shape = schedule, activation_shape
        self.chunk_costs = estimated_costs(chunk_layers, *model.cfg.pipeline_work_shares(
            seq_len)) if schedule.orders_on_costs else None  # every chunk's layers
        self.built: dict[int, tuple[list[Action], Releases]] = {}  # by micro-batch count
        self.count_saved_bytes = False
        self.last_run: ScheduleRun | None = None
        self.weight_grads = defer_weight_gradients(model) if schedule.split_backward else None

    def actions(self, num_micro_batches: int) -> list[Action]:
        """This rank's actions for one flush step (`PipelineSchedule.step_lists`), built once
        per micro-batch count."""
        return self._built(num_micro_batches)[0]

    def _built(self, m: int) -> tuple[list[Action], Releases]:
        """This rank's actions for m micro-batches and where its sends are waited."""
        if m not in self.built:
            lists = self.schedule.step_lists(self.mesh.pp.size, m, v=len(self.model.stage.chunks),
                                             chunk_costs=self.chunk_costs)
            rank = self.mesh.pp.rank
            self.built[m] = (lists[rank], send_releases(lists, self.schedule.placement)[rank])
        return self.built[m]

    def stage(self, routing: RoutingStats | None):
        """The stage function for `run_schedule`: one local chunk's forward and its extra loss;
        routing statistics go to `routing`."""
        def run(x: torch.Tensor, chunk: int, batch: MicroBatch):
            aux = AuxiliaryOutputs()
            out = self.model(x, batch.positions, chunk=chunk, aux=aux, documents=batch.documents,
                            layout=batch.layout)
            if routing is not None:
                routing.add(aux.routing, chunk)
            return out, aux.loss
        return run

    def run(self, actions: list[Action], micro_batches, m: int, sync, *, loss_scale: float,
            routing: RoutingStats, timeline: list | None, **schedule_options) -> StepResult:
        count = list(self.model.parameters()) if self.count_saved_bytes else None
        self.last_run = run_schedule(
            actions, stage=self.stage(routing), loss_fn=self.batch_loss,
            micro_batches=micro_batches, mesh=self.mesh,
            activation_shape=self.activation_shape, dtype=next(self.model.parameters()).dtype,
            num_chunks=len(self.model.stage.chunks), num_micro_batches=m,
            before_backward=lambda i: sync.before_backward(i % m == m - 1),
            loss_scale=loss_scale, count_saved_of=count, timeline=timeline,
            placement=self.schedule.placement, weight_grads=self.weight_grads,
            params=self.model.parameters(), **schedule_options)
        return StepResult(self._summed(self.last_run.losses), routing)

    def _summed(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's per-micro-batch losses (each already / m), summed and shared with
        every stage."""
        total = torch.zeros((), dtype=self.loss_dtype, device=self.mesh.device)
        for loss in losses:
            total += loss.to(self.loss_dtype)
        comm.all_reduce(total, self.mesh.pp)
        return total

    def forward_backward(self, step, batches, sync, *, loss_scale, timeline=None) -> StepResult:
        micro_batches = self.local_slices(batches(step))
        m = len(micro_batches)
        actions, releases = self._built(m)
        return self.run(actions, micro_batches, m, sync, loss_scale=loss_scale,
                        routing=RoutingStats(self.mesh.device), timeline=timeline,
                        releases=releases)

    @torch.no_grad()
    def evaluate(self, batches: Batches) -> torch.Tensor:
        forwards = [a for a in self.actions(len(batches))
                    if a.kind in (FORWARD, RECV_ACTIVATION, SEND_ACTIVATION)]
        run = run_schedule(forwards, stage=self.stage(None), loss_fn=self.batch_loss,
                           micro_batches=self.local_slices(batches), mesh=self.mesh,
                           activation_shape=self.activation_shape,
                           dtype=next(self.model.parameters()).dtype,
                           num_chunks=len(self.model.stage.chunks),
                           placement=self.schedule.placement)
        return self._summed(run.losses)


class PipeDreamExecutor(PipelineExecutor):
    """PipeDream-2BW: each step runs its segment of the whole run's action list; `current` are
    the fp32 weights the optimizer steps (the model holds whichever version in-flight work
    needs). Made at the first step this executor runs, so a resumed run continues the delay
    with the checkpoint's previous version."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, *, seq_len: int,
                 schedule: PipelineSchedule, activation_shape: tuple[int, ...],
                 current: list[torch.Tensor], steps: int, packing: Packing = ONE_STREAM):
        super().__init__(model, mesh, seq_len=seq_len, schedule=schedule,
                         activation_shape=activation_shape, packing=packing)
        self.current, self.steps = current, steps
        self.pipedream: PipeDream2BW | None = None
        self.resumed_previous: list[torch.Tensor] | None = None

    def forward_backward(self, step, batches, sync, *, loss_scale, timeline=None) -> StepResult:
        m = len(batches(step))
        if self.pipedream is None:
            self.pipedream = PipeDream2BW(
                list(self.model.parameters()), self.current, p=self.mesh.pp.size,
                s=self.mesh.pp.rank, m=m, first_step=step, num_steps=self.steps - step,
                previous=self.resumed_previous)
        pipedream = self.pipedream
        # micro-batches are numbered over the run: this step's and the next one's
        read = {t: self.local_slices(batches(t)) for t in pipedream.steps_read(step)}
        local = {(t - pipedream.first_step) * m + j: read[t][j] for t in read for j in range(m)}
        result = self.run(pipedream.segment(step), local, m, sync, loss_scale=loss_scale,
                          routing=RoutingStats(self.mesh.device), timeline=timeline,
                          use_weights_of=pipedream.use_weights_of, carry=pipedream.carry,
                          releases=pipedream.releases(step))
        pipedream.end_segment(step)
        return result

    def evaluate(self, batches: Batches) -> torch.Tensor:
        if self.pipedream is not None:  # evaluate the current weights W(t)
            self.pipedream.load(self.pipedream.version)
        return super().evaluate(batches)

    def optimizer_step(self, apply: Callable[[], None]) -> None:
        self.pipedream.step(apply)  # the model keeps the versions in-flight work needs

    def saved_state(self) -> dict[str, torch.Tensor] | None:
        """W(t - 1), which the next micro-batches use."""
        if self.pipedream is None:
            return None
        return {name: weights for (name, _), weights in
                zip(self.model.named_parameters(), self.pipedream.previous, strict=True)}

    def load_state(self, previous: dict[str, torch.Tensor] | None) -> None:
        if previous is not None:
            self.resumed_previous = [previous[name].to(p.device, torch.float32)
                                     for name, p in self.model.named_parameters()]
