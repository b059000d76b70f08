"""Which keys each query attends to, as data: causal always, a sliding window of `window`
positions (Mistral: position i sees j with i - window < j <= i), and documents (packed
sequences: a token sees only tokens of its own document).

The family says the window (its config), the run's data the documents (`document_ids` of the
token ids, from the token file's end-of-document id). One builder, `AttentionMask.allowed`,
serves every attention path: the eager and SDPA kernels, ring attention's blocks, Ulysses'
gathered sequences, and the key/value cache (which keeps at most `window` positions).

Positions here are indices into the packed sequence, not the positions a model embeds: with
`reset_positions` those restart at every document (`document_positions`), the mask does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMask:
    """`window`: keys at most `window - 1` positions before the query (None: all of them).
    `documents`: `[b, S]` the document index of every token of the whole sequences (S, not this
    rank's share: context-parallel ranks look up the tokens they hold by position)."""

    window: int | None = None
    documents: torch.Tensor | None = None

    @property
    def causal_only(self) -> bool:
        """Nothing but the causal mask (the fused kernels' own `is_causal`)."""
        return self.window is None and self.documents is None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool `[b or 1, 1, len(q_pos), len(k_pos)]`, True where the query at sequence index
        `q_pos[i]` may attend the key at `k_pos[j]` (broadcasts over heads)."""
        distance = q_pos[:, None] - k_pos[None, :]
        ok = distance >= 0
        if self.window is not None:
            ok = ok & (distance < self.window)
        ok = ok[None, None]
        if self.documents is not None:
            docs = self.documents.to(q_pos.device)
            ok = ok & (docs[:, None, q_pos, None] == docs[:, None, None, k_pos])
        return ok

    def visible_span(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
        """Whether any query of `q_pos` may attend any key of `k_pos` (a block worth computing);
        documents are not consulted (a document boundary rarely empties a whole block)."""
        q_lo, q_hi, k_lo, k_hi = q_pos.min(), q_pos.max(), k_pos.min(), k_pos.max()
        if k_lo > q_hi:
            return False
        return self.window is None or bool(q_lo - k_hi < self.window)


CAUSAL = AttentionMask()
"""The plain causal mask of every family without a window, on unpacked data."""


def document_ids(ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """`[b, s]` token ids -> the index of each token's document within its row: documents end
    with (and include) the `eod_id` token."""
    ends = (ids == eod_id).to(torch.int32)
    return torch.cumsum(ends, dim=-1) - ends


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """`[b, s]` document ids -> positions that restart at 0 at every document's first token."""
    index = torch.arange(documents.shape[-1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first
