"""Nothing of a checkpoint is used before all of it is checked: every file against the committed
record of digests, every name in its metadata, and every piece against its tensor and its file.

`digests.json`, written last before the checkpoint directory is renamed into place, holds the
sha256 of every other file of the checkpoint (manifest.json, train_state.json, config.toml and
each rank file); the manifest names it under `record`. A checkpoint written before the record
existed (no `record`, no digests.json) is checked as it always was: its rank files against the
manifest's digests. Files the record does not list are never read as checkpoint data.

Names in metadata must be plain file names inside the checkpoint directory (no `..`, no path,
no link that leaves it), and `latest` may only name a `step_*` directory beside it. Each tensor's
pieces must tile it exactly once along their dimension, and each piece must be in its file with
the manifest's dtype and the shape the tiling gives it. Every failure is one `CheckpointError`
line naming the checkpoint, the file and the problem.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from pathlib import Path

from safetensors import SafetensorError, safe_open

from meshtrain.checkpointing.safetensors_stream import CODES, DTYPES
from meshtrain.models import TransformerConfig, config_from_dict, family_of, get_family
from meshtrain.parallel.layers.rng import STATE_BYTES

FORMAT = "meshtrain-checkpoint-1"
RECORD = "digests.json"
RECORD_FORMAT = "meshtrain-digests-1"
METADATA = ("manifest.json", "train_state.json", "config.toml")
STEP_NAME = re.compile(r"step_(\d{8})(?:\.(\d+))?")
RANK_FILE = re.compile(r"rank_(\d{5})\.safetensors")
DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in CODES}
_SETTING_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
                  "tuple[int, ...]": (list,)}  # (JSON's list; its items checked as it is built)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, truncated or of another model."""


def _damaged(path: Path, file: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {file}: {problem}; the checkpoint is damaged or"
                           " was edited: restore it or use an earlier one")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_plain_name(name: object) -> bool:
    """A file name with no directory part: not empty, `.`, `..`, absolute or containing a
    separator (or a NUL byte)."""
    return isinstance(name, str) and name not in ("", ".", "..") and \
        not any(c in name for c in "/\\\0")


def _check_names(path: Path, listing: str, names) -> None:
    for name in names:
        if not is_plain_name(name):
            raise _damaged(path, listing, f"names {str(name)[:80]!r}, which is not a plain file"
                                          " name inside the checkpoint directory")


def _check_inside(path: Path, name: str) -> None:
    file = path / name
    if file.is_symlink() and file.resolve().parent != path.resolve():
        raise _damaged(path, name, "is a link leaving the checkpoint directory")


def _present(path: Path, name: str) -> bool:
    return (path / name).exists() or (path / name).is_symlink()


def _check_file(path: Path, name: str, digest: str, against: str) -> None:
    """`path/name` is a regular file inside `path` whose sha256 is `digest`."""
    _check_inside(path, name)
    if not (path / name).is_file():
        raise _damaged(path, name, f"missing (listed in {against})")
    try:
        actual = sha256(path / name)
    except OSError as e:
        raise _damaged(path, name, f"unreadable ({e})") from None
    if actual != digest:
        raise _damaged(path, name, f"corrupt or truncated (checksum mismatch with {against})")


