"""The search's tensor-parallel schemes at one tp: which (scheme, depth) grids it tries, and the
micro-batches each can split.

Unfixed, the search tries 1d and every grid tp forms (2d: q x q; 2.5d: d x q x q for each depth
d >= 2, d = 1 being 2d; 3d: q^3), but grids only where they run: no context parallelism, no MoE
layers, and sequence parallelism off. A fixed scheme or depth is tried as given, so that
`ParallelPlan.validate` rejects what cannot run with its reason.
"""

from __future__ import annotations

from meshtrain.mesh import resolve_tp_grid
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.layout import SCHEMES

Grid = tuple[str, "int | None"]


def forms(tp: int, scheme: str, depth: int | None) -> bool:
    """Whether `tp` ranks arrange as `scheme`'s grid (with `depth`)."""
    try:
        resolve_tp_grid(tp, scheme, depth)
    except ValueError:
        return False
    return True


def grid_choices(tp: int, fixed: dict[str, object], *, cp: int, moe: bool) -> list[Grid]:
    """The (scheme, depth) pairs to try at `tp`."""
    depth, given = fixed.get("depth"), "scheme" in fixed
    schemes = [fixed["scheme"]] if given else ["1d"] if cp > 1 or moe else list(SCHEMES)
    pairs: list[Grid] = []
    for scheme in schemes:
        depths = [depth]
        if scheme == "2.5d" and depth is None:
            depths = [d for d in range(1 if given else 2, tp + 1) if forms(tp, scheme, d)] \
                or ([None] if given else [])
        pairs += [(scheme, d) for d in depths
                  if given or forms(tp, scheme, d) and _fits_fixed(tp, scheme, d, fixed)]
    return pairs or [("1d", depth)]


def _fits_fixed(tp: int, scheme: str, depth: int | None, fixed: dict[str, object]) -> bool:
    """A searched (not fixed) grid is tried only where the fixed fields allow one: no
    sequence parallelism, and a fixed micro-batch its batch split divides."""
    if scheme == "1d":
        return True
    parts = ParallelPlan(tp=tp, tp_scheme=scheme, tp_depth=depth).batch_parts
    return not fixed.get("sp") and fixed.get("mb", parts) % parts == 0


def micro_batches(candidates: list[int], tp: int, scheme: str, depth: int | None,
                  most: int) -> list[int]:
    """The micro-batches a grid splits evenly over its batch split k (k = 1 for 1d), up to
    `most` sequences per rank (k x most per micro-batch); the smallest candidate when none
    does, for validation to say why."""
    parts = ParallelPlan(tp=tp, tp_scheme=scheme, tp_depth=depth).batch_parts \
        if forms(tp, scheme, depth) else 1
    even = [m for m in candidates if m % parts == 0 and m <= most * parts]
    return even or candidates[:1]
