"""Hugging Face model directories in and out, for every family with a mapping: config.json and
safetensors weights (one model.safetensors, or shards listed by model.safetensors.index.json).

    import_hf("llama-hf", "runs/llama")                 # a meshtrain run directory at step 0
    export_hf("runs/llama/checkpoints/step_00000100", "llama-out")   # for from_pretrained

Memory: an import reads the Hugging Face tensors of one of our tensors, converts them and writes
the result before reading the next; an export assembles one logical tensor from a checkpoint's
pieces (any layout), converts it and writes its parts. The safetensors headers are planned first
from shapes alone (the same conversions, run on meta tensors), so each file is written in one
pass by `safetensors_stream`: the peak is about two copies of the largest tensor (it and its
transposed copy), never a model. Nothing here needs `transformers`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from meshtrain.checkpointing.checkpoint import CheckpointError, read_manifest, routing_buffers
from meshtrain.checkpointing.model_files import (
    ROUTING,
    model_entries,
    model_tensors,
    unwritable,
    write_model_checkpoint,
)
from meshtrain.checkpointing.safetensors_stream import DTYPES, Planned, write_safetensors
from meshtrain.checkpointing.verify import KEPT, is_plain_name
from meshtrain.data.tokenization import TOKENIZER_FILE, HFTokenizer, checkpoint_tokenizer
from meshtrain.errors import Code, SettingError
from meshtrain.interop import (
    hf_deepseek_v3,
    hf_gpt2,
    hf_llama,
    hf_mistral,
    hf_mixtral,
    hf_qwen2,
    hf_qwen2_moe,
    hf_qwen3,
    hf_qwen3_moe,
)
from meshtrain.interop.hf_mapping import HFMapping, TensorMap, refused, shown
from meshtrain.machine_fit import check_import_fits
from meshtrain.models import (
    FAMILIES,
    CausalLM,
    TransformerConfig,
    config_from_dict,
    family_of,
)

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
_FLOATS = ("F32", "BF16", "F16", "F64")


MAPPINGS: dict[str, HFMapping] = {mapping.family: mapping for mapping in (
    hf_gpt2.MAPPING, hf_llama.MAPPING, hf_qwen2.MAPPING, hf_mistral.MAPPING, hf_mixtral.MAPPING,
    hf_qwen2_moe.MAPPING, hf_qwen3.MAPPING, hf_qwen3_moe.MAPPING, hf_deepseek_v3.MAPPING)}
"""Each family's Hugging Face mapping by family name: a family with a Hugging Face twin is one
entry here, imported where import tools see it (models, drawn below interop, never name it)."""


def hf_mapping(family: str) -> HFMapping:
    """The Hugging Face mapping of the family named `family`."""
    if family not in MAPPINGS:
        raise SettingError(Code.HF_EXPORT, f"the {family} family has no Hugging Face"
                           " counterpart: export it with format meshtrain")
    return MAPPINGS[family]


def is_hf_directory(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def _refused(code: Code, message: str) -> SettingError:
    return SettingError(code, message, settings=())


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, refused in one line when the file is anything else."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problem = f"is not JSON ({e})"
    except RecursionError:
        problem = "is not JSON (nested too deeply)"
    else:
        if isinstance(value, dict):
            return value
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        problem = f"holds {kind.get(type(value), 'a number')}, not a JSON object"
    raise _refused(Code.HF_CONFIG if path.name == CONFIG else Code.HF_WEIGHTS,
                   f"{path} {problem}; fix or replace the file")


def mapping_for(hf_config: dict) -> HFMapping:
    """The family mapping of a config.json's architecture (or, without one, its model type)."""
    mappings = [MAPPINGS[name] for name in FAMILIES if name in MAPPINGS]
    names = hf_config.get("architectures") or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise refused(f'config.json "architectures": {shown(names)} is not a list of class'
                      " names; fix the field")
    for mapping in mappings:
        if mapping.architecture in names or \
                (not names and hf_config.get("model_type") == mapping.model_type):
            return mapping
    raise refused(f'config.json "architectures": {shown(names or hf_config.get("model_type"))}'
                  " cannot be imported: meshtrain imports"
                  f" {', '.join(m.architecture for m in mappings)}")


