"""The split backward of the zero-bubble schedules: weight gradients computed later.

A zero-bubble pipeline runs each chunk's backward in two actions: `I` computes the gradient of
the chunk's input, which the previous chunk waits for, and `W` the weight gradients, which
nobody waits for, so the schedule may put them in a bubble. The layers that hold the large
weights (the linear layers of `tensor.py`, and with them the experts and the vocabulary output
layer) ask a `WeightGradients` whether to compute their weight gradient now or to hand the work
over: while the executor runs an `I` it is `deferring`, and each such backward returns only its
input gradient and queues a function that computes the weight gradients from the tensors it
keeps (the layer's input and output gradient). The executor runs the queue at the `W`.

Layers hold a reference (`weight_grads`, None unless a split-backward schedule installed one
with `defer_weight_gradients`), so nothing global decides it, and every other schedule takes
the unchanged fused path.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

WeightWork = tuple[Sequence[torch.Tensor | None], Callable[[], tuple]]
"""(parameters, a function returning their gradients in that order)."""


class WeightGradients:
    """Deferred weight-gradient work: `deferred()` collects it for one `I`."""

    def __init__(self) -> None:
        self._queue: list[WeightWork] | None = None

    @property
    def deferring(self) -> bool:
        return self._queue is not None

    def now_or_later(self, params: Sequence[torch.Tensor | None],
                     compute: Callable[[], tuple]) -> tuple:
        """`compute()` (the gradients of `params`), or, inside `deferred()`, Nones for them
        and the work queued."""
        if self._queue is None:
            return compute()
        self._queue.append((params, compute))
        return (None,) * len(params)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[list[WeightWork]]:
        """Queue the weight-gradient work of the backwards run inside into the list yielded."""
        queue: list[WeightWork] = []
        self._queue = queue
        try:
            yield queue
        finally:
            self._queue = None


def now_or_later(weight_grads: WeightGradients | None, params: Sequence[torch.Tensor | None],
                 compute: Callable[[], tuple]) -> tuple:
    """A layer backward's weight gradients: now, unless a split backward defers them."""
    if weight_grads is None:
        return compute()
    return weight_grads.now_or_later(params, compute)


def accumulate(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add the gradients into the parameters' `.grad` through autograd's own accumulation, so
    the post-accumulate hooks of data-parallel reduction fire as after a fused backward (a
    parameter listed twice is summed first and accumulated once)."""
    if pairs:
        params, grads = zip(*pairs, strict=True)
        torch.autograd.backward(list(params), list(grads))


def accumulate_deferred(kept: list[tuple[torch.Tensor, torch.Tensor]],
                        queued: list[WeightWork]) -> None:
    """A `W`: add `kept` (gradients the `I` made) and each queued function's gradients into
    `.grad` (`accumulate`) as soon as that function returns, freeing what it kept, so at most
    one layer's weight gradients exist beside the buckets (all of a chunk's at once put ZB-H1's
    peak at 14.1 MiB against 1F1B's 12.7 on `plan_memory_vs_measured.py`'s GPT at pp 2, dp 2,
    micro-batch 1; now 12.8). A parameter listed more than once is summed first and
    accumulated once, at the end."""
    listed = Counter(id(p) for p, _ in kept)
    listed.update(id(p) for params, _ in queued for p in params if p is not None)
    repeated: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        repeated.extend((p, g) for p, g in pairs if listed[id(p)] > 1)
        accumulate([(p, g) for p, g in pairs if listed[id(p)] == 1])

    add(kept)
    queued.reverse()
    while queued:
        params, compute = queued.pop()
        with torch.no_grad():
            grads = compute()
        add([(p, g) for p, g in zip(params, grads, strict=True) if p is not None])
        del compute, grads
    accumulate(repeated)


def defer_weight_gradients(model: nn.Module) -> WeightGradients:
    """Give every layer of `model` that declares a `weight_grads` attribute (the layers that
    can defer) one `WeightGradients` to consult."""
    weight_grads = WeightGradients()
    for module in model.modules():
        if hasattr(module, "weight_grads"):
            module.weight_grads = weight_grads
    return weight_grads
