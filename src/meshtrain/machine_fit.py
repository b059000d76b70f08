"""Whether a run's model states fit the machine it starts on, checked before anything is
allocated: a model a thousand times too large should be one line, not an out-of-memory kill
minutes later. A lower bound: every parameter's weight, gradient and AdamW states held once
over the world (ZeRO and tensor parallelism only split them), activations not counted."""

from __future__ import annotations

import math
import resource
from pathlib import Path

import torch

from meshtrain.errors import Code, SettingError
from meshtrain.precision import DTYPES, wide_dtype

GIB = 2**30


def state_bytes_per_parameter(precision: str) -> int:
    """Weight + gradient and two AdamW moments in the wide dtype (fp32, fp64 in fp64 runs),
    + a master weight where the weight is narrower than that (16-bit runs)."""
    weight = DTYPES[precision].itemsize
    state = wide_dtype(DTYPES[precision]).itemsize
    return weight + 3 * state + (state if weight < state else 0)


def available_host_bytes() -> int | None:
    """The kernel's estimate of memory available without swapping (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_limit_bytes() -> int | None:
    """This process's address-space limit (RLIMIT_AS), None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def check_states_fit(num_parameters: int, precision: str, *, world: int, ranks_here: int,
                     device_type: str) -> None:
    """Refuse a run whose model states cannot fit: on the CPU the share of this machine's
    `ranks_here` of `world` ranks against MemAvailable and one rank's against RLIMIT_AS; on a
    GPU one rank's against its device memory."""
    per = state_bytes_per_parameter(precision)
    total = num_parameters * per
    here, per_rank = total * ranks_here / world, total / world
    if device_type == "cuda":
        limits = [(torch.cuda.get_device_properties(0).total_memory, per_rank, "one GPU",
                   "of its memory")]
    else:
        limits = [(available_host_bytes(), here, f"this machine's {ranks_here} rank(s)",
                   "available (MemAvailable)"),
                  (process_limit_bytes(), per_rank, "one rank", "allowed a process (RLIMIT_AS)")]
    for limit, need, who, what in limits:
        if limit is not None and need > limit:
            raise SettingError(Code.MODEL_MEMORY, (
                f"the model's weights, gradients and AdamW states need at least"
                f" {need / GIB:,.1f} GiB for {who} ({num_parameters:,} parameters x {per} bytes"
                f" over {world} rank(s)), more than the {limit / GIB:,.1f} GiB {what}: shrink"
                " the model (`num_layers`, `hidden_size`, `vocab_size`) or train on more"
                " machines"))


def check_import_fits(planned: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      source: Path) -> None:
    """An import streams one tensor at a time and holds about two copies of the largest (read
    and converted): refuse when those exceed MemAvailable."""
    name, dtype, shape = max(planned, key=lambda p: math.prod(p[2]) * p[1].itemsize)
    need = 2 * math.prod(shape) * dtype.itemsize
    available = available_host_bytes()
    if available is not None and need > available:
        raise SettingError(Code.MODEL_MEMORY, (
            f"importing {source} holds two copies of its largest tensor, {name}"
            f" {list(shape)}: {need / GIB:,.1f} GiB, more than the {available / GIB:,.1f} GiB"
            " available (MemAvailable): free memory or import on a larger machine"))
