"""Write a safetensors file one tensor at a time, so exports and imports never hold a model twice.

safetensors' own `save_file` takes every tensor at once. The format is an 8-byte little-endian
header length, a JSON header (name -> dtype, shape and byte range; `__metadata__`), then the
tensors' bytes back to back. The header needs only names, dtypes and shapes, which are known
before any tensor is read, so the bytes can follow one tensor at a time: the peak is the tensor
being written, whatever the file's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
         torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
         torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
DTYPES = {code: dtype for dtype, code in CODES.items()}

Planned = tuple[str, torch.dtype, tuple[int, ...]]
"""(name, dtype, shape) of one tensor a file will hold."""


def _header(planned: list[Planned], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in planned:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # the tensors start 8-byte aligned


def write_safetensors(path: str | Path, planned: list[Planned],
                      tensors: Iterable[tuple[str, torch.Tensor]], *,
                      metadata: dict[str, str] | None = None) -> str:
    """Write `tensors` ((name, tensor) in the order of `planned`, consumed one at a time) to
    `path` atomically (a temporary file, fsynced, then renamed); returns the file's sha256."""
    if sys.byteorder != "little":
        raise OSError("safetensors files are little-endian; this host is not")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    digest = hashlib.sha256()
    header = _header(planned, metadata)
    try:
        with open(tmp, "wb") as f:
            for chunk in (struct.pack("<Q", len(header)), header):
                f.write(chunk)
                digest.update(chunk)
            _write_tensors(f, digest, path, planned, tensors)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()  # nothing partial is left behind
        raise
    return digest.hexdigest()


def _write_tensors(f, digest, path: Path, planned: list[Planned],
                   tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    arrived = iter(tensors)
    for name, dtype, shape in planned:
        got, tensor = next(arrived)
        if got != name or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{path.name}: {got} {tensor.dtype} {tuple(tensor.shape)}"
                             f" arrived where {name} {dtype} {tuple(shape)} was planned")
        raw = memoryview(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
        f.write(raw)
        digest.update(raw)
