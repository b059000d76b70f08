"""A `torch.distributed.DeviceMesh` handed to `init_parallel`: which of its named dims become
which of meshtrain's axes, and the refusals when they cannot.

Dims are named as torchtitan names them: pp, dp_replicate, dp_shard, cp, tp (or one dp). The
data-parallel degree is dp_replicate x dp_shard (replicate outer): meshtrain's data parallelism,
replicated or ZeRO (`zero`), runs over that flattened dp (times cp), not as hybrid sharding. The
mesh must lay its ranks out as meshtrain does (row-major, dims in the order above), so each of
its groups is exactly the group meshtrain would build: those of pp, cp, tp and a lone dp dim are
reused, the rest (dp of two dims, dp x cp, embed, ...) are built as usual.
"""

from __future__ import annotations

import math

from torch.distributed.device_mesh import DeviceMesh

from meshtrain.errors import Code, SettingError

DIM_ORDER = ("pp", "dp_replicate", "dp", "dp_shard", "cp", "tp")
"""The dims meshtrain maps, outer -> inner (dp stands alone: not with dp_replicate/dp_shard)."""
DP_DIMS = ("dp_replicate", "dp", "dp_shard")


def device_mesh_degrees(device_mesh: DeviceMesh, world_size: int) -> dict[str, int]:
    """pp, dp, cp and tp of `device_mesh`'s named dims (1 where a dim is absent); raises
    SettingError naming the dims that do not fit, in one line."""
    names = tuple(device_mesh.mesh_dim_names or ())
    shape = tuple(device_mesh.mesh.shape)
    if not names:
        raise SettingError(Code.DEVICE_MESH_DIMS, f"the DeviceMesh (shape {shape}) has no dim"
                           f" names: name its dims from {', '.join(DIM_ORDER)}")
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))
    unknown = [n for n in names if n not in DIM_ORDER]
    if unknown:
        raise SettingError(Code.DEVICE_MESH_DIMS, f"DeviceMesh dims {', '.join(unknown)} (of"
                           f" {dims}) are none of {', '.join(DIM_ORDER)}: experts (ep) are"
                           " carved out of dp x cp, pass `ep` instead")
    if "dp" in names and len(set(names) & set(DP_DIMS)) > 1:
        raise SettingError(Code.DEVICE_MESH_DIMS, f"the DeviceMesh ({dims}) has dp beside"
                           " dp_replicate/dp_shard: name data parallelism one way")
    if [DIM_ORDER.index(n) for n in names] != sorted(DIM_ORDER.index(n) for n in names):
        raise SettingError(Code.DEVICE_MESH_LAYOUT, f"DeviceMesh dims {dims} are not in"
                           " meshtrain's order pp, dp_replicate, dp_shard, cp, tp: build the"
                           " mesh with its dims in that order")
    if device_mesh.size() != world_size:
        raise SettingError(Code.DEVICE_MESH_DEGREES, f"the DeviceMesh ({dims}) holds"
                           f" {device_mesh.size()} ranks but the world has {world_size}")
    if device_mesh.mesh.flatten().tolist() != list(range(world_size)):
        raise SettingError(Code.DEVICE_MESH_LAYOUT, f"the DeviceMesh ({dims}) does not hold"
                           " ranks 0..world-1 in row-major order, as meshtrain lays out its axes")
    sizes = dict(zip(names, shape, strict=True))
    return {"pp": sizes.get("pp", 1), "dp": math.prod(sizes.get(n, 1) for n in DP_DIMS),
            "cp": sizes.get("cp", 1), "tp": sizes.get("tp", 1)}


def check_asked_degrees(device_mesh: DeviceMesh, mesh_degrees: dict[str, int],
                        asked: dict[str, int | None]) -> None:
    """Degrees passed beside a DeviceMesh must be the mesh's own (None: not passed)."""
    wrong = {n: v for n, v in asked.items() if v is not None and v != mesh_degrees[n]}
    if wrong:
        names = device_mesh.mesh_dim_names
        dims = ", ".join(f"{n}={s}" for n, s in zip(names, device_mesh.mesh.shape, strict=True))
        asked_text = ", ".join(f"`{n}`={v}" for n, v in wrong.items())
        made = ", ".join(f"{n} {mesh_degrees[n]}" for n in wrong)
        raise SettingError(Code.DEVICE_MESH_DEGREES, f"DeviceMesh dims {dims} make {made} but"
                           f" {asked_text} was asked: leave the degrees out or match the mesh")


def reused_groups(device_mesh: DeviceMesh) -> dict:
    """meshtrain axis name -> the DeviceMesh's process group for it, where one dim is exactly
    that axis (pp, cp, tp, and dp when a single dim makes it) and has more than one rank."""
    names = device_mesh.mesh_dim_names
    sizes = dict(zip(names, device_mesh.mesh.shape, strict=True))
    axis_of = {"pp": "pp", "cp": "cp", "tp": "tp"}
    dp_dims = [n for n in names if n in DP_DIMS and sizes[n] > 1]
    if len(dp_dims) == 1:
        axis_of[dp_dims[0]] = "dp"
    return {axis: device_mesh.get_group(dim) for dim, axis in axis_of.items()
            if dim in sizes and sizes[dim] > 1}
