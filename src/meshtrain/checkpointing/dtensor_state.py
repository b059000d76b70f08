"""State dicts as DTensors on the run's `torch.distributed` DeviceMesh, for PyTorch's own tools
(`torch.distributed.checkpoint` saves them and loads them into any other layout, meshtrain or not).

Each tensor is keyed by its parameter's name and holds this rank's local data with the placements
that describe it on `mesh.device_mesh` (dims pp, dp..., cp, tp; pp left out, see below):
- a parameter no TP layer splits (norms, biases of row-parallel layers; experts at `etp` 1,
  whole on every tp rank): `Replicate()` everywhere;
- one split along a dimension as one block without replicas (column-parallel weights `Shard(0)`,
  row-parallel weights `Shard(1)`, the vocabulary `Shard(0)`): that `Shard` on the tp dim,
  `Replicate()` on the others. The DTensor has the logical shape: the vocabulary's padding (to a
  multiple of tp) sits at the end of the last ranks' slices, exactly where torch's uneven
  `Shard` leaves those ranks shorter, so it is cut off the local tensor;
- a split no single `Shard` describes, because a rank holds one chunk of each of several fused
  blocks (GPT's fused q/k/v, Llama's fused k/v and gate/up) or shares its chunk with other TP
  ranks (key/value heads fewer than tp): gathered over tp and `Replicate()` (correct, reshardable,
  tp times the memory for those tensors). `placement_notes` lists them.
Optimizer moments take their parameter's placements; under ZeRO they are first gathered whole
over dp (`GradientSync.export`, a collective), so they are `Replicate()` over dp too rather than
pieces of ZeRO's flat buffers, whose offsets do not line up with parameters.
Pipeline stages hold different parameters: each stage's tensors live on its own submesh (every
dim but pp) under their own names, so dcp's files join the stages into one model (a tied
embedding held by the first and last stage is saved once). The grid TP schemes are refused.
`load_dtensor_state_dict` copies such a dict, once `dcp.load` has filled it from any layout,
back into a model's parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor import Shard as DShard

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.layers.sharding import (
    GridPosition,
    Shard,
    ShardSpec,
    shard_pieces,
    shard_tensor,
    tensor_parallel_home,
    unshard_tensor,
)


def _check_layout(mesh: ParallelMesh) -> None:
    if tuple(mesh.tp_grid) != ("tp",):  # a grid: splits name several grid axes
        raise SettingError(Code.DTENSOR_LAYOUT, f"DTensor state dicts with `tp_scheme`"
                           f" {mesh.tp_scheme}: only the 1d scheme's splits map onto one tp dim")
    if tuple(mesh.device_mesh.mesh_dim_names) == ("pp",):
        raise SettingError(Code.DTENSOR_LAYOUT, "a DeviceMesh of pp alone leaves a stage no"
                           " dims to place its tensors on: give it dp and tp dims too")


def _stage_mesh(mesh: ParallelMesh):
    """The DeviceMesh a stage's tensors live on: every dim but pp (stages hold different
    parameters, each saved by its own stage's ranks under its own names)."""
    device_mesh = mesh.device_mesh
    names = tuple(device_mesh.mesh_dim_names)
    if "pp" not in names:
        return device_mesh
    return device_mesh[tuple(n for n in names if n != "pp")]


def _check_held(model: nn.Module, instead: str) -> None:
    """ZeRO-3 frees its parameters' storage between steps: nothing to read or write there."""
    if any(p.untyped_storage().size() == 0 and p.numel() for p in model.parameters()):
        raise SettingError(Code.DTENSOR_LAYOUT, "the parameters are freed between steps"
                           f" (`zero` 3): {instead}")


def _exact(spec: ShardSpec | None) -> bool:
    """Whether one torch `Shard` describes the split (one block, no replicas)."""
    return isinstance(spec, Shard) and spec.num_blocks == 1 and spec.replicas == 1


def _tp_dim(device_mesh) -> int | None:
    names = tuple(device_mesh.mesh_dim_names)
    return names.index("tp") if "tp" in names else None


def _to_dtensor(local: torch.Tensor, spec: ShardSpec | None, home,
                mesh: ParallelMesh) -> DTensor:
    """`local` (this rank's slice, laid out as `spec` says) as a DTensor of the logical tensor."""
    device_mesh = _stage_mesh(mesh)
    placements = [Replicate()] * device_mesh.ndim
    local = local.detach()
    if spec is not None and not _exact(spec):
        local = unshard_tensor(local, spec, home)  # a collective over tp
    elif spec is not None and mesh.tp.size > 1:
        held = sum(length for _, _, length in shard_pieces(spec, GridPosition.of(home)))
        local = local.narrow(spec.dim, 0, held)  # cut the padding off
        placements[_tp_dim(device_mesh)] = DShard(spec.dim)
        shape = list(local.shape)
        shape[spec.dim] = spec.full_size
        return DTensor.from_local(local.contiguous(), device_mesh, placements, run_check=False,
                                  shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())
    return DTensor.from_local(local, device_mesh, placements, run_check=False)