class HFModelDirectory:
    """A Hugging Face model directory: its config as ours (refused when meshtrain cannot
    represent it) and its weights under our names, read one tensor at a time. Everything is
    checked when it is opened, from config.json and the files' headers alone: nothing is
    built or read before the config, the index and every tensor's dtype and shape agree."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not is_hf_directory(self.path):
            raise _refused(Code.HF_CONFIG, f"{path}: no {CONFIG} there; pass a Hugging Face model"
                           " directory (config.json and safetensors weights)")
        self.hf_config = _read_json(self.path / CONFIG)
        self.mapping, self.cfg = self._model()
        self._open: dict[str, object] = {}
        self.files = self._weight_files()
        shapes = self._checked_shapes()
        self.kept = sorted(key for key in self.files
                           if self.mapping.kept(key, self.hf_config, self.cfg))
        self.maps = self.mapping.tensor_maps(self.cfg) + [
            TensorMap(KEPT + key, (key,)) for key in self.kept]
        self._planned = self._plan(shapes)

    def _refuse(self, message: str, code: Code = Code.HF_WEIGHTS) -> SettingError:
        return _refused(code, f"{self.path}: {message}")

    def _model(self) -> tuple[HFMapping, TransformerConfig]:
        """config.json's family mapping and our config; a refusal names this directory's
        config.json (not our settings, which have no flags here)."""
        try:
            mapping = mapping_for(self.hf_config)
            return mapping, mapping.config_from_hf(self.hf_config)
        except SettingError as e:
            if e.code is Code.HF_CONFIG:
                raise self._refuse(str(e), Code.HF_CONFIG) from None
            raise self._refuse(f"config.json describes a model meshtrain cannot build"
                               f" ({str(e).replace('`', '')}); fix config.json",
                               Code.HF_CONFIG) from None

    def _weight_files(self) -> dict[str, str]:
        """Each tensor's file: the index's weight map (plain file names inside the directory,
        every one present), or the one file's keys."""
        if (self.path / INDEX).is_file():
            weight_map = _read_json(self.path / INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise self._refuse(f'{INDEX} has no "weight_map" of tensor names to files; fix'
                                   " or replace the file")
            for name, file in weight_map.items():
                if not is_plain_name(file):
                    raise self._refuse(f'{INDEX} "weight_map" names {str(file)[:80]!r} for'
                                       f" {name}, not a file inside the model directory; fix"
                                       " the index")
            missing = sorted({f for f in weight_map.values() if not (self.path / f).is_file()})
            if missing:
                raise self._refuse(f"{INDEX} lists {missing[0]}, which is not there"
                                   f" ({len(missing)} file(s) missing): the download is"
                                   " incomplete; fetch the missing shards")
            return weight_map
        if (self.path / WEIGHTS).is_file():
            return dict.fromkeys(self._file(WEIGHTS).keys(), WEIGHTS)
        raise self._refuse(f"no {WEIGHTS} or {INDEX}; save the model with safetensors (meshtrain"
                           " reads no pickled pytorch_model.bin)")

    def _file(self, name: str):
        """The open safetensors file `name`, refused in one line when its header is damaged."""
        if name not in self._open:
            try:
                self._open[name] = safe_open(str(self.path / name), framework="pt")
            except (SafetensorError, OSError) as e:
                raise self._refuse(f"{name} is not a readable safetensors file"
                                   f" ({' '.join(str(e).split())}): it is damaged or"
                                   " truncated; download or save it again") from None
        return self._open[name]

    def _checked_shapes(self) -> dict[str, tuple[int, ...]]:
        """Our tensors' shapes by config.json, once it is clear they can be sized: no more
        layers than the files hold tensors, no tensor larger than the files altogether (an
        absurd count or width would otherwise build maps of a billion layers or overflow
        torch's sizes before any header is compared)."""
        if self.cfg.num_layers > len(self.files):
            raise self._refuse(f"config.json describes {self.cfg.num_layers:,} layers, its"
                               f" safetensors files hold {len(self.files)} tensors: config.json"
                               " is not these weights' config; use the model's own config.json")
        shapes = self.cfg.parameter_shapes() | {
            ROUTING + name: shape for name, shape in self.cfg.routing_state_shapes().items()}
        held = sum(math.prod(self._file(file).get_slice(key).get_shape())
                   for key, file in self.files.items())
        shapes |= {KEPT + key: tuple(self._file(self.files[key]).get_slice(key).get_shape())
                   for key in self.files if self.mapping.kept(key, self.hf_config, self.cfg)}
        name, shape = max(shapes.items(), key=lambda item: math.prod(item[1]))
        if math.prod(shape) > held:
            raise self._refuse(f"config.json makes meshtrain's {name} {list(shape)}, more than"
                               f" its safetensors files hold altogether ({held:,} numbers):"
                               " config.json is not these weights' config; use the model's own"
                               " config.json")
        return shapes

    def _find(self, name: str):
        """(open file, key) of a tensor, named with or without the base model's prefix."""
        key = name
        if key not in self.files:
            key = name.removeprefix(self.mapping.base_prefix)
            if key not in self.files:
                raise self._refuse(f"its safetensors files have no {name}: they do not hold the"
                                   f" {self.mapping.architecture} its config describes")
        f = self._file(self.files[key])
        if key not in f.keys():
            raise self._refuse(f"{INDEX} places {key} in {self.files[key]}, which does not hold"
                               " it; fix the index")
        return f, key

    def _plan(self, shapes: dict[str, tuple[int, ...]]) -> list[Planned]:
        """(our name, dtype, shape) of every tensor from the files' headers alone, each of their
        tensors checked for a float dtype and the shape the config gives it. Refuses files
        with weights no map reads (they would be dropped)."""
        planned, used = [], set()
        for tensor_map in self.maps:
            metas = []
            expected = tensor_map.their_shapes(shapes[tensor_map.ours])
            for name in tensor_map.theirs:
                f, key = self._find(name)
                used.add(key)
                metas.append(self._meta(f, key, expected[name]))
            if len({meta.dtype for meta in metas}) > 1:
                raise self._refuse(f"{', '.join(tensor_map.theirs)} have different dtypes; joined"
                                   " into one of meshtrain's tensors they would be cast: save"
                                   " them in one dtype")
            ours = tensor_map.to_ours(metas)
            planned.append((tensor_map.ours, ours.dtype, tuple(ours.shape)))
        unused = sorted(key for key in self.files
                        if key not in used and not self.mapping.is_ignored(key, self.cfg))
        if unused:
            raise self._refuse(f"{len(unused)} tensors such as {unused[0]} have no place in"
                               f" meshtrain's {self.mapping.family}: the checkpoint is not the"
                               f" {self.mapping.architecture} its config describes")
        return planned

    def _meta(self, f, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A meta tensor of `key`'s header, refused unless a float of `shape` (an integer or
        boolean weight would be cast, not imported)."""
        part = f.get_slice(key)
        dtype = DTYPES.get(part.get_dtype())
        if dtype is None or not dtype.is_floating_point:
            raise self._refuse(f"{key} ({self.files[key]}) is {part.get_dtype()}, not a float"
                               f" dtype meshtrain imports ({', '.join(_FLOATS)}); save the"
                               " weights as floats")
        if tuple(part.get_shape()) != shape:
            raise self._refuse(f"{key} ({self.files[key]}) has shape {list(part.get_shape())},"
                               f" config.json's {self.mapping.architecture} needs {list(shape)}:"
                               " the weights are not the model config.json describes")
        return torch.empty(shape, dtype=dtype, device="meta")

    def planned(self) -> list[Planned]:
        """(our name, dtype, shape) of every tensor, as checked when the directory opened."""
        return self._planned

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, tensor) of every tensor, read and converted one at a time."""
        for tensor_map in self.maps:
            parts = [f.get_tensor(key) for f, key in map(self._find, tensor_map.theirs)]
            yield tensor_map.ours, tensor_map.to_ours(parts)

    @torch.no_grad()
    def load_into(self, model: CausalLM) -> None:
        """Copy the weights into a dense (one-rank) model of this config."""
        params = dict(model.named_parameters()) | {
            ROUTING + name: buffer for name, buffer, _ in routing_buffers(model)}
        for name, _, shape in self.planned():
            if not name.startswith(KEPT) and tuple(params[name].shape) != shape:
                raise self._refuse(f"{name} has shape {shape} there and"
                                   f" {tuple(params[name].shape)} in its config's model")
        for name, tensor in self.tensors():
            if not name.startswith(KEPT):
                params[name].copy_(tensor)


def hf_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """A dense (one-rank) model's weights under Hugging Face's names, as its files hold them
    (a tied output layer is the embedding alone)."""
    params = {name: param.detach() for name, param in model.named_parameters()} | {
        ROUTING + name: buffer for name, buffer, _ in routing_buffers(model)}
    mapping = hf_mapping(family_of(model.cfg).name)
    return {name: part for tensor_map in mapping.tensor_maps(model.cfg)
            for name, part in tensor_map.to_theirs(params[tensor_map.ours])}


def import_hf(hf_dir: str | Path, run_dir: str | Path) -> Path:
    """Write a Hugging Face model directory as a meshtrain run directory: a step-0 checkpoint of
    its weights (loadable at any layout) and its tokenizer.json; returns the checkpoint."""
    source, run_dir = HFModelDirectory(hf_dir), Path(run_dir)
    if (run_dir / "checkpoints").exists() or (run_dir / "metrics.jsonl").exists():
        raise SettingError(Code.OUT_PATH,
                           f"`out` {run_dir} holds a run: import into a new directory")
    planned = source.planned()
    check_import_fits(planned, source.path)
    # Written into a sibling temporary, moved in at the end: an interrupted import (a signal, a
    # full disk) leaves no half-written checkpoints/ that would make the next import refuse;
    # the next import removes the temporary of an interrupted one.
    tmp = run_dir.with_name(f".{run_dir.name}.import-tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if (source.path / TOKENIZER_FILE).is_file():
            shutil.copyfile(source.path / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
        note = (f"# meshtrain import-hf {source.path.resolve()}: model weights only, no run"
                " settings\n")
        written = write_model_checkpoint(tmp / "checkpoints", family=source.mapping.family,
                                         cfg=source.cfg, planned=planned,
                                         tensors=source.tensors(), config_toml=note)
        run_dir.mkdir(parents=True, exist_ok=True)
        if (tmp / TOKENIZER_FILE).exists():
            os.replace(tmp / TOKENIZER_FILE, run_dir / TOKENIZER_FILE)
        (tmp / "checkpoints").rename(run_dir / "checkpoints")  # last: the run appears whole
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if source.kept:
        print(source.mapping.kept_note.format(count=len(source.kept)))
    return run_dir / "checkpoints" / written.name


def export_hf(checkpoint: str | Path, out_dir: str | Path) -> int:
    """Write a checkpoint of any layout as a Hugging Face model directory (config.json,
    model.safetensors, and the run's tokenizer.json with a minimal tokenizer_config.json);
    returns the number of tensors written. The checkpoint is verified before anything is
    written, and the directory appears whole or not at all.
    config.json's token ids are the run tokenizer's (so `generate` stops where training data
    ended documents), None where it has no such token or the run no tokenizer."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SettingError(Code.OUT_PATH, f"`out` {out_dir} is a file: export into a new directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise SettingError(Code.OUT_PATH,
                           f"`out` {out_dir} exists and is not empty: export into a new directory")
    manifest = read_manifest(checkpoint)
    mapping = hf_mapping(manifest["family"])
    cfg = config_from_dict(manifest["family"], manifest["model"])
    entries = model_entries(manifest, routing=True)
    maps = {tensor_map.ours: tensor_map for tensor_map in mapping.tensor_maps(cfg)} | {
        name: TensorMap(name, (name.removeprefix(KEPT),)) for name, _, _ in entries
        if name.startswith(KEPT)}
    if set(maps) != {name for name, _, _ in entries}:
        raise CheckpointError(f"checkpoint {checkpoint} does not hold the tensors of a"
                              f" {mapping.architecture}; export it with format meshtrain")
    planned = [(name, part.dtype, tuple(part.shape)) for ours, dtype, shape in entries
               for name, part in maps[ours].to_theirs(torch.empty(shape, dtype=dtype,
                                                                  device="meta"))]
    tensors = (pair for ours, full in model_tensors(checkpoint, manifest, routing=True)
               for pair in maps[ours].to_theirs(full))
    tokenizer = checkpoint_tokenizer(checkpoint, cfg.vocab_size, required=False)
    token_ids = {"bos_token_id": tokenizer.bos_id if tokenizer else None,
                 "eos_token_id": tokenizer.eod_id if tokenizer else None}
    dtype = str(entries[0][1]).removeprefix("torch.")
    kept = [name.removeprefix(KEPT) for name, _, _ in entries if name.startswith(KEPT)]
    hf_config = mapping.config_to_hf(cfg) | mapping.window_to_hf(cfg) | token_ids \
        | (mapping.kept_config(kept) if kept else {}) | {"dtype": dtype}
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
        write_safetensors(tmp / WEIGHTS, planned, tensors, metadata={"format": "pt"})
        if isinstance(tokenizer, HFTokenizer):
            _copy_tokenizer(tokenizer, tmp, max_length=cfg.max_seq_len)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except OSError as e:
        raise unwritable(out_dir, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone after the rename)
    return len(planned)


def _copy_tokenizer(tokenizer: HFTokenizer, out_dir: Path, *, max_length: int) -> None:
    """The run's tokenizer.json, with the least tokenizer_config.json that lets `AutoTokenizer`
    load it and know its end-of-document and begin-of-text tokens."""
    shutil.copyfile(tokenizer.path, out_dir / TOKENIZER_FILE)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
    for key, token_id in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eod_id)):
        if token_id is not None:
            config[key] = tokenizer.token(token_id)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
