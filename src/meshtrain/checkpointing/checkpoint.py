"""Layout-independent checkpoints: every tensor under its logical (unsharded) name.

A checkpoint is a directory `checkpoints/step_NNNNNNNN/` holding one safetensors file per rank
that owns data, `manifest.json` (for each logical tensor: full shape, dtype and the pieces -
file, key, offset and length along the split dimension - that tile it; a sha256 per file; the
layout and the model shape) and `train_state.json`. Each piece of each tensor is written once:
replicated tensors by TP rank 0, TP slices by their TP rank, all on DP rank 0; padded vocabulary
rows are never written. Loading assembles each logical tensor and re-slices it for the current
layout, so a checkpoint written at one (tp, dp) loads at any other.

Writes are atomic: ranks write into a hidden temporary directory, rank 0 writes the manifest, the
run files and last the record of every file's digest (`checkpoint_verify`), renames the
directory into place, then moves the `latest` pointer. A crash at any point leaves the previous
checkpoint intact and loadable. Loading verifies everything first and executes no pickled code
(safetensors + JSON). `model_files.py` reads and writes whole models in this format from one
process; `checkpoint_retention.py` removes leftovers and old checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from meshtrain.checkpointing.retention import keep_newest, remove_leftovers
from meshtrain.checkpointing.verify import (
    FORMAT,
    METADATA,
    RECORD,
    RECORD_FORMAT,
    CheckpointError,
    read_manifest,
    sha256,
)
from meshtrain.checkpointing.verify import checkpoint_config as checkpoint_config
from meshtrain.checkpointing.verify import latest_checkpoint as latest_checkpoint
from meshtrain.checkpointing.verify import resolve_checkpoint as resolve_checkpoint
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.routing import Router
from meshtrain.parallel.layers.sharding import (
    GridPosition,
    ShardSpec,
    gather_split,
    is_primary,
    parameter_shards,
    shard_pieces,
    shard_tensor,
    splits,
)
from meshtrain.parallel.runtime.optim import ADAMW_MOMENTS


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _owned_pieces(name: str, tensor: torch.Tensor, spec: ShardSpec | None, replica_rank: int,
                  mesh: ParallelMesh | MeshAxis):
    """(key suffix, piece tensor, entry) for what this rank writes of a logical tensor: only
    the first of its data-parallel replicas (`replica_rank` 0) and of its TP copies writes.
    A tensor split along several dimensions (2D/3D schemes) is first gathered along all but
    the first, so that every piece is a slab of one dimension (collectives over those splits'
    grid axes, inside the TP block, whose ranks share `replica_rank`). `mesh`: what the split
    is relative to (`split_homes`)."""
    if replica_rank != 0:
        return
    if len(splits(spec)) > 1:
        first, *others = splits(spec)
        for split in others:
            tensor = gather_split(tensor, split, mesh)
        spec = first
    position = GridPosition.of(mesh)
    if not is_primary(spec, position):
        return
    if spec is None:
        length = tensor.shape[0] if tensor.dim() else 1
        yield name, tensor, {"dim": 0, "offset": 0, "length": length}
        return
    for i, (local, start, length) in enumerate(shard_pieces(spec, position)):
        piece = tensor.narrow(spec.dim, local, length)
        yield f"{name}#{i}", piece, {"dim": spec.dim, "offset": start, "length": length}


def split_homes(model: nn.Module, mesh: ParallelMesh) -> dict[str, ParallelMesh | MeshAxis]:
    """What each parameter's split is relative to: the mesh, or for whole experts (`etp` 1)
    the one-rank `etp` axis, so every tp rank holds, writes and reads its experts whole."""
    experts = model.roles().experts if mesh.whole_experts else set()
    return {name: mesh.axis("etp") if id(p) in experts else mesh
            for name, p in model.named_parameters()}


def routing_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(name, buffer, router weight's name) of each MoE router's balancing state (the choice
    bias, the previous step's global fractions): buffers a resumed run needs, saved under
    `routing/<name>` and replicated like the router's weight, so they load at any layout."""
    return [(f"{prefix}.{name}", buffer, f"{prefix}.weight")
            for prefix, module in model.named_modules() if isinstance(module, Router)
            for name, buffer in module.named_buffers(recurse=False)]


def _load_routing(model: nn.Module, reader: Reader) -> None:
    """The routers' balancing state, where the checkpoint has it; a checkpoint from before
    it (or from a run without it) leaves the zeros a new run starts from."""
    with torch.no_grad():
        for name, buffer, _ in routing_buffers(model):
            if "routing/" + name in reader.manifest["tensors"]:
                buffer.copy_(reader.full("routing/" + name))


