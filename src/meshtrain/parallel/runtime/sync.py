"""Gradient synchronisation: how this rank's gradients become the step's update.

One interface, two implementations: `ReplicatedSync` (every data-parallel rank holds every
parameter; bucketed all-reduce, fp32 master weights under 16-bit precision) and `ZeroSync`
(ZeRO stage 1/2/3 over the data-parallel axes, optionally with the optimizer on the host). Each
reduces gradients (dense parameters over dp x cp, experts over edp), completes them (the tied
embedding's copies on two pipeline stages summed over `embed`, partial gradients summed over the
axes the layer factory names), owns the optimizer and its step, exports and imports its state
for checkpoints by parameter name, and reports the bytes it holds. The trainer never asks which
one it has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from meshtrain.contracts import ParameterRoles
from meshtrain.memory import model_state_bytes
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.data_parallel import GradientReducer
from meshtrain.parallel.runtime.optim import (
    GradientLayout,
    OptimizerSettings,
    build_adamw,
    restored_step,
)
from meshtrain.parallel.runtime.zero import ZeroDataParallel
from meshtrain.precision import MasterWeights

Partial = list[tuple[MeshAxis, list[nn.Parameter]]]


class Reducer(Protocol):
    """What a sync asks of the reducer of one group of parameters over one axis, replicated
    (`GradientReducer`: all-reduce) or sharded (`ZeroDataParallel`: reduce-scatter): `sync`
    set before each backward (True on the step's last micro-batch), `wait()` after the last,
    then `grad(p)`: this rank's reduced gradient of p (a piece of it when sharded, None if it
    holds none)."""

    params: list[nn.Parameter]
    sync: bool

    def zero_grad(self) -> None: ...

    def wait(self) -> None: ...

    def grad(self, param: nn.Parameter) -> torch.Tensor | None: ...


class GradientSync(ABC):
    """Per optimizer step: `zero_grad()`; `before_backward(last)` before each micro-batch's
    backward (True for the step's last); `wait()` -> the `GradientLayout` of this rank's
    gradients by parameter id (its pieces under ZeRO), to unscale and clip in place;
    `step(lr)`."""

    optimizer: torch.optim.Optimizer
    """The AdamW `build_adamw` made from the `OptimizerSettings` the sync was given."""
    reducers: list[Reducer]
    """Dense parameters' reducer, then the experts' (over edp)."""
    sharded: bool
    """Whether data-parallel ranks hold different pieces of each gradient (clipping sums the
    squares over them)."""

    def __init__(self, model: nn.Module, roles: ParameterRoles, mesh: ParallelMesh,
                 partial: Partial):
        self.model, self.mesh, self.partial = model, mesh, partial
        self.names = {id(p): name for name, p in model.named_parameters()}
        # what clipping counts where: fixed for the run, so made once, not every step
        self._counted_elsewhere = frozenset(roles.counted_elsewhere)
        self._experts = frozenset(roles.experts)

    def zero_grad(self) -> None:
        for reducer in self.reducers:
            reducer.zero_grad()

    def before_backward(self, last: bool) -> None:
        for reducer in self.reducers:
            reducer.sync = last  # ZeRO-1 and plain reducers communicate on the last only

    def wait(self) -> GradientLayout:
        """The step's reduced and completed gradients, and how the mesh shares them."""
        return GradientLayout(self._reduced(), sharded=self.sharded,
                              counted_elsewhere=self._counted_elsewhere, experts=self._experts)

    @abstractmethod
    def _reduced(self) -> dict[int, torch.Tensor]:
        """This rank's gradients by parameter id once reduced and completed."""

    @abstractmethod
    def step(self, lr: float) -> None: ...

    @abstractmethod
    def export(self) -> tuple[dict, dict | None, torch.Tensor | None]:
        """({name: fp32 value}, {name: Adam moments} or None, the optimizer's step count or
        None): every parameter this rank holds, whole along the data-parallel axes (a collective
        under ZeRO)."""

    @abstractmethod
    def load(self, values: dict, states: dict | None, step: torch.Tensor | None) -> None:
        """Take this rank's part of `export`'s output (from any layout)."""

    @abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Bytes of the model states: parameters, gradients (ZeRO 2/3: the shard a step holds
        from its first reduction to its update) and optimizer states."""

    def close(self) -> None:
        """Give back what outlives the process's objects (nvme offload's files)."""
        return None

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _complete(self, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Sum partial gradients over their axes (one flat all-reduce per axis)."""
        for axis, params in self.partial:
            parts = [grads[id(p)] for p in params if id(p) in grads]  # ZeRO: this rank's pieces
            if not parts:
                continue
            flat = torch.cat([g.flatten() for g in parts])
            comm.all_reduce(flat, axis)
            for grad, part in zip(parts, flat.split([g.numel() for g in parts]), strict=True):
                grad.copy_(part.view_as(grad))
        return grads


