"""Which keys each query attends to, as data: causal always, a sliding window of `window`
positions (Mistral: position i sees j with i - window < j <= i), and documents (packed
sequences: a token sees only tokens of its own document).

The family says the window (its config), the run's data the documents (`document_ids` of the
token ids, from the token file's end-of-document id). One rule, `_visible`, serves every
attention path in two forms: `AttentionMask.allowed`, a dense bool mask (the eager and SDPA
kernels, ring attention's blocks, Ulysses' gathered sequences on the CPU, the key/value cache
which keeps at most `window` positions), and `AttentionMask.mask_mod`, flex_attention's
per-element form, from which a GPU builds block masks instead (`layers/flex.py`).

Positions here are indices into the packed sequence, not the positions a model embeds: with
`reset_positions` those restart at every document (`document_positions`), the mask does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshtrain.parallel.layers.cp_balance import TokenLayout


def _visible(window: int | None, documents: torch.Tensor | None, row, q, k) -> torch.Tensor:
    """The rule, on broadcasting tensors of batch rows and query and key sequence indices (or
    on the scalars flex_attention gives a mask_mod): causal, within `window`, same document."""
    distance = q - k
    ok = distance >= 0
    if window is not None:
        ok = ok & (distance < window)
    if documents is not None:
        ok = ok & (documents[row, q] == documents[row, k])
    return ok


@dataclass(frozen=True)
class AttentionMask:
    """`window`: keys at most `window - 1` positions before the query (None: all of them).
    `documents`: `[b, S]` the document index of every token of the whole sequences (S, not this
    rank's share: context-parallel ranks look up the tokens they hold by position).
    `layout`: which sequence indices each context-parallel rank holds (`layers/cp_balance.py`),
    when a micro-batch's tokens were assigned by its documents' work; None: head-tail.
    `block_masks`: the flex block masks built for this mask (`layers/flex.py`), so the layers
    of one forward, which share the mask, build each once."""

    window: int | None = None
    documents: torch.Tensor | None = None
    layout: TokenLayout | None = None
    block_masks: dict = field(default_factory=dict, compare=False, repr=False)
    _host: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def causal_only(self) -> bool:
        """Nothing but the causal mask (the fused kernels' own `is_causal`)."""
        return self.window is None and self.documents is None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool `[b or 1, 1, len(q_pos), len(k_pos)]`, True where the query at sequence index
        `q_pos[i]` may attend the key at `k_pos[j]` (broadcasts over heads)."""
        documents, rows = None, None
        if self.documents is not None:
            documents = self.documents.to(q_pos.device)
            rows = torch.arange(len(documents), device=q_pos.device)[:, None, None, None]
        return _visible(self.window, documents, rows, q_pos[None, None, :, None],
                        k_pos[None, None, None, :])

    def mask_mod(self, q_start: int, k_start: int, device: torch.device) -> Callable:
        """The rule as flex_attention's `mask_mod(b, h, i, j)`: query i is at sequence index
        `q_start + i`, key j at `k_start + j` (both sides contiguous, as the local kernels and
        Ulysses' gathered sequences are)."""
        window = self.window
        documents = None if self.documents is None else self.documents.to(device)

        def mask_mod(b, h, i, j):
            return _visible(window, documents, b, q_start + i, k_start + j)

        return mask_mod

    def visible_span(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
        """Whether any query of `q_pos` may attend any key of `k_pos` (host positions: a block
        worth computing), never False for a block with a visible pair. Where every key
        precedes every query, the closest pair (the last key, the first query) decides, since
        document ids never decrease along a row; where they interleave the answer is yes,
        which is exact for contiguous runs of positions (the ring's chunks: a token and
        itself)."""
        q_lo, q_hi, k_lo, k_hi = (int(p) for p in (q_pos.min(), q_pos.max(), k_pos.min(),
                                                   k_pos.max()))
        if k_lo > q_hi or (self.window is not None and q_lo - k_hi >= self.window):
            return False
        if self.documents is None or k_hi >= q_lo:
            return True
        documents = self.host_documents()
        return bool((documents[:, k_hi] == documents[:, q_lo]).any())

    def host_documents(self) -> torch.Tensor:
        """`documents` on the host, copied once per mask (one forward's layers share it)."""
        if "documents" not in self._host:
            self._host["documents"] = self.documents.cpu()
        return self._host["documents"]


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
