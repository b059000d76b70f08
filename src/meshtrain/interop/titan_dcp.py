"""torchtitan's Llama 3 as a `torch.distributed.checkpoint` (DCP) directory, out and in.

Names are those torchtitan 0.3.0's `Llama3Model` saves (its fused `wqkv` writes itself as
`wq`/`wk`/`wv`), derived from the Hugging Face map by renaming (`_RENAMES`): our k|v and gate|up
blocks become `wk`, `wv` and `w1`, `w3`. torchtitan rotates interleaved pairs of a head's
dimensions (a complex view), we rotate its halves, so the rows of each query and key head are
reordered between the two conventions; nothing else changes. An export writes
`meshtrain.json` (family and config) beside DCP's files; a directory torchtitan saved has none,
and its model is read from the tensor shapes, which give everything but the number of heads
(and tying: torchtitan saves a tied output layer under its own name, so it reads as untied).
`torch.distributed.checkpoint` is imported where it is used: it brings DTensor and sympy (about
a second), which every run's configuration, importing this module to recognise a DCP
`init_from`, would otherwise pay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import warnings
from pathlib import Path

import torch

from meshtrain.checkpointing.checkpoint import CheckpointError, read_manifest
from meshtrain.checkpointing.model_files import model_tensors, unwritable
from meshtrain.checkpointing.verify import is_plain_name
from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_llama import MAPPING
from meshtrain.mesh import ParallelMesh
from meshtrain.models.llama import LlamaConfig
from meshtrain.parallel.layers.sharding import parameter_shards, shard_tensor

SIDECAR = "meshtrain.json"
_RENAMES = (  # Hugging Face's name pieces -> torchtitan's
    ("model.embed_tokens", "tok_embeddings"), ("model.layers.", "layers."),
    ("model.norm", "norm"), ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "ffn_norm"), ("self_attn.q_proj", "attention.qkv_linear.wq"),
    ("self_attn.k_proj", "attention.qkv_linear.wk"),
    ("self_attn.v_proj", "attention.qkv_linear.wv"), ("self_attn.o_proj", "attention.wo"),
    ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
    ("mlp.down_proj", "feed_forward.w2"))


@contextlib.contextmanager
def _one_process():
    """DCP without a collective: each process reads or writes alone, which DCP warns about
    when no process group exists (an export); here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        yield


def is_dcp_directory(path: str | Path) -> bool:
    return (Path(path) / ".metadata").is_file()


def _titan_name(hf_name: str) -> str:
    for theirs, titans in _RENAMES:
        hf_name = hf_name.replace(theirs, titans)
    return hf_name


def _rotary_heads(cfg: LlamaConfig, titan_name: str) -> int | None:
    """Heads whose rows change order between the rotary conventions (q and k), else None."""
    return {"wq": cfg.num_heads, "wk": cfg.kv_heads}.get(titan_name.split(".")[-2])


def _interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A head's rows [first half; second half] -> pairs (torchtitan's order)."""
    return w.reshape(heads, 2, -1, w.shape[-1]).transpose(1, 2).reshape(w.shape).contiguous()


def _halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A head's rows in pairs -> [first half; second half] (ours)."""
    return w.reshape(heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape).contiguous()


def _maps(cfg: LlamaConfig) -> dict[str, list[str]]:
    """Each of our tensors and the torchtitan tensors it joins along the rows."""
    return {m.ours: [_titan_name(name) for name in m.theirs] for m in MAPPING.tensor_maps(cfg)}


def titan_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor torchtitan's model of `cfg` saves, by name."""
    ours = cfg.parameter_shapes()
    return {_titan_name(name): shape for m in MAPPING.tensor_maps(cfg)
            for name, shape in m.their_shapes(ours[m.ours]).items()}


def _check_family(family: str, cfg, where: str, fix: str) -> LlamaConfig:
    """`cfg`, when it is a plain Llama (torchtitan's Llama 3 has no experts, biases or head
    norms, and heads of dim / n_heads)."""
    extras = {" with experts": cfg.moe_experts, " with q/k/v biases": cfg.qkv_bias,
              " with q/k head norms": cfg.qk_norm, " with `head_size` set": cfg.head_size}
    if family != "llama" or type(cfg) is not LlamaConfig or any(extras.values()):
        extra = "" if family != "llama" else next(k for k, v in extras.items() if v)
        raise CheckpointError(f"DCP directories hold torchtitan's Llama 3; {where} holds a"
                              f" {family} model{extra}: {fix}")
    return cfg


