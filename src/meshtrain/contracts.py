"""What models and the parallel runtime agree on, defined below both: which part of the model
a pipeline stage builds (`StageSpec`), what the strategy may know about parameters
(`ParameterRoles`), what layers report beside their output (`AuxiliaryOutputs`), and what one
micro-batch hands the model (`MicroBatch`).

`models/` builds to these and `parallel/` reads them, so neither imports the other's classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class StageSpec:
    """Which part of the model this rank builds (the whole model without a pipeline): one
    contiguous range of layers per model chunk it holds (several under an interleaved schedule),
    the embedding before its first chunk, the final norm and output layer after its last."""

    chunks: tuple[range, ...]
    has_embedding: bool = True
    has_head: bool = True

    @property
    def layers(self) -> list[int]:
        return [i for chunk in self.chunks for i in chunk]


@dataclass
class ParameterRoles:
    """What the parallel strategy must know about a model's parameters."""

    tied: list[nn.Parameter]
    """Held by another pipeline stage too (the word embedding the last stage uses as its output
    layer): the copies' gradients are summed over the `embed` axis so they stay equal."""
    counted_elsewhere: set[int]
    """ids of copies the gradient norm leaves out (the last stage's tied copy)."""
    experts: set[int]
    """ids of expert parameters: replicated over the `edp` axis only, not over dp x cp."""
    units: list[tuple[nn.Module, list[nn.Parameter]]]
    """What ZeRO-3 gathers at once, in forward order: the model's own parameters (embedding,
    final norm, output layer), then each transformer block's."""
    reused: list[nn.Parameter] = field(default_factory=list)
    """Used by two model chunks of this rank (the tied embedding when one rank holds the first
    chunk and the last, as zb-v's rank 0 does): its gradient arrives in two backward passes per
    micro-batch, so it is reduced after the step's last backward (in `wait()`)."""


@dataclass
class AuxiliaryOutputs:
    """What layers report beside their output during one forward: a loss to add to the
    training objective (MoE routing losses, already weighted) and per-layer statistics."""

    loss: torch.Tensor | float = 0.0
    routing: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Per MoE layer, in forward order: tokens_per_expert [E], dropped, assigned, aux_loss."""


class MicroBatch(NamedTuple):
    """One micro-batch as this rank runs it: token ids and targets (this rank's share of each
    sequence), the positions the model embeds (`[s]`, or `[b, s]` restarting at each document),
    the document index of every token of the whole sequences (`[b, S]`; None: no document mask),
    the count the summed loss is divided by (None: this rank's non-ignored targets) and which
    tokens each context-parallel rank holds when not head-tail (a `TokenLayout`)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    documents: torch.Tensor | None = None
    loss_tokens: torch.Tensor | None = None
    layout: object | None = None  # parallel/layers/cp_balance.TokenLayout (a lower layer here)
