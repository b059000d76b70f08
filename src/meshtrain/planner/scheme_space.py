"""The search's tensor-parallel schemes at one tp: which (scheme, depth) grids it tries, and the
micro-batches each can split.

Unfixed, the search tries 1d and every grid tp forms (2d: q x q; 2.5d: d x q x q for each depth
d >= 2, d = 1 being 2d; 3d: q^3), but grids only where they run: no context parallelism, no MoE
layers, and sequence parallelism off. A fixed scheme or depth is tried as given, so that
`ParallelPlan.validate` rejects what cannot run with its reason.
"""

from __future__ import annotations

from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schemes.registry import SCHEMES, tp_scheme

Grid = tuple[str, "int | None"]


def forms(tp: int, scheme: str, depth: int | None) -> bool:
    """Whether `tp` ranks arrange as `scheme`'s grid (with `depth`)."""
    return tp_scheme(scheme).forms(tp, depth)


def grid_choices(tp: int, fixed: dict[str, object], *, cp: int, moe: bool) -> list[Grid]:
    """The (scheme, depth) pairs to try at `tp`: a fixed scheme as given, else every scheme
    that combines with the combination's cp and MoE layers."""
    depth, given = fixed.get("tp_depth"), "tp_scheme" in fixed
    schemes = [tp_scheme(fixed["tp_scheme"])] if given else [
        s for s in SCHEMES.values()
        if (cp == 1 or "cp" in s.supports) and (not moe or "moe" in s.supports)]
    pairs: list[Grid] = []
    for scheme in schemes:
        depths = [depth] if depth is not None else scheme.depth_choices(tp, fixed=given)
        pairs += [(scheme.name, d) for d in depths
                  if given or scheme.forms(tp, d) and _fits_fixed(tp, scheme.name, d, fixed)]
    return pairs or [(ParallelPlan().tp_scheme, depth)]


def _fits_fixed(tp: int, scheme: str, depth: int | None, fixed: dict[str, object]) -> bool:
    """A searched (not fixed) grid is tried only where the fixed fields allow one: sequence
    parallelism only where the scheme combines with it, and a fixed micro-batch its batch split
    divides."""
    plan = ParallelPlan(tp=tp, tp_scheme=scheme, tp_depth=depth)
    parts = plan.batch_parts
    return (not fixed.get("sequence_parallel") or "sequence_parallel" in plan.scheme.supports) \
        and fixed.get("micro_batch", parts) % parts == 0


def micro_batches(candidates: list[int], tp: int, scheme: str, depth: int | None,
                  most: int) -> list[int]:
    """The micro-batches a grid splits evenly over its batch split k (k = 1 for 1d), up to
    `most` sequences per rank (k x most per micro-batch); the smallest candidate when none
    does, for validation to say why."""
    parts = ParallelPlan(tp=tp, tp_scheme=scheme, tp_depth=depth).batch_parts \
        if forms(tp, scheme, depth) else 1
    even = [m for m in candidates if m % parts == 0 and m <= most * parts]
    return even or candidates[:1]