def export_dcp(checkpoint: str | Path, out_dir: str | Path) -> int:
    """Write a Llama checkpoint of any layout as a DCP directory of torchtitan's names and
    rotary order, from one process; returns the number of tensors written."""
    import torch.distributed.checkpoint as dcp

    from meshtrain.models import config_from_dict

    checkpoint, out = Path(checkpoint), Path(out_dir)
    manifest = read_manifest(checkpoint)
    cfg = _check_family(manifest["family"],
                        config_from_dict(manifest["family"], manifest["model"]),
                        f"checkpoint {checkpoint}", "export it with format hf or meshtrain")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SettingError(Code.OUT_PATH,
                           f"`out` {out} exists and is not an empty directory: choose a new one")
    maps, state = _maps(cfg), {}
    for name, tensor in model_tensors(checkpoint, manifest):
        titans = maps[name]
        for titan, part in zip(titans, tensor.chunk(len(titans)), strict=True):
            heads = _rotary_heads(cfg, titan)
            state[titan] = part.contiguous() if heads is None else _interleaved(part, heads)
    if cfg.tie_word_embeddings:  # torchtitan's tied model saves its output layer by name too
        state["lm_head.weight"] = state["tok_embeddings.weight"]
    tmp = out.with_name(f".{out.name}.tmp")  # moved in whole; the next export removes a left one
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        with _one_process():
            dcp.save(state, checkpoint_id=tmp, no_dist=True)
        (tmp / SIDECAR).write_text(json.dumps({"family": "llama",
                                               "model": dataclasses.asdict(cfg)}, indent=1))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except OSError as e:
        raise unwritable(out, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (gone after the rename)
    return len(state)


def _read_metadata(path: Path):
    """The directory's DCP `.metadata`, refused in one line when it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - DCP raises whatever its unpickling meets
        raise CheckpointError(f"{path}: its DCP .metadata cannot be read"
                              f" ({type(e).__name__}): the directory is damaged") from None


def _stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = _read_metadata(path).state_dict_metadata
    return {key: tuple(entry.size) for key, entry in stored.items()
            if isinstance(entry, TensorStorageMetadata)}


def check_dcp_files(path: str | Path, read: bool = False) -> None:
    """Every file the `.metadata` names is a plain file of the directory, at least as long as
    the last byte it records there (DCP would otherwise fail on the ranks, mid-load); with
    `read`, each stored tensor is read once, one at a time, as DCP will read it."""
    path = Path(path)
    metadata, ends = _read_metadata(path), {}
    storage = getattr(metadata, "storage_data", None)
    for info in storage.values() if isinstance(storage, dict) else [None]:
        name = getattr(info, "relative_path", None)
        if not is_plain_name(name) or not all(type(getattr(info, n, None)) is int
                                              and getattr(info, n) >= 0
                                              for n in ("offset", "length")):
            raise _damaged(path, ".metadata", f"names {str(name)[:80]!r} with no valid byte range,"
                                              " not a plain file of the directory")
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        if file.is_symlink() and file.resolve().parent != path.resolve():
            raise _damaged(path, name, "is a link leaving the directory")
        if not file.is_file():
            raise _damaged(path, name, "is missing (its .metadata names it)")
        if (size := file.stat().st_size) < end:
            raise _damaged(path, name, f"is truncated: {size} bytes, its .metadata records data"
                                       f" up to byte {end}")
    if read:
        _read_tensors(path, metadata)


def _read_tensors(path: Path, metadata) -> None:
    """Each tensor item DCP's file reader would `torch.load` from its byte range, loaded so."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(entry, TensorStorageMetadata) or \
                getattr(info, "transform_descriptors", None):
            continue  # (bytes items are read raw; transformed ones by their extension)
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - whatever unpickling damaged bytes meets
            raise _damaged(path, info.relative_path, f"cannot be read at {index.fqn}"
                                                     f" ({_first_failure(e)})") from None


def _damaged(path: Path, file: str, problem: str) -> CheckpointError:
    return CheckpointError(f"DCP directory {path}: {file} {problem}; the directory is damaged:"
                           " restore it or save it again")


def dcp_model_config(path: str | Path, num_heads: int | None) -> LlamaConfig:
    """The Llama model of a DCP directory: its `meshtrain.json`, else its shapes with
    `num_heads` given (torchtitan's n_heads; the shapes do not show it); checked against every
    tensor stored."""
    path = Path(path)
    shapes = _stored_shapes(path)
    if (path / SIDECAR).is_file():
        from meshtrain.models import config_from_dict

        saved = json.loads((path / SIDECAR).read_text())
        cfg = _check_family(saved["family"], config_from_dict(saved["family"], saved["model"]),
                            SIDECAR, "it was not written by `export --format dcp`")
    else:
        cfg = _shape_config(path, shapes, num_heads)
    expected = titan_shapes(cfg)
    for name, shape in expected.items():
        if shapes.get(name) != shape:
            raise CheckpointError(f"{path}: {name} has shape {shapes.get(name)} there,"
                                  f" {shape} for a Llama of {num_heads or cfg.num_heads} heads:"
                                  " it is not torchtitan's Llama 3 of those settings")
    return cfg


def _shape_config(path: Path, shapes: dict, num_heads: int | None) -> LlamaConfig:
    """A Llama config from torchtitan's tensor shapes and the number of heads."""
    needed = ("tok_embeddings.weight", "layers.0.attention.qkv_linear.wk.weight",
              "layers.0.feed_forward.w1.weight")
    missing = [name for name in needed if name not in shapes]
    if missing:
        raise CheckpointError(f"{path}: a DCP directory without {missing[0]}: it is not"
                              " torchtitan's Llama 3")
    if num_heads is None:
        raise CheckpointError(f"{path}: a DCP directory torchtitan saved does not"
                              " record its heads: give `num_heads` (torchtitan's n_heads)")
    vocab, hidden = shapes[needed[0]]
    head_dim = hidden // num_heads
    layers = len({key.split(".")[1] for key in shapes if key.startswith("layers.")})
    return LlamaConfig(num_layers=layers, hidden_size=hidden, num_heads=num_heads,
                       num_kv_heads=shapes[needed[1]][0] // max(head_dim, 1),
                       vocab_size=vocab, ffn_hidden_size=shapes[needed[2]][0],
                       tie_word_embeddings="lm_head.weight" not in shapes)


def load_dcp_weights(path: str | Path, model: torch.nn.Module,
                     mesh: ParallelMesh) -> dict[str, torch.Tensor]:
    """This rank's value of each of `model`'s parameters from a DCP directory of torchtitan's
    Llama: DCP reads each stored tensor whole (one of ours at a time), then our layout cuts
    this rank's piece."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    cfg, maps, shards = model.cfg, _maps(model.cfg), parameter_shards(model)
    shapes, values = cfg.parameter_shapes(), {}
    for name, _ in model.named_parameters():
        rows, *rest = shapes[name]
        parts = {titan: torch.empty(rows // len(maps[name]), *rest) for titan in maps[name]}
        try:
            with _one_process():
                dcp.load(parts, checkpoint_id=Path(path), no_dist=True)
        except (Exception, CheckpointException) as e:  # (a BaseException) - whatever DCP meets
            raise _damaged(Path(path), f"(its {', '.join(parts)})",
                           f"cannot be read ({_first_failure(e)})") from None
        full = torch.cat([part if _rotary_heads(cfg, titan) is None else
                          _halves(part, _rotary_heads(cfg, titan))
                          for titan, part in parts.items()])
        values[name] = full if shards[name] is None else shard_tensor(full, shards[name], mesh)
    return values



def _first_failure(e: BaseException) -> str:
    """The first problem a failed DCP read met, in one short line: a `CheckpointException`
    wraps each rank's (exception, traceback)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        e = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    text = " ".join(str(e).split()).split(". ")[0][:100]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
