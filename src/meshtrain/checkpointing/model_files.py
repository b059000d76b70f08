"""A checkpoint's model as whole tensors, from one process and one tensor at a time: streamed
out (the consolidated export, the source of a Hugging Face export) and streamed in (a model-only
checkpoint, what an import writes). The peak is one logical tensor, never the model twice.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from meshtrain.checkpointing.checkpoint import (
    FORMAT,
    CheckpointWriteError,
    Reader,
    free_step_dir,
    publish,
    read_manifest,
    step_dir,
)
from meshtrain.checkpointing.retention import remove_leftovers
from meshtrain.checkpointing.safetensors_stream import Planned, write_safetensors
from meshtrain.checkpointing.verify import KEPT
from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh
from meshtrain.models import TransformerConfig

ROUTING = "routing/"
"""The prefix of the MoE routers' balancing state (`checkpoint.routing_buffers`): a model-only
checkpoint keeps such names as they are, every other name under "model/"."""


def _stored(name: str) -> str:
    return name if name.startswith((ROUTING, KEPT)) else "model/" + name


def model_entries(manifest: dict, *, routing: bool = False) -> list[Planned]:
    """(name, dtype, shape) of each model tensor of a checkpoint, in manifest order; with
    `routing`, the routers' state and the tensors an import kept (`verify.KEPT`) too, under
    their prefixed names (what a Hugging Face export writes back)."""
    return [(name.removeprefix("model/"), getattr(torch, entry["dtype"]), tuple(entry["shape"]))
            for name, entry in manifest["tensors"].items()
            if name.startswith("model/") or (routing and name.startswith((ROUTING, KEPT)))]


def model_tensors(path: str | Path, manifest: dict, *,
                  routing: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of each model tensor of a verified checkpoint, assembled one at a
    time in `model_entries` order."""
    reader = Reader(Path(path), manifest, torch.device("cpu"))
    for name, _, _ in model_entries(manifest, routing=routing):
        yield name, reader.full(_stored(name))


FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}  # a write that began, then failed


def unwritable(out: Path, error: OSError) -> SettingError | CheckpointWriteError:
    """The one-line error of an export whose output cannot be written: a location that takes
    no files is bad input (exit 2), a write that ran out of space a failed write (exit 1, as
    a run's), whose partial output is removed."""
    if error.errno in FULL:
        return CheckpointWriteError(f"writing {out} failed ({error.strerror or error}): nothing"
                                    " of it was kept; free space, then run the command again")
    return SettingError(Code.OUT_PATH,
                        f"`out` {out}: cannot write there ({error}); choose a writable location")


def export_safetensors(checkpoint: str | Path, out_file: str | Path) -> int:
    """Write the model of a checkpoint of any layout as one consolidated safetensors file.

    Runs in one process with no process group. The checkpoint is verified before anything is
    written; the file appears whole or not at all. Returns the number of tensors written.
    """
    checkpoint, out_file = Path(checkpoint), Path(out_file)
    if out_file.is_dir():
        raise SettingError(Code.OUT_PATH,
                           f"`out` {out_file} is a directory: name the .safetensors file to write")
    manifest = read_manifest(checkpoint)
    planned = model_entries(manifest)
    metadata = {"format": "meshtrain-model", "step": str(manifest["step"]),
                "family": manifest["family"], "model": json.dumps(manifest["model"])}
    try:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(out_file, planned, model_tensors(checkpoint, manifest),
                          metadata=metadata)
    except OSError as e:
        raise unwritable(out_file, e) from None
    return len(planned)


def write_model_checkpoint(root: str | Path, *, family: str, cfg: TransformerConfig,
                           planned: list[Planned], tensors: Iterable[tuple[str, torch.Tensor]],
                           config_toml: str) -> Path:
    """Write a step-0 checkpoint of model weights alone into `root` (a run's checkpoints/):
    (name, tensor) pairs in the order of `planned`, each written as it arrives into the file
    one rank would have written, then published as `save_checkpoint` publishes. It holds no
    optimizer state (a run started from it has a fresh one) and no RNG streams (runs keep their
    own), and loads at any layout."""
    root = Path(root)
    final, tmp = free_step_dir(root, 0), root / f".tmp_{step_dir(root, 0).name}"
    file_name = "rank_00000.safetensors"
    entries = {_stored(name): {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                               "pieces": [{"file": file_name, "key": _stored(name), "dim": 0,
                                           "offset": 0, "length": shape[0] if shape else 1}]}
               for name, dtype, shape in planned}
    try:
        remove_leftovers(root)
        tmp.mkdir(parents=True)
        digest = write_safetensors(tmp / file_name,
                                   [(_stored(n), dtype, shape) for n, dtype, shape in planned],
                                   ((_stored(name), tensor) for name, tensor in tensors))
        manifest = {"format": FORMAT, "step": 0, "layout": ParallelMesh.local().degrees,
                    "device": "cpu", "family": family, "model": dataclasses.asdict(cfg),
                    "files": {file_name: digest}, "tensors": entries}
        publish(tmp, final, manifest=manifest, train_state={"step": 0}, config_toml=config_toml)
    except OSError as e:
        raise CheckpointWriteError(f"writing the checkpoint into {root} failed"
                                   f" ({e.strerror or e}): nothing of it was kept; free space or"
                                   " fix the permissions, then run the command again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone after a publish)
    return final