class ReplicatedSync(GradientSync):
    """Plain data parallelism. With `masters` the optimizer steps fp32 copies; `write_back`
    copies them into the model after each step (off when a schedule places weight versions
    itself: PipeDream-2BW)."""

    sharded = False

    def __init__(self, model: nn.Module, roles: ParameterRoles, mesh: ParallelMesh, *,
                 partial: Partial, bucket_bytes: int, grad_dtype: torch.dtype, masters: bool,
                 write_back: bool, optimizer: OptimizerSettings):
        super().__init__(model, roles, mesh, partial)
        # Dense parameters are replicated over dp x cp, experts only over their edp replicas.
        # An expert's gradient already sums the losses of all ep ranks whose tokens it served;
        # averaging over edp and edp / (dp x cp) gives the mean over dp x cp (1/ep at etp = tp).
        params, experts = list(model.parameters()), roles.experts
        self.reducers = [GradientReducer([p for p in params if id(p) not in experts],
                                         mesh.dp_cp, bucket_bytes=bucket_bytes,
                                         grad_dtype=grad_dtype, late=roles.reused)]
        if experts:
            self.reducers.append(GradientReducer(
                [p for p in params if id(p) in experts], mesh.axis("edp"),
                bucket_bytes=bucket_bytes, grad_dtype=grad_dtype, scale=expert_scale(mesh)))
        self.tied = roles.tied
        self.masters = MasterWeights(params) if masters else None
        self.write_back = write_back
        self.optimizer = build_adamw(self.masters.params if self.masters else params, optimizer)

    def grads(self) -> dict[int, torch.Tensor]:
        return {id(p): reducer.grad(p) for reducer in self.reducers for p in reducer.params}

    def _reduced(self) -> dict[int, torch.Tensor]:
        for reducer in self.reducers:
            reducer.wait()
        grads = self.grads()
        for param in self.tied:  # the first and last stage each hold it: keep them equal
            comm.all_reduce(grads[id(param)], self.mesh.axis("embed"))
        return self._complete(grads)

    def step(self, lr: float) -> None:
        self._set_lr(lr)
        if self.masters is None:
            self.optimizer.step()
            return
        grads = self.grads()
        for param in self.masters.model_params:
            self.masters.master_of[id(param)].grad = grads[id(param)].float()
        self.optimizer.step()
        if self.write_back:
            self.masters.copy_to_model()

    def _stepped(self, param: nn.Parameter) -> torch.Tensor:
        """What the optimizer steps for `param`: its master copy or itself."""
        return self.masters.master_of[id(param)] if self.masters else param

    def export(self):
        step = next((s["step"] for s in self.optimizer.state.values() if "step" in s), None)
        values, states = {}, {}
        for param in self.model.parameters():
            name, stepped = self.names[id(param)], self._stepped(param)
            values[name] = stepped
            if stepped in self.optimizer.state:
                states[name] = self.optimizer.state[stepped]
        return values, states or None, step

    @torch.no_grad()
    def load(self, values, states, step) -> None:
        for param in self.model.parameters():
            name, stepped = self.names[id(param)], self._stepped(param)
            param.copy_(values[name])
            if self.masters:
                stepped.copy_(values[name])
            if states is not None:
                self.optimizer.state[stepped] = {
                    "step": restored_step(self.optimizer, stepped, step),
                    **{s: t.to(param.device) for s, t in states[name].items()}}

    def memory_report(self) -> dict[str, int]:
        return model_state_bytes(
            params=list(self.model.parameters()),
            grads=[reducer.grad(p) for reducer in self.reducers for p in reducer.params],
            optimizer=self.optimizer, masters=self.masters.params if self.masters else ())


def expert_scale(mesh: ParallelMesh) -> float:
    """What experts' gradients averaged over edp are multiplied by for the mean over dp x cp:
    an expert's gradient sums the tokens of its ep group, which spans dp x cp / edp data
    ranks' batches (1/ep at etp = tp; tp / ep at etp 1, whose ep group also spans tp ranks
    that dispatch disjoint parts of the same batch)."""
    return mesh.axis("edp").size / mesh.dp_cp.size


