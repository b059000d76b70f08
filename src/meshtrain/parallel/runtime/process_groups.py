"""Starting torch.distributed and building the mesh of a plan: the default process group from
torchrun's environment (or a one-rank world), the backend from the device (NCCL on CUDA, gloo on
the CPU), and the `ParallelMesh` with the TP block arranged as its scheme's grid.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist

from meshtrain.mesh import ParallelMesh, resolve_degrees
from meshtrain.parallel.schemes.registry import tp_grid

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (for a one-machine rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEVICE_KINDS = ("auto", "cpu", "cuda")


def resolve_device(kind: str = "auto") -> torch.device:
    """This local rank's device: "auto" is CUDA when available, else the CPU."""
    if kind not in DEVICE_KINDS:
        raise ValueError(f"`device` must be auto, cpu or cuda, got {kind!r}")
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("`device` cuda: no CUDA device is visible; use `device` cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def check_local_devices(kind: str, local_ranks: int) -> None:
    """One GPU per local rank: NCCL cannot put two ranks on one device."""
    if resolve_device(kind).type == "cuda" and local_ranks > torch.cuda.device_count():
        raise ValueError(f"{local_ranks} local ranks need {local_ranks} GPUs but"
                         f" {torch.cuda.device_count()} are visible: use fewer ranks (`nproc`)"
                         " or `device` cpu")


def init_parallel(
    tp: int = 1,
    pp: int = 1,
    dp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    *,
    tp_scheme: str = "1d",
    tp_depth: int | None = None,
    device: str = "auto",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> ParallelMesh:
    """Create (if needed) the default process group from torchrun's environment and the mesh.

    Without torchrun's environment this becomes a one-rank world. The backend follows the device
    (`device`: auto, cpu or cuda): NCCL on CUDA, gloo on CPU.
    """
    if dist.is_initialized():
        world_size = dist.get_world_size()
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = resolve_degrees(world_size, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
    grid = tp_grid(tp_scheme, tp, tp_depth)
    device = resolve_device(device)
    if not dist.is_initialized():
        atexit.unregister(destroy_parallel)  # (once, however often a process starts a world)
        atexit.register(destroy_parallel)  # a script that forgets it still exits cleanly
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timeout,
            )
    return ParallelMesh(degrees, rank=dist.get_rank(), device=device, tp_scheme=tp_scheme,
                        tp_grid=grid)


def _attempt_store(timeout: datetime.timedelta) -> dict:
    """Under torch's elastic agent sharing its store with the ranks, that store outlives a
    restart and still holds the dead attempt's gloo addresses, which restarted ranks would try
    to connect to (pytorch/pytorch#135712): give each attempt keys of its own. Elsewhere,
    torchrun's env:// store as usual (an empty dict)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"meshtrain/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": world_size}


def destroy_parallel() -> None:
    """Tear the process groups down while Python is still alive: `destroy_process_group` drops
    torch's references, and a collection frees the groups meshes still hold (in reference
    cycles, until now freed only as the interpreter exits, where gloo's worker threads can
    abort the process: "terminate called without an active exception")."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
