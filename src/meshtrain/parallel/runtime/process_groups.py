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
from torch.distributed.device_mesh import DeviceMesh

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh, resolve_degrees
from meshtrain.parallel.runtime.device_mesh import (
    check_asked_degrees,
    device_mesh_degrees,
    reused_groups,
)
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
        raise SettingError(Code.CHOICE, f"`device` must be auto, cpu or cuda, got {kind!r}")
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SettingError(Code.CUDA_DEVICES,
                           "`device` cuda: no CUDA device is visible; use `device` cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def check_local_devices(kind: str, local_ranks: int) -> None:
    """One GPU per local rank: NCCL cannot put two ranks on one device."""
    if resolve_device(kind).type == "cuda" and local_ranks > torch.cuda.device_count():
        raise SettingError(Code.CUDA_DEVICES,
                           f"{local_ranks} local ranks need {local_ranks} GPUs but"
                           f" {torch.cuda.device_count()} are visible: use fewer ranks (`nproc`)"
                           " or `device` cpu")


def init_parallel(
    tp: int | None = None,
    pp: int | None = None,
    dp: int | None = None,
    cp: int | None = None,
    ep: int = 1,
    *,
    tp_scheme: str = "1d",
    tp_depth: int | None = None,
    device: str = "auto",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    device_mesh: DeviceMesh | None = None,
    dp_shard: int | None = None,
    cp_a2a: int | None = None,
    etp: int | None = None,
) -> ParallelMesh:
    """Create (if needed) the default process group from torchrun's environment and the mesh.

    Without torchrun's environment this becomes a one-rank world. The backend follows the device
    (`device`: auto, cpu or cuda): NCCL on CUDA, gloo on CPU. Degrees left out are 1 (dp: the
    rest of the world). `dp_shard`: hybrid sharding's group of data-parallel ranks (a divisor
    of dp; default all of them). `cp_a2a`: hybrid context parallelism's all-to-all group
    (a divisor of cp; the mesh gains its cp_a2a and cp_ring sub-axes). `etp`: the expert
    tensor-parallel degree, 1 or tp (default tp; at 1 ep spans dp x cp x tp).

    `device_mesh`: a torch DeviceMesh with named dims (pp, dp_replicate, dp_shard or dp, cp,
    tp, in that order, row-major over the world) gives the degrees and its groups for pp, dp,
    cp and tp; degrees passed beside it must equal its own. See `device_mesh.py` for the rules.
    """
    if device_mesh is not None:
        if not dist.is_initialized():
            raise SettingError(Code.DEVICE_MESH_DIMS, "a DeviceMesh needs torch.distributed"
                               " initialised, and none is")
        made = device_mesh_degrees(device_mesh, dist.get_world_size())
        check_asked_degrees(device_mesh, made, {"tp": tp, "pp": pp, "dp": dp, "cp": cp})
        tp, pp, dp, cp = made["tp"], made["pp"], made["dp"], made["cp"]
    tp, pp, cp = (1 if d is None else d for d in (tp, pp, cp))  # (0 stays: refused below)
    if dist.is_initialized():
        world_size = dist.get_world_size()
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    degrees = resolve_degrees(world_size, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)
    grid = tp_grid(tp_scheme, tp, tp_depth)
    device = resolve_device(device)
    if not dist.is_initialized():
        _start_world(device, timeout)
    if device_mesh is not None and device_mesh.device_type != device.type:
        raise SettingError(Code.DEVICE_MESH_DIMS, f"the DeviceMesh is on {device_mesh.device_type}"
                           f" but `device` is {device.type}: use the mesh's device")
    reused = reused_groups(device_mesh) if device_mesh is not None else None
    return ParallelMesh(degrees, rank=dist.get_rank(), device=device, tp_scheme=tp_scheme,
                        tp_grid=grid, device_mesh=device_mesh, reused=reused, dp_shard=dp_shard,
                        cp_a2a=cp_a2a, etp=etp)


def _start_world(device: torch.device, timeout: datetime.timedelta) -> None:
    """The default process group: torchrun's world from its environment, else one rank."""
    atexit.unregister(destroy_parallel)  # (once, however often a process starts a world)
    atexit.register(destroy_parallel)  # a script that forgets it still exits cleanly
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, **_attempt_store(timeout))
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=timeout)


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