def _logical_shape(tensor: torch.Tensor, spec: ShardSpec | None) -> list[int]:
    shape = list(tensor.shape)
    for split in splits(spec):
        shape[split.dim] = split.full_size
    return shape


def save_checkpoint(root: str | Path, step: int, *, model: nn.Module, mesh: ParallelMesh,
                    train_state: dict, config_toml: str, values: dict[str, torch.Tensor],
                    states: dict[str, dict[str, torch.Tensor]] | None = None,
                    optimizer_step: torch.Tensor | None = None,
                    previous: dict[str, torch.Tensor] | None = None, keep_last: int = 0) -> Path:
    """Write the checkpoint of `step` collectively (every rank calls this).

    `values` are this rank's (TP-local) full tensors of every parameter by name - the fp32
    master weights under mixed precision - and `states` their Adam moments (None before the
    first step); ZeRO gathers its shards into these before calling. `previous`: the weight
    version before `values` (PipeDream-2BW's in-flight micro-batches use it). After the publish,
    rank 0 keeps the newest `keep_last` checkpoints (0: all)."""
    pending = prepare_checkpoint(root, step, model=model, mesh=mesh, train_state=train_state,
                                 config_toml=config_toml, values=values, states=states,
                                 optimizer_step=optimizer_step, previous=previous,
                                 keep_last=keep_last)
    digest = []
    _on_every_rank_or_none(lambda: digest.append(write_rank_file(pending)), mesh,
                           "writing " + pending.file.name)
    return finish_checkpoint(pending, digest[0], mesh)


@dataclasses.dataclass
class PendingCheckpoint:
    """A checkpoint whose rank file is not yet written: what `prepare_checkpoint` collected."""
    root: Path
    tmp: Path
    final: Path
    file: Path
    tensors: dict[str, torch.Tensor]
    entries: dict[str, dict]
    manifest: dict
    train_state: dict
    config_toml: str
    keep_last: int


def prepare_checkpoint(root: str | Path, step: int, *, model: nn.Module, mesh: ParallelMesh,
                       train_state: dict, config_toml: str, values: dict[str, torch.Tensor],
                       states: dict[str, dict[str, torch.Tensor]] | None = None,
                       optimizer_step: torch.Tensor | None = None,
                       previous: dict[str, torch.Tensor] | None = None,
                       keep_last: int = 0) -> PendingCheckpoint:
    """The collective first part of a save (`save_checkpoint`'s arguments): the temporary
    directory and this rank's pieces, in host memory (they may share storage with training's
    tensors: a background writer copies them first)."""
    root = Path(root)
    final, tmp = free_step_dir(root, step), root / f".tmp_step_{step:08d}"

    def make_tmp():
        remove_leftovers(root)
        tmp.mkdir(parents=True)

    _on_every_rank_or_none(make_tmp if mesh.rank == 0 else None, mesh, "creating " + str(tmp))
    file_name = f"rank_{mesh.rank:05d}.safetensors"
    names = [n for n, _ in model.named_parameters()]
    sources = [("model/" + n, values[n].detach(), n) for n in names]
    sources += [("previous/" + n, previous[n].detach(), n) for n in names if previous]
    sources += [("routing/" + n, buffer.detach(), weight) for n, buffer, weight
                in routing_buffers(model)]
    for n in names:
        state = (states or {}).get(n, {})
        sources += [(f"optim/{s}/{n}", state[s], n) for s in ADAMW_MOMENTS if s in state]
    tensors, entries = _rank_pieces(sources, model, mesh, file_name)
    if mesh.rank == 0 and optimizer_step is not None:
        tensors["optim/step"] = optimizer_step.detach().reshape(1).float().cpu()
        entries["optim/step"] = {"shape": [1], "dtype": "float32", "pieces": [
            {"file": file_name, "key": "optim/step", "dim": 0, "offset": 0, "length": 1}]}
    for name, state in model.rng.get_states().items():
        tensors[f"rng/{mesh.rank}/{name}"] = state.cpu()
    manifest = {"format": FORMAT, "step": step, "layout": mesh.layout,
                "device": mesh.device.type, "family": model.family,
                "model": dataclasses.asdict(model.cfg)}
    return PendingCheckpoint(root, tmp, final, tmp / file_name, tensors, entries, manifest,
                             train_state, config_toml, keep_last)


