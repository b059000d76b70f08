"""What every vocabulary-split layer does, once for all schemes: look up the ids a rank's rows
hold (zero elsewhere, for a sum over the ranks to complete), mask the logits of padded
vocabulary rows, and serve the token table as an untied output layer.

A vocabulary of V ids is zero-padded to a multiple of the ranks it is split over; padded rows
are never looked up, and as logits they are -inf, so they take no probability and no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh


def partial_lookup(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """The embeddings of the `ids` in rows `start .. start + len(weight)` of the table, zero for
    every other id: `[..., h]`, one rank's part of a sum over the vocabulary split."""
    local_ids = ids - start
    outside = (local_ids < 0) | (local_ids >= weight.shape[0])
    out = F.embedding(local_ids.masked_fill(outside, 0), weight)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def mask_padding(logits: torch.Tensor, vocab_size: int, start: int) -> torch.Tensor:
    """`logits` of vocabulary rows `start ..` with those past the real vocabulary set to -inf
    (in place)."""
    valid = vocab_size - start
    if valid < logits.shape[-1]:
        logits[..., max(valid, 0):] = float("-inf")
    return logits


class TiedAsHead:
    """Mixin for a vocabulary-split token table (a class with `logits(hidden)`) used as an
    untied output layer: built from a dense `nn.Linear(h, V, bias=False)`, its forward is the
    logits."""

    def __init__(self, dense: nn.Linear, mesh: ParallelMesh):
        if dense.bias is not None:
            raise SettingError(Code.MODEL_UNSUPPORTED,
                               f"`tp_scheme` {mesh.tp_scheme} output layers have no bias: build"
                               " the head with bias=False")
        super().__init__(dense, mesh)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)
