"""Functions that stay eager inside `torch.compile`d blocks, marked without importing dynamo.

`torch.compiler.disable` imports `torch._dynamo` (about 1 s of CPU per process) when it is
applied, and most processes (every rank of an eager run, every command) never compile. So a
function is marked with `eager_under_compile`, which calls it directly outside compiled code;
`arm_eager_functions` (called by `compile_blocks` before it compiles) builds each marked
function's disabled form, which compiled code then calls as a graph break. A function first
reached by a compile nobody armed for (a user's own `torch.compile`) is armed there, at the cost
of one recompile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_ARMING: list[Callable[[], None]] = []  # one per marked function, fixed at import


def eager_under_compile(fn: Callable) -> Callable:
    """`fn`, run eagerly where compiled code calls it (as `torch.compiler.disable(fn)` would)."""
    disabled: list[Callable] = []

    def arm() -> None:
        if not disabled:
            disabled.append(torch.compiler.disable(fn))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        arm()
        return disabled[0](*args, **kwargs)

    _ARMING.append(arm)
    return call


def arm_eager_functions() -> None:
    """Build the disabled form of every marked function, before anything is compiled."""
    for arm in _ARMING:
        arm()
