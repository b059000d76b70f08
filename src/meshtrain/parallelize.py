"""`parallelize`: a model config and a parallel plan in, this rank's share of the run out.

The whole strategy in one order: the tensor-parallel scheme's layer factory (with sequence and
context parallelism and recomputation), the pipeline split, the model family built from them
(experts placed over ep as it is built), float8 matmuls (`fp8`), precision, gradient
synchronisation (replicated or ZeRO, with master weights, the optimizer and the tied-weight
sync), compiled blocks (`compile`), and the executor that runs a step's micro-batches (locally
or through the pipeline schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from meshtrain.contracts import ParameterRoles, StageSpec
from meshtrain.mesh import ParallelMesh
from meshtrain.models import CausalLM, TransformerConfig, family_of
from meshtrain.parallel.layers.fp8 import check_fp8_device, convert_to_float8
from meshtrain.parallel.runtime.compiled import compile_blocks
from meshtrain.parallel.runtime.executor import (
    ONE_STREAM,
    LocalExecutor,
    Packing,
    PipeDreamExecutor,
    PipelineExecutor,
)
from meshtrain.parallel.runtime.optim import OptimizerSettings
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.runtime.sync import GradientSync, ReplicatedSync, ZeroSync
from meshtrain.parallel.schemes.factory import LayerFactory
from meshtrain.parallel.schemes.registry import layer_factory


@dataclass
class ParallelModel:
    """One rank's model, the roles of its parameters, and how it is synchronised and run."""

    model: CausalLM
    roles: ParameterRoles
    factory: LayerFactory
    sync: GradientSync
    executor: LocalExecutor


def parallelize(model_cfg: TransformerConfig, plan: ParallelPlan, mesh: ParallelMesh, *,
                seed: int, seq_len: int, steps: int, optimizer: OptimizerSettings | None = None,
                packing: Packing = ONE_STREAM, offload_dir: Path | None = None,
                **adamw: Any) -> ParallelModel:
    """Build this rank's part of `model_cfg` laid out as `plan` (already validated, degrees
    those of `mesh`). `seq_len` sizes the pipeline's transfers; `steps` is the run's last step
    (PipeDream-2BW lays out the whole run); `optimizer` the AdamW (default: a run's settings);
    `packing` how the executor feeds packed documents; `offload_dir` this rank's folder for
    ZeRO's states under `offload_optimizer` nvme; `adamw`: AdamW's values as loose arguments
    (`lr`, `weight_decay`, `betas`, `eps`: `OptimizerSettings.with_arguments`)."""
    plan.check_trainable()
    optimizer = (optimizer or OptimizerSettings()).with_arguments(**adamw).validate()
    stage = pipeline_stage(model_cfg.num_layers, plan, mesh)
    model = build_model(model_cfg, mesh, plan, seed=seed, stage=stage)
    factory = model.factory
    if plan.fp8 != "none":  # float8 matmuls; parameters (so masters, checkpoints) unchanged
        check_fp8_device(mesh.device, plan.fp8)
        convert_to_float8(model, plan.fp8)
    model.to(plan.dtype)
    roles = model.roles()
    sync = gradient_sync(model, roles, factory, plan, mesh, optimizer=optimizer,
                         offload_dir=offload_dir)
    if plan.compile:
        compile_blocks(model)
    executor = step_executor(model, factory, sync, plan, mesh, seq_len=seq_len, steps=steps,
                             packing=packing)
    return ParallelModel(model, roles, factory, sync, executor)


def build_model(model_cfg: TransformerConfig, mesh: ParallelMesh, plan: ParallelPlan | None = None,
                *, seed: int = 0, stage: StageSpec | None = None) -> CausalLM:
    """`model_cfg`'s family built from the layer factory of `plan`'s tensor-parallel scheme on
    `mesh` (no plan: Megatron 1D, nothing recomputed): what `parallelize` builds its model with,
    and a whole dense model on `ParallelMesh.local()` for references and tools."""
    factory = layer_factory(plan or ParallelPlan(), mesh)
    return family_of(model_cfg).model(model_cfg, factory, seed=seed, stage=stage)


def pipeline_stage(num_layers: int, plan: ParallelPlan, mesh: ParallelMesh) -> StageSpec:
    """This rank's layers: one range per model chunk (global chunks s, s + p, ... under the
    interleaved schedule, s and 2p - 1 - s under zb-v), the embedding before the first global
    chunk and the output layer after the last, on whichever rank holds them."""
    pp = mesh.pp
    if pp.size == 1:  # a one-rank reference ignores the plan's split
        return StageSpec((range(num_layers),))
    chunks, place = plan.stage_layers(num_layers), plan.schedule.placement
    mine = [place(pp.rank, c, pp.size) for c in range(plan.chunks_per_rank)]
    return StageSpec(tuple(chunks[g] for g in mine), has_embedding=mine[0] == 0,
                     has_head=mine[-1] == len(chunks) - 1)


def gradient_sync(model: nn.Module, roles: ParameterRoles, factory: LayerFactory,
                  plan: ParallelPlan, mesh: ParallelMesh, *, optimizer: OptimizerSettings,
                  offload_dir: Path | None = None) -> GradientSync:
    common = dict(partial=factory.partial_gradients(model, exclude=roles.experts),
                  bucket_bytes=int(plan.bucket_mb * 2**20), grad_dtype=plan.gradient_dtype,
                  optimizer=optimizer)
    if plan.zero:
        return ZeroSync(model, roles, mesh, stage=plan.zero,
                        offload=plan.offload_optimizer != "none", offload_dir=offload_dir,
                        **common)
    two_weights = plan.schedule.weight_versions > 1 and mesh.pp.size > 1
    # 16-bit parameters: the optimizer steps fp32 copies; two weight versions (2BW): the model
    # holds the versions in-flight micro-batches need, the optimizer steps separate copies
    return ReplicatedSync(model, roles, mesh, masters=plan.master_weights or two_weights,
                          write_back=not two_weights, **common)


def step_executor(model: CausalLM, factory: LayerFactory, sync: GradientSync,
                  plan: ParallelPlan, mesh: ParallelMesh, *, seq_len: int,
                  steps: int, packing: Packing = ONE_STREAM) -> LocalExecutor:
    if mesh.pp.size == 1:
        return LocalExecutor(model, mesh, seq_len=seq_len, packing=packing)
    shape = factory.hidden_shape(plan.micro_batch, seq_len // mesh.cp.size,
                                 model.cfg.hidden_size)
    if not plan.schedule.flushes:  # steps overlap: segments of the whole run
        return PipeDreamExecutor(model, mesh, seq_len=seq_len, schedule=plan.schedule,
                                 activation_shape=shape, current=sync.masters.params,
                                 steps=steps, packing=packing)
    return PipelineExecutor(model, mesh, seq_len=seq_len, schedule=plan.schedule,
                            activation_shape=shape, packing=packing, chunk_layers=tuple(
                                len(layers) for layers in plan.stage_layers(model.cfg.num_layers)))
