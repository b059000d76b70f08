"""Numbers in the units a reader expects: parameter counts as `4.1M` or `8.0B`, memory in the
largest binary unit that keeps the value at least 1 (`16.4 MiB`, not `0.0 GiB`)."""

from __future__ import annotations

_COUNTS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))
_MEMORY = (("GiB", 1.0), ("MiB", 2.0**10), ("KiB", 2.0**20))  # unit, its count in one GiB


def count_text(n: float) -> str:
    """`4.1M`, `124M`, `8.0B`: two or three significant digits and a unit."""
    for unit, scale in _COUNTS:
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{n:g}"


def memory_unit(gib: float) -> tuple[str, float]:
    """The unit to show `gib` (and amounts up to it) in, and its count in one GiB."""
    return next(((unit, scale) for unit, scale in _MEMORY if gib * scale >= 1), _MEMORY[-1])


def memory_text(gib: float) -> str:
    unit, scale = memory_unit(gib)
    return f"{gib * scale:.1f} {unit}"
