"""Activation recomputation that replays the same dropout masks.

torch's non-reentrant checkpoint restores the device's default generator, but meshtrain's dropout
draws from the named streams of an RNGTracker, which advance as they are used. The recompute
context therefore puts back the streams as they were when the forward began, and afterwards
restores them to where the forward left them, so later micro-batches draw what they would have
drawn without recomputation.
"""

from __future__ import annotations

import contextlib
import functools

from torch.utils.checkpoint import checkpoint

from meshtrain.parallel.layers.rng import RNGTracker

RECOMPUTE = ("none", "selective", "full")
"""The `recompute` choices: nothing, the attention core (selective), or whole layers (full)."""


def _contexts(rng: RNGTracker):
    at_forward = rng.get_states()

    @contextlib.contextmanager
    def replay():
        after_forward = rng.get_states()
        rng.set_states(at_forward)
        try:
            yield
        finally:
            rng.set_states(after_forward)

    return contextlib.nullcontext(), replay()


def recomputed(fn, rng: RNGTracker, *args):
    """`fn(*args)` keeping only its inputs for backward; recomputed there with the same RNG."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=functools.partial(_contexts, rng))