def _parameter_homes(model: nn.Module) -> dict[str, tuple[ShardSpec | None, object]]:
    """Every parameter's name -> (its split, what the split is relative to)."""
    homes = {}
    for module_name, module in model.named_modules():
        shards = getattr(module, "shards", None) or {}
        for name, _ in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{name}" if module_name else name
            spec = shards.get(name)
            home = tensor_parallel_home(module) if spec is not None else None
            if isinstance(home, MeshAxis) and home.name == "etp" and home.size == 1:
                spec = home = None  # a whole expert (etp 1) on a tp > 1 mesh
            homes[full_name] = (spec, home)
    return homes


def placement_notes(model: nn.Module) -> dict[str, str]:
    """Parameters stored gathered and replicated over tp, with the reason (see the module)."""
    notes = {}
    for name, (spec, _) in _parameter_homes(model).items():
        if spec is not None and not _exact(spec):
            reason = (f"{spec.num_blocks} fused blocks" if spec.num_blocks > 1 else
                      f"chunks shared by {spec.replicas} tp ranks")
            notes[name] = f"gathered over tp, Replicate: {reason}"
    return notes


def dtensor_state_dict(model: nn.Module, mesh: ParallelMesh, *,
                       sync=None) -> dict[str, DTensor]:
    """The model's parameters as DTensors on `mesh.device_mesh` with their placements.

    With `sync` (the run's `GradientSync`) the values are those its optimizer steps (fp32
    masters where the model is 16-bit; ZeRO: gathered whole over dp, a collective), which is
    what ZeRO-3 needs: its parameters are freed between steps, so without `sync` they are
    refused. A collective over tp (the gathered tensors) and, the first time a mesh built its
    own groups, over the world (`ParallelMesh.device_mesh`): call it on every rank."""
    _check_layout(mesh)
    homes = _parameter_homes(model)
    if sync is not None:
        values = sync.export()[0]
    else:
        _check_held(model, "pass the run's sync to take its values")
        values = dict(model.named_parameters())
    return {name: _to_dtensor(value, *homes[name], mesh) for name, value in values.items()}


def dtensor_optimizer_state_dict(sync, model: nn.Module, mesh: ParallelMesh) -> dict:
    """The AdamW state of `sync` (a `GradientSync`, replicated or ZeRO) keyed by parameter name:
    `{name: {"exp_avg": DTensor, "exp_avg_sq": DTensor, "step": tensor}}`, each moment with its
    parameter's placements (ZeRO: gathered whole over dp first). Empty before the first step.
    A collective over tp, and over dp under ZeRO: call it on every rank."""
    _check_layout(mesh)
    homes = _parameter_homes(model)
    _, states, step = sync.export()
    out = {}
    for name, state in (states or {}).items():
        entry = {key: _to_dtensor(value, *homes[name], mesh) for key, value in state.items()
                 if key != "step"}
        count = state.get("step", step)
        entry["step"] = torch.as_tensor(count, dtype=torch.float32).detach().cpu().clone()
        out[name] = entry
    return out


@torch.no_grad()
def load_dtensor_state_dict(model: nn.Module, mesh: ParallelMesh,
                            state: dict[str, DTensor]) -> None:
    """Copy `state` (`dtensor_state_dict(model, mesh)`'s dict after `dcp.load` filled it, from a
    checkpoint of any layout) into the model's parameters. The model's own tensors only: a run
    whose optimizer steps separate copies (16-bit models' fp32 masters, ZeRO) resumes from
    meshtrain's checkpoints instead. No communication."""
    _check_layout(mesh)
    _check_held(model, "resume from meshtrain's checkpoints")
    homes = _parameter_homes(model)
    for name, param in model.named_parameters():
        spec, home = homes[name]
        local = state[name].to_local()
        if spec is not None and not _exact(spec):
            param.copy_(shard_tensor(local, spec, home))  # stored whole: take this rank's part
        elif spec is not None:
            param.narrow(spec.dim, 0, local.shape[spec.dim]).copy_(local)  # padding stays
        else:
            param.copy_(local)