def _read_json(path: Path, name: str) -> object:
    try:
        return json.loads((path / name).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise _damaged(path, name, f"unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise _damaged(path, name, f"not valid JSON ({e})") from None
    except RecursionError:
        raise _damaged(path, name, "not valid JSON (nested too deeply)") from None


def _digests(path: Path, value: object, listing: str) -> dict[str, str]:
    """A {file name: sha256} mapping from `listing`, its names checked."""
    if not isinstance(value, dict) or not all(isinstance(d, str) for d in value.values()):
        raise _damaged(path, listing, "its file list is not {name: sha256}")
    _check_names(path, listing, value)
    return value


def _read_record(path: Path) -> dict[str, str]:
    """digests.json, checked to cover the metadata files."""
    _check_inside(path, RECORD)
    record = _read_json(path, RECORD)
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise _damaged(path, RECORD, f"not a {RECORD_FORMAT} record")
    digests = _digests(path, record.get("files"), RECORD)
    for name in METADATA:
        if name not in digests:
            raise _damaged(path, RECORD, f"does not cover {name}")
    return digests


def read_manifest(path: str | Path, cfg: TransformerConfig | None = None, *,
                  verify_files: bool = True) -> dict:
    """Verify a checkpoint and return its manifest: the committed record and every file it
    covers, the names, the pieces and the files' tensor headers; with `cfg`, also the model
    family and shape. `verify_files` False checks the metadata alone (the rank files are neither
    hashed nor opened), to learn the model a checkpoint holds."""
    path = Path(path)
    _check_inside(path, "manifest.json")
    record = _read_record(path) if _present(path, RECORD) else None
    for name in METADATA if record else ():
        _check_file(path, name, record[name], RECORD)
    manifest = _read_json(path, "manifest.json")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointError(f"checkpoint {path} has format {found!r}, expected {FORMAT!r}")
    if record is None and manifest.get("record") is not None:
        raise _damaged(path, RECORD, "missing (manifest.json names it)")
    files = _digests(path, manifest.get("files"), "manifest.json")
    for name, digest in files.items():
        if record is not None and record.get(name) != digest:
            raise _damaged(path, "manifest.json", f"its digest of {name} is not the one {RECORD}"
                                                  " committed")
    _check_tensors(path, manifest)
    named = STEP_NAME.fullmatch(path.name)
    if named and int(named.group(1)) != manifest["step"]:
        raise _damaged(path, "manifest.json", f"records step {manifest['step']}, but the"
                                              f" directory is named {path.name}")
    if verify_files:
        for name, digest in (record or files).items():
            if name not in METADATA:
                _check_file(path, name, digest, RECORD if record else "manifest.json")
        _check_headers(path, manifest)
    _check_train_state(path, manifest["step"])
    _check_config_toml(path)
    manifest.setdefault("family", "gpt")  # checkpoints written before families were recorded
    _model_config(path, manifest)
    if cfg is not None:
        _check_model(path, manifest, cfg)
    return manifest


def _model_config(path: Path, manifest: dict) -> TransformerConfig:
    """The manifest's model settings as a config: known fields, each of its declared type, a
    shape that can be built, and as many parameters as its model tensors hold (so nothing
    builds a model larger than the checkpoint's files)."""
    def unloadable(problem: object) -> CheckpointError:
        return _damaged(path, "manifest.json", f"its model settings do not load ({problem})")

    try:
        fields = manifest["model"]
        for f in dataclasses.fields(get_family(manifest["family"]).config):
            value, kinds = fields.get(f.name, f.default), str(f.type).split(" | ")
            if not (value is None and "None" in kinds) and \
                    not any(type(value) in _SETTING_TYPES.get(kind, ()) for kind in kinds):
                raise unloadable(f"{f.name} is {value!r}, not {f.type}")
        layers = {name.split(".")[1] for name in manifest["tensors"]
                  if name.startswith("model/layers.")}
        if fields["num_layers"] != len(layers):  # (before anything counts over the layers)
            raise unloadable(f"num_layers {fields['num_layers']}, but tensors of {len(layers)}")
        cfg = config_from_dict(manifest["family"], fields)  # (its shape checked as it is built)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise unloadable(e) from None
    held = sum(math.prod(entry["shape"]) for name, entry in manifest["tensors"].items()
               if name.startswith("model/"))
    if held != cfg.num_parameters():
        raise _damaged(path, "manifest.json", f"its model settings make {cfg.num_parameters()}"
                                              f" parameters, its model tensors hold {held}")
    _check_shapes(path, manifest["tensors"], cfg.parameter_shapes(), cfg.routing_state_shapes())
    return cfg


KEPT = "kept/"
"""The prefix of tensors an imported model holds that meshtrain does not build (DeepSeek's
multi-token-prediction layers): kept under their Hugging Face names for export, never loaded."""


def _check_shapes(path: Path, tensors: dict, expected: dict[str, tuple[int, ...]],
                  routing: dict[str, tuple[int, ...]]) -> None:
    """Each model tensor, each optimizer state or earlier weight version of one, and each
    router's balancing state has the shape the model settings give it (equal counts can
    still hide, say, a vocabulary one row longer and a position table one row shorter)."""
    held = {name.removeprefix("model/") for name in tensors if name.startswith("model/")}
    if held != set(expected):
        name = sorted(held ^ set(expected))[0]
        where = "its model tensors hold" if name in held else "no model tensor holds"
        raise _damaged(path, "manifest.json", f"{where} {name}, which its model settings"
                                              f" {'do not make' if name in held else 'make'}")
    expected = expected | routing  # (a checkpoint from before the routing state has none)
    for name, entry in tensors.items():
        param = name.removeprefix("previous/") if name.startswith("previous/") else \
            name.split("/", 2)[-1]
        if name == "optim/step" or name.startswith(KEPT):
            continue
        if tuple(entry["shape"]) != expected.get(param, ()):
            raise _damaged(path, "manifest.json", f"{name} has shape {entry['shape']}, but its"
                                                  f" model settings make {param}"
                                                  f" {list(expected.get(param, ()))}")


def _check_train_state(path: Path, step: int) -> None:
    """train_state.json: the manifest's step, and a loss scale a resumed run can take."""
    state = _read_json(path, "train_state.json")
    if not isinstance(state, dict) or not _is_int(state.get("step")):
        raise _damaged(path, "train_state.json", "has no integer step")
    if state["step"] != step:
        raise _damaged(path, "train_state.json", f"is at step {state['step']}, manifest.json at"
                                                 f" {step}")
    scaler = state.get("loss_scaler", {"scale": 1.0, "clean_steps": 0})
    if not isinstance(scaler, dict) or type(scaler.get("scale")) not in (int, float) or \
            not 0 < scaler["scale"] < math.inf or not _is_int(scaler.get("clean_steps")) or \
            scaler["clean_steps"] < 0:
        raise _damaged(path, "train_state.json", f"its loss_scaler {str(scaler)[:80]} is not a"
                                                 " finite positive scale and a count of clean"
                                                 " steps")


def _check_config_toml(path: Path) -> None:
    """config.toml, where there is one (written since the first format), is TOML: a resumed
    run compares its settings with it."""
    if not _present(path, "config.toml"):
        return
    try:
        tomllib.loads((path / "config.toml").read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise _damaged(path, "config.toml", f"unreadable ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise _damaged(path, "config.toml", f"not valid TOML ({e})") from None


def _is_int(value: object) -> bool:
    return type(value) is int


def _check_tensors(path: Path, manifest: dict) -> None:
    """Each tensor entry: a shape, a known dtype, and pieces of listed files that tile it."""
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict) or not _is_int(manifest.get("step")) or \
            not isinstance(manifest.get("layout"), dict) or \
            not isinstance(manifest.get("model"), dict):
        raise _damaged(path, "manifest.json", "lacks its step, layout, model or tensors")
    if manifest["step"] < 0:
        raise _damaged(path, "manifest.json", f"its step {manifest['step']} is negative")
    layout = manifest["layout"]  # the degrees, and a grid scheme's name and grid (mesh.layout)
    degrees = [layout.get(axis) for axis in ("pp", "dp", "cp", "tp", "ep") if axis in layout]
    grid = layout.get("tp_grid", {})
    if not isinstance(grid, dict) or not all(_is_int(n) and n >= 1
                                             for n in [*degrees, *grid.values()]):
        raise _damaged(path, "manifest.json", f"its layout {str(manifest['layout'])[:80]} is not"
                                              " degrees (positive integers)")
    used: dict[tuple[str, str], str] = {}
    for name, entry in tensors.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
            raise _damaged(path, "manifest.json", f"{name} has no valid shape ({shape!r})")
        if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPE_NAMES:
            raise _damaged(path, "manifest.json", f"{name} has dtype {entry.get('dtype')!r},"
                                                  f" not one of {', '.join(DTYPE_NAMES)}")
        pieces = entry.get("pieces")
        if not isinstance(pieces, list) or not pieces:
            raise _damaged(path, "manifest.json", f"{name} has no pieces")
        for piece in pieces:
            _check_piece_fields(path, name, piece, manifest["files"])
            where = (piece["file"], piece["key"])
            if where in used:
                raise _damaged(path, "manifest.json", f"{name} and {used[where]} both read"
                                                      f" {piece['key']} of {piece['file']}")
            used[where] = name
        _check_tiling(path, name, shape, pieces)


def _check_piece_fields(path: Path, name: str, piece: object, files: dict) -> None:
    if not isinstance(piece, dict) or not isinstance(piece.get("key"), str) or \
            not all(_is_int(piece.get(k)) for k in ("dim", "offset", "length")):
        raise _damaged(path, "manifest.json", f"a piece of {name} lacks file, key, dim, offset"
                                              " or length")
    if not is_plain_name(piece.get("file")):
        raise _damaged(path, "manifest.json", f"a piece of {name} names"
                                              f" {str(piece.get('file'))[:80]!r}, which is not a"
                                              " plain file name inside the checkpoint directory")
    if piece["file"] not in files:
        raise _damaged(path, "manifest.json", f"a piece of {name} is in {piece['file']}, which"
                                              " `files` does not list")


def _check_tiling(path: Path, name: str, shape: list[int], pieces: list[dict]) -> None:
    """The pieces cover rows 0 .. size of one dimension exactly once."""
    dim = pieces[0]["dim"]
    if any(p["dim"] != dim for p in pieces) or not 0 <= dim < max(len(shape), 1):
        raise _damaged(path, "manifest.json", f"pieces of {name} split dimensions that do not"
                                              f" fit its shape {shape}")
    size = shape[dim] if shape else 1
    for p in pieces:
        if p["length"] < 1 or p["offset"] < 0 or p["offset"] + p["length"] > size:
            raise _damaged(path, "manifest.json", f"a piece of {name} spans rows {p['offset']}"
                                                  f"..{p['offset'] + p['length']}, out of range"
                                                  f" of its {size} rows")
    covered = 0
    for offset, length in sorted((p["offset"], p["length"]) for p in pieces):
        if offset < covered:
            raise _damaged(path, "manifest.json", f"pieces of {name} overlap at rows"
                                                  f" {offset}..{min(covered, offset + length)}")
        if offset > covered:
            break
        covered = offset + length
    if covered != size:
        gap_end = min([p["offset"] for p in pieces if p["offset"] > covered] + [size])
        raise _damaged(path, "manifest.json", f"rows {covered}..{gap_end} of {name} are in no"
                                              " piece (a gap)")


def _check_headers(path: Path, manifest: dict) -> None:
    """Each piece's key is in its file with the manifest's dtype and the piece's shape; each
    rank file's RNG states are its own rank's, of the same streams as every other rank's."""
    by_file: dict[str, list[tuple[str, dict, dict]]] = {}
    for name, entry in manifest["tensors"].items():
        for piece in entry["pieces"]:
            by_file.setdefault(piece["file"], []).append((name, entry, piece))
    streams: dict[str, set[str]] = {}
    for file in sorted({f for f in manifest["files"] if RANK_FILE.fullmatch(f)} | set(by_file)):
        try:
            with safe_open(str(path / file), framework="pt") as f:
                keys = set(f.keys())
                for name, entry, piece in by_file.get(file, []):
                    _check_header(path, file, f, keys, name, entry, piece)
                if RANK_FILE.fullmatch(file):
                    streams[file] = _rng_streams(path, file, f, keys, manifest.get("device"))
        except SafetensorError as e:
            raise _damaged(path, file, f"not a safetensors file ({e})") from None
    first = min(streams, default=None)
    for file, names in streams.items():
        if names != streams[first]:
            raise _damaged(path, file, f"holds the RNG streams {sorted(names)}, {first}"
                                       f" {sorted(streams[first])}")


def _rng_streams(path: Path, file: str, f, keys: set[str], device: object) -> set[str]:
    """The names of the RNG states in a rank file: `rng/<its rank>/<stream>`, uint8 vectors of
    the length a generator of the checkpoint's `device` type keeps (where it is known)."""
    size = STATE_BYTES.get(device) if isinstance(device, str) else None
    rank = str(int(RANK_FILE.fullmatch(file).group(1)))
    names = set()
    for key in sorted(k for k in keys if k.startswith("rng/")):
        _, owner, name = (key.split("/", 2) + ["", ""])[:3]
        part = f.get_slice(key)
        if owner != rank or part.get_dtype() != "U8" or len(part.get_shape()) != 1:
            raise _damaged(path, file, f"{key} is not rank {rank}'s RNG state (a uint8 vector"
                                       f" under rng/{rank}/)")
        if size is not None and part.get_shape() != [size]:
            raise _damaged(path, file, f"{key} holds {part.get_shape()[0]} bytes, not the"
                                       f" {size} of a generator's state on {device}")
        names.add(name)
    return names


def _check_header(path: Path, file: str, f, keys: set[str], name: str, entry: dict,
                  piece: dict) -> None:
    key = piece["key"]
    if key not in keys:
        raise _damaged(path, file, f"has no tensor {key}, which manifest.json lists as a piece"
                                   f" of {name}")
    part = f.get_slice(key)
    dtype = DTYPES.get(part.get_dtype())
    if dtype is not DTYPE_NAMES[entry["dtype"]]:
        raise _damaged(path, file, f"{key} is {part.get_dtype()} there, but manifest.json"
                                   f" records {entry['dtype']}")
    shape = list(entry["shape"])
    if shape:
        shape[piece["dim"]] = piece["length"]
    if list(part.get_shape()) != shape:
        raise _damaged(path, file, f"{key} has shape {list(part.get_shape())} there, but"
                                   f" manifest.json's {name} needs {shape} for this piece")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint the `latest` pointer names (None when there is none): only a `step_*`
    directory beside it."""
    root = Path(root)
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    fix = "restore it or start without `resume`"
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer} is unreadable ({e}); {fix}") from None
    if not STEP_NAME.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a step_NNNNNNNN directory"
                              f" beside it; {fix}")
    path = root / name
    if path.is_symlink() and path.resolve().parent != root.resolve():
        raise CheckpointError(f"{pointer} names {name}, a link leaving {root}; {fix}")
    if not (path / "manifest.json").is_file():
        raise CheckpointError(f"{pointer} names {name}, which has no manifest: the checkpoint"
                              f" directory is damaged; {fix}")
    return path


def resolve_checkpoint(run: str | Path) -> Path:
    """A checkpoint directory itself, or the latest checkpoint of a run directory."""
    path = Path(run)
    if (path / "manifest.json").is_file():
        return path
    found = latest_checkpoint(path / "checkpoints") if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{run}: no checkpoint there; pass a run directory written by"
                              " meshtrain train or import-hf, or one of its checkpoints/step_*"
                              " directories")
    return found


def checkpoint_config(path: str | Path) -> TransformerConfig:
    """The model config a checkpoint (or a run's latest) holds, from its metadata alone."""
    path = resolve_checkpoint(path)
    return _model_config(path, read_manifest(path, verify_files=False))


def _check_model(path: Path, manifest: dict, cfg: TransformerConfig) -> None:
    """The checkpoint holds a model of `cfg`'s family and tensor shapes."""
    family = family_of(cfg).name
    if manifest["family"] != family:
        raise CheckpointError(f"checkpoint {path} holds a {manifest['family']} model, not a"
                              f" {family}: choose a {manifest['family']} `model` preset to"
                              " load it")
    saved = config_from_dict(family, manifest["model"])
    for key in cfg.SHAPE_FIELDS:
        if getattr(saved, key) != getattr(cfg, key):
            raise CheckpointError(
                f"checkpoint {path} is from a different model shape: {key} {getattr(saved, key)}"
                f" there vs {getattr(cfg, key)} here; use the model settings it was trained"
                " with")
