"""The tensor-parallel schemes meshtrain has, by the `tp_scheme` name: the one list.

Adding a scheme is its files (a `TPScheme`, its `LayerFactory` and layers) and one line here.
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError, alternatives
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.schemes.cube import CUBE_3D
from meshtrain.parallel.schemes.factory import LayerFactory
from meshtrain.parallel.schemes.megatron1d import MEGATRON_1D
from meshtrain.parallel.schemes.scheme import TPScheme
from meshtrain.parallel.schemes.summa import SUMMA_2D, TESSERACT_2P5D

SCHEMES: dict[str, TPScheme] = {
    scheme.name: scheme for scheme in (MEGATRON_1D, SUMMA_2D, TESSERACT_2P5D, CUBE_3D)}


def tp_scheme(name: str) -> TPScheme:
    """The scheme called `name`; SettingError naming the choices otherwise."""
    if name not in SCHEMES:
        raise SettingError(Code.CHOICE, f"`tp_scheme` must be one of {', '.join(SCHEMES)}, got"
                                        f" {name!r}")
    return SCHEMES[name]


def tp_grid(name: str, tp: int, depth: int | None = None) -> dict[str, int]:
    """The TP block of `tp` ranks arranged as scheme `name`'s grid (`TPScheme.grid`); a depth
    only for a scheme that takes one."""
    scheme = tp_scheme(name)
    if depth is not None and not scheme.takes_depth:
        takers = [s.name for s in SCHEMES.values() if s.takes_depth]
        raise SettingError(Code.GRID_DEPTH, f"`tp_depth` applies to `tp_scheme`"
                                            f" {alternatives(takers)} only (got {name}): drop"
                                            " it")
    return scheme.grid(tp, depth)


def layer_factory(plan, mesh: ParallelMesh) -> LayerFactory:
    """The layers of `plan`'s scheme on `mesh`, whose TP block must be arranged for it (one
    rank is every scheme's line)."""
    if mesh.tp.size == 1:
        return MEGATRON_1D.factory(plan, mesh)
    if mesh.tp_scheme != plan.tp_scheme:
        raise SettingError(Code.MESH_SCHEME, (
            f"the mesh's TP block is arranged for `tp_scheme` {mesh.tp_scheme}, the plan asks for"
            f" {plan.tp_scheme}: build the mesh from the plan"))
    return tp_scheme(plan.tp_scheme).factory(plan, mesh)
