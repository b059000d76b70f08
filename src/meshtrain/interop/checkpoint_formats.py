"""Every format a model's weights are read from or exported to, in one registry: meshtrain's own
checkpoints, torchtitan's DCP directories and Hugging Face model directories.

The run configuration (an `init_from` model), the command line's checks before ranks start, the
trainer (`start_from`) and the dense API (`load_model`) ask `checkpoint_format(path)` and then the
format, so recognising a directory happens here once; `meshtrain export --format` offers the
formats by name. It sits in interop, above checkpointing,
because two of the three formats are interop's; a new format is its functions plus one entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from meshtrain.checkpointing.checkpoint import (
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
    read_manifest,
    resolve_checkpoint,
)
from meshtrain.checkpointing.model_files import export_safetensors
from meshtrain.interop.hf_io import HFModelDirectory, export_hf, is_hf_directory
from meshtrain.interop.titan_dcp import (
    check_dcp_files,
    dcp_model_config,
    export_dcp,
    is_dcp_directory,
    load_dcp_weights,
)
from meshtrain.mesh import ParallelMesh
from meshtrain.models import TransformerConfig

Place = Callable[[dict[str, torch.Tensor]], None]
"""Receives this rank's value of each parameter (a run placing weights in its own states)."""


@dataclass(frozen=True)
class CheckpointFormat:
    """How one format is recognised, which model it holds, and how its weights are read."""

    name: str
    holds: Callable[[Path], bool]
    model: Callable[[Path, int | None], TransformerConfig]
    """The model it holds; the int is `num_heads`, for a format that does not record it."""
    load: Callable[[Path, nn.Module, ParallelMesh, Place | None], None]
    """This rank's weights of a model built for it: into its parameters, or to `place`."""
    check: Callable[[Path, TransformerConfig, bool], None]
    """Refuse, before ranks start, files that cannot give this model (hashing them when the
    bool is true)."""
    export: Callable[[Path, Path], int]
    """Write a checkpoint's model (any layout) in this format; returns the tensors written."""


def _native_load(path: Path, model: nn.Module, mesh: ParallelMesh, place: Place | None) -> None:
    if place is None:  # a whole model: its RNG streams too, where the layout is the same
        load_checkpoint(resolve_checkpoint(path), model=model, mesh=mesh)
        return
    load_checkpoint(resolve_checkpoint(path), model=model, mesh=mesh, rng=False,
                    load_states=lambda values, *_states, previous=None: place(values))


def _native_check(path: Path, model: TransformerConfig, hashed: bool) -> None:
    read_manifest(resolve_checkpoint(path), model, verify_files=hashed)


def _dcp_load(path: Path, model: nn.Module, mesh: ParallelMesh, place: Place | None) -> None:
    values = load_dcp_weights(path, model, mesh)
    if place is not None:
        return place(values)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(values[name])


def _hf_load(path: Path, model: nn.Module, mesh: ParallelMesh, place: Place | None) -> None:
    if place is not None:
        _hf_refused(path)
    HFModelDirectory(path).load_into(model)


def _hf_refused(path: Path, *_) -> None:
    raise CheckpointError(f"{path} is a Hugging Face model directory: import it first"
                          " (meshtrain import-hf) and start from the run it writes")


NATIVE = CheckpointFormat("meshtrain", holds=lambda path: True,
                          model=lambda path, num_heads: checkpoint_config(path),
                          load=_native_load, check=_native_check, export=export_safetensors)
"""Exported as one consolidated safetensors file under meshtrain's names."""
HUGGING_FACE = CheckpointFormat("hf", holds=is_hf_directory,
                                model=lambda path, num_heads: HFModelDirectory(path).cfg,
                                load=_hf_load, check=_hf_refused, export=export_hf)
DCP = CheckpointFormat("dcp", holds=is_dcp_directory, model=dcp_model_config, load=_dcp_load,
                       check=lambda path, model, hashed: check_dcp_files(path, read=hashed),
                       export=export_dcp)
FORMATS = (NATIVE, HUGGING_FACE, DCP)
"""The `export --format` choices, in this order; meshtrain's own is the default."""


def checkpoint_format(path: str | Path) -> CheckpointFormat:
    """The format of the model directory at `path`: the other format that recognises it, else
    meshtrain's own (a run directory, a checkpoint, or a path whose refusal is
    `resolve_checkpoint`'s)."""
    return next((f for f in FORMATS if f is not NATIVE and f.holds(Path(path))), NATIVE)


def format_named(name: str) -> CheckpointFormat:
    """The format `export --format` names."""
    return next(f for f in FORMATS if f.name == name)


def saved_model(path: str | Path, *, num_heads: int | None = None,
                setting: str | None = None) -> TransformerConfig:
    """The model a directory of any format holds; a file that fails is refused naming the
    `setting` that gave it."""
    try:
        return checkpoint_format(path).model(Path(path), num_heads)
    except CheckpointError as e:
        if setting is None:
            raise
        raise CheckpointError(f"`{setting}` {e}") from None