def write_rank_file(pending: PendingCheckpoint) -> str:
    """Write and fsync this rank's file of `pending`; its sha256 (no collective: a background
    writer thread may call this)."""
    save_file(pending.tensors, str(pending.file))
    with open(pending.file, "rb") as f:
        os.fsync(f.fileno())
    return sha256(pending.file)


def finish_checkpoint(pending: PendingCheckpoint, digest: str, mesh: ParallelMesh) -> Path:
    """The collective last part of a save, once every rank's file is written with `digest`:
    rank 0 writes the manifest and the record, renames the directory and moves `latest`."""
    gathered = comm.all_gather_objects((pending.file.name, digest, pending.entries), mesh.world)

    def complete():
        manifest = pending.manifest | {
            "files": {f: file_digest for f, file_digest, _ in gathered},
            "tensors": _merge_entries([rank_entries for _, _, rank_entries in gathered])}
        publish(pending.tmp, pending.final, manifest=manifest, train_state=pending.train_state,
                config_toml=pending.config_toml)
        _keep_newest(pending.root, pending.keep_last)

    _on_every_rank_or_none(complete if mesh.rank == 0 else None, mesh,
                           "publishing " + pending.final.name)
    return pending.final


def publish(tmp: Path, final: Path, *, manifest: dict, train_state: dict,
            config_toml: str) -> None:
    """Complete a checkpoint written into `tmp` (its rank files listed in `manifest["files"]`):
    manifest and run files, then the record of every file's digest (all fsynced), the rename
    into place, then the `latest` pointer (write + rename)."""
    texts = dict(zip(METADATA, (json.dumps(manifest | {"record": RECORD}, indent=1),
                                json.dumps(train_state), config_toml), strict=True))
    for name, text in texts.items():
        _fsync_write(tmp / name, text)
    files = manifest["files"] | {name: sha256(tmp / name) for name in texts}
    _fsync_write(tmp / RECORD, json.dumps({"format": RECORD_FORMAT, "files": files}, indent=1))
    tmp.rename(final)
    point_latest_at(final)


def point_latest_at(checkpoint: Path) -> None:
    """Make `latest` name `checkpoint` (write + rename: a reader sees the old or the new)."""
    _fsync_write(checkpoint.parent / ".latest.tmp", checkpoint.name)
    os.replace(checkpoint.parent / ".latest.tmp", checkpoint.parent / "latest")


def _keep_newest(root: Path, keep_last: int) -> None:
    """Retention after a publish; a checkpoint that cannot be deleted is reported, not fatal
    (the new one is complete)."""
    try:
        keep_newest(root, keep_last)
    except (OSError, CheckpointError) as e:
        print(f"meshtrain: warning: could not delete old checkpoints in {root} ({e}); delete"
              " them by hand", file=sys.stderr)


def free_step_dir(root: Path, step: int) -> Path:
    """`step_NNNNNNNN`, or `step_NNNNNNNN.k` when saved again: nothing existing is touched."""
    final, version = step_dir(root, step), 1
    while final.exists():
        final, version = root / f"{step_dir(root, step).name}.{version}", version + 1
    return final