class ZeroSync(GradientSync):
    """ZeRO over dp x cp for dense parameters and over edp for experts (see `zero.py`)."""

    sharded = True

    def __init__(self, model: nn.Module, roles: ParameterRoles, mesh: ParallelMesh, *,
                 partial: Partial, stage: int, bucket_bytes: int, grad_dtype: torch.dtype,
                 offload: bool, optimizer: OptimizerSettings, offload_dir: Path | None = None):
        super().__init__(model, roles, mesh, partial)
        experts = roles.experts
        common = dict(stage=stage, bucket_bytes=bucket_bytes, grad_dtype=grad_dtype,
                      offload=offload)
        deferred = (roles.tied[0], mesh.axis("embed")) if roles.tied else \
            (roles.reused[0], None) if roles.reused else None
        # nvme offload: `offload_dir` is this rank's folder, a subfolder per reducer
        folder = (lambda name: offload_dir / name) if offload_dir else (lambda name: None)
        dense = ZeroDataParallel([[q for q in params if id(q) not in experts]
                                  for _, params in roles.units],
                                 mesh.axis("zero_shard"), **common, deferred=deferred,
                                 replicas=mesh.axis("zero_replica"),
                                 offload_dir=folder("dense"))
        if stage == 3:
            dense.attach([module for module, _ in roles.units])
        self.reducers = [dense]
        if experts:
            expert_units = [(module, [q for q in params if id(q) in experts])
                            for module, params in roles.units]
            expert_units = [(module, params) for module, params in expert_units if params]
            reducer = ZeroDataParallel([params for _, params in expert_units],
                                       mesh.axis("edp"), **common, scale=expert_scale(mesh),
                                       offload_dir=folder("experts"))
            if stage == 3:  # each block's experts gathered over edp around the block
                reducer.attach([module for module, _ in expert_units], root=False)
            self.reducers.append(reducer)
        pieces = [pair for reducer in self.reducers for pair in reducer.step_pieces()]
        self.optimizer = build_adamw([piece for _, piece in pieces], optimizer,
                                     no_decay={id(piece) for p, piece in pieces if p.dim() < 2})

    def _reduced(self) -> dict[int, torch.Tensor]:
        for reducer in self.reducers:
            reducer.wait()
        grads = {id(p): reducer.grad(p) for reducer in self.reducers for p in reducer.params}
        return self._complete({key: g for key, g in grads.items() if g is not None})

    def step(self, lr: float) -> None:
        self._set_lr(lr)
        for reducer in self.reducers:  # elementwise: stepping each alone is the same update
            reducer.step(self.optimizer)

    def export(self):
        # a rank that owns no piece has no optimizer state: agree on the step count
        step = next((s["step"] for s in self.optimizer.state.values() if "step" in s), None)
        count = torch.tensor(float(step) if step is not None else 0.0, device=self.mesh.device)
        comm.all_reduce(count, self.mesh.world, op=torch.distributed.ReduceOp.MAX)
        stepped = count.item() > 0
        values, states = {}, {}
        for reducer in self.reducers:
            reducer_values, reducer_states = reducer.export(self.optimizer, stepped=stepped)
            values |= reducer_values
            states |= reducer_states or {}
        return ({self.names[i]: v for i, v in values.items()},
                {self.names[i]: s for i, s in states.items()} if stepped else None,
                count.cpu() if stepped else None)

    def load(self, values, states, step) -> None:
        ids = {name: i for i, name in self.names.items()}
        by_id = {ids[n]: v for n, v in values.items() if n in ids}
        states_by_id = {ids[n]: s for n, s in states.items() if n in ids} if states else None
        for reducer in self.reducers:
            reducer.load(self.optimizer, by_id, states_by_id, step)

    def memory_report(self) -> dict[str, int]:
        held = {"parameters": 0, "gradients": 0, "optimizer_states": 0}
        for reducer in self.reducers:
            for key, nbytes in reducer.memory(self.optimizer).items():
                held[key] = held.get(key, 0) + nbytes
        return held | {"peak_transient": sum(r.peak_transient_bytes for r in self.reducers)}

    def close(self) -> None:
        for reducer in self.reducers:
            reducer.states.close()