def _rank_pieces(sources, model: nn.Module, mesh: ParallelMesh,
                 file_name: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The pieces this rank writes of each (logical name, local tensor, parameter name), and
    the manifest entries describing them. Experts are replicated over edp, the rest over
    dp x cp; only the first replica writes."""
    shards, homes = parameter_shards(model), split_homes(model, mesh)
    experts = model.roles().experts
    replica = {n: mesh.axis("edp").rank if id(p) in experts else mesh.dp_cp.rank
               for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    for name, tensor, param_name in sources:
        shard = shards[param_name]
        entries.setdefault(name, {"shape": _logical_shape(tensor, shard),
                                  "dtype": str(tensor.dtype).removeprefix("torch."),
                                  "pieces": []})
        for key, piece, where in _owned_pieces(name, tensor, shard, replica[param_name],
                                               homes[param_name]):
            tensors[key] = piece.contiguous().cpu()
            entries[name]["pieces"].append({"file": file_name, "key": key, **where})
    return tensors, entries


def _merge_entries(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Every rank's entries as one: each tensor's pieces from all ranks, each piece once (the
    tied embedding lives on the first and the last pipeline stage)."""
    merged: dict[str, dict] = {}
    for rank_entries in per_rank:
        for name, entry in rank_entries.items():
            pieces = merged.setdefault(name, {**entry, "pieces": []})["pieces"]
            held = {(q["dim"], q["offset"], q["length"]) for q in pieces}
            pieces += [q for q in entry["pieces"]
                       if (q["dim"], q["offset"], q["length"]) not in held]
    return merged


class CheckpointWriteError(CheckpointError):
    """A save that failed writing (a full disk, a revoked permission), agreed by every rank:
    not damaged input but a failed write, which ends a run with exit 1 (`failures.writing`'s
    kind), printed once. The message names where it failed; the caller adds what to do."""


def _on_every_rank_or_none(action, mesh: ParallelMesh, what: str) -> None:
    """Run this rank's part of a save (or nothing) and agree with every rank on the outcome, so
    a failure anywhere (an OSError, or safetensors' own error, e.g. for a full disk) raises the
    same one-line error, the first failed rank's, everywhere instead of stranding peers or
    printing tracebacks."""
    failure = None
    try:
        if action is not None:
            action()
    except (OSError, SafetensorError) as e:
        failure = f"rank {mesh.rank} ({what}: {' '.join(str(e).split())})"
    failures = [f for f in comm.all_gather_objects(failure, mesh.world) if f is not None]
    if failures:
        raise CheckpointWriteError(f"saving the checkpoint failed on {failures[0]}")


class Reader:
    """Assembles logical tensors from a checkpoint's pieces, one at a time: only from a
    manifest `read_manifest` returned (verified files and pieces)."""

    def __init__(self, path: Path, manifest: dict, device: torch.device):
        self.path, self.manifest, self.device = path, manifest, device
        self._files: dict[str, object] = {}

    def _open(self, name: str):
        if name not in self._files:
            self._files[name] = safe_open(str(self.path / name), framework="pt")
        return self._files[name]

    def full(self, name: str) -> torch.Tensor:
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path} has no tensor {name!r}: it is from a"
                                  " different model; use matching model settings")
        out = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
        for piece in entry["pieces"]:  # verified to tile `out` exactly once
            data = self._open(piece["file"]).get_tensor(piece["key"])
            out.narrow(piece["dim"], piece["offset"], piece["length"]).copy_(data)
        return out

    def raw(self, key: str) -> torch.Tensor | None:
        for file_name in self.manifest["files"]:
            f = self._open(file_name)
            if key in f.keys():
                return f.get_tensor(key)
        return None


def load_checkpoint(path: str | Path, *, model: nn.Module, mesh: ParallelMesh,
                    load_states: Callable[..., None] | None = None, rng: bool = True) -> dict:
    """Load a checkpoint of any layout for this rank; returns the saved train state.

    Without `load_states` the values go into the model's parameters (inference). With it, it
    receives ({name: this rank's value}, {name: {moment: tensor}} or None, optimizer step or
    None, and `previous=` {name: value} or None) and places them (master weights, optimizer,
    ZeRO shards, 2BW's previous weight version). RNG streams are restored (`rng`) only when
    the layout and the device type are the same as at save time and the checkpoint has them
    (an imported one has none); a new run started from the weights keeps its own."""
    path = Path(path)
    manifest = read_manifest(path, model.cfg)
    reader = Reader(path, manifest, mesh.device)
    shards, homes = parameter_shards(model), split_homes(model, mesh)

    def local(name: str, param_name: str) -> torch.Tensor:
        full, spec = reader.full(name), shards[param_name]
        return full if spec is None else shard_tensor(full, spec, homes[param_name])

    for name, param in model.named_parameters():  # every shape, before anything is copied
        entry = manifest["tensors"].get("model/" + name)
        expected = _logical_shape(param, shards[name])
        if entry is None or entry["shape"] != expected:
            found = None if entry is None else entry["shape"]
            raise CheckpointError(f"checkpoint {path}: {name} has shape {found} there, {expected}"
                                  " here: it is from a different model; use its model settings")

    names = [name for name, _ in model.named_parameters()]
    values = {name: local("model/" + name, name) for name in names}
    if load_states is None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(values[name])
    else:
        states, step = None, None
        if "optim/step" in manifest["tensors"]:  # else: saved before any step
            step = reader.full("optim/step")
            states = {name: {s: local(f"optim/{s}/{name}", name)
                             for s in ADAMW_MOMENTS} for name in names}
        previous = {name: local("previous/" + name, name) for name in names} \
            if "previous/" + names[0] in manifest["tensors"] else None
        load_states(values, states, step, previous=previous)
    _load_routing(model, reader)
    if rng and manifest["layout"] == mesh.layout and manifest.get("device") == mesh.device.type:
        states = {name: reader.raw(f"rng/{mesh.rank}/{name}") for name in model.rng.get_states()}
        if None not in states.values():
            model.rng.set_states(states)
    return json.loads((path / "train_state.json").read_text())

