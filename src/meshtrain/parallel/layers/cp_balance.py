"""Which tokens of a sequence each context-parallel rank holds: the layout.

Head-tail (`head_tail`): the sequence is cut into 2 x cp chunks and rank r holds chunks r and
2cp-1-r, which gives every rank the same causal work over one long document. Packed documents
break that: ring attention skips the chunk pairs no document spans, so a rank whose chunks sit in
short documents computes less than one whose chunks sit in a long one.

Work-balanced (`work_balanced`, once per micro-batch, on the host, from the document ids): the
sequence is cut into cp x `PIECES` chunks; a query chunk's work is the number of key
chunks the ring computes for it (itself and every earlier chunk a document spans to it, in any
row of the micro-batch), which does not depend on who holds the keys, since every key chunk
visits every rank. Assigning chunks to ranks is then a partition with equal counts: the largest
work first, each to the least-loaded rank with room, then swaps between the most and least
loaded. Finer chunks also compute fewer masked scores (a chunk pair is skipped or computed
whole), so of head-tail and each cut the one whose slowest rank computes least is kept.
Every rank holds the same number of tokens, so nothing downstream (pipeline transfers, the loss
average) changes; positions, documents and targets follow the tokens by indexing with the
layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CP_BALANCES = ("work", "head-tail")
"""The `cp_balance` choices: the work-balanced layout of packed documents, or head-tail always."""
PIECES = (8, 16)
"""Chunks per rank the work-balanced layout tries, coarsest first: finer ones balance closer, in
smaller ring sub-blocks (a chunk pair is the unit the ring computes or skips)."""
TOLERANCE = 1.05
"""The most loaded rank's work over the least's that counts as balanced."""


@dataclass(frozen=True, eq=False)
class TokenLayout:
    """`ranks[r]`: the sequence indices rank r holds, in its order (host tensors of equal
    length); each is `pieces` runs of contiguous indices of equal length."""

    ranks: tuple[torch.Tensor, ...]
    pieces: int

    def __len__(self) -> int:
        return len(self.ranks)


def head_tail(seq_len: int, cp: int) -> TokenLayout:
    """Rank r holds chunks r and 2cp-1-r of 2 x cp."""
    chunk = seq_len // (2 * cp)
    ranks = tuple(torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                             torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)])
                  for r in range(cp))
    return TokenLayout(ranks, 2)


def chunk_work(documents: torch.Tensor, chunks: int) -> torch.Tensor:
    """`[b, S]` document ids -> `[chunks]` the key chunks the ring computes for each query
    chunk: itself, and each earlier one whose last token shares a document with the query
    chunk's first token in some row (document ids never decrease along a row)."""
    size = documents.shape[-1] // chunks
    starts = torch.arange(chunks) * size
    first, last = documents[:, starts], documents[:, starts + size - 1]
    spans = (last[:, None, :] == first[:, :, None]).any(dim=0)  # [query chunk, key chunk]
    visible = torch.tril(spans, diagonal=-1) | torch.eye(chunks, dtype=torch.bool)
    return visible.sum(dim=1)


def _partition(work: torch.Tensor, cp: int) -> list[list[int]]:
    """Chunks into cp groups of equal count: the largest work first, each to the least-loaded
    group with room (ties: the lower chunk, the lower group), then `_even_out`."""
    per_rank, w = len(work) // cp, [int(x) for x in work]
    groups: list[list[int]] = [[] for _ in range(cp)]
    loads = [0] * cp
    for chunk in sorted(range(len(w)), key=lambda i: (-w[i], i)):
        rank = min((r for r in range(cp) if len(groups[r]) < per_rank), key=loads.__getitem__)
        groups[rank].append(chunk)
        loads[rank] += w[chunk]
    _even_out(groups, w)
    return [sorted(g) for g in groups]


def _even_out(groups: list[list[int]], w: list[int]) -> None:
    """Swap a chunk of the most loaded group with a lighter one of the least loaded while that
    narrows their gap (greedy placement leaves a unit or two of small works apart)."""
    for _ in range(len(w) * len(groups)):  # each swap narrows a gap: a bound, never reached
        loads = [sum(w[c] for c in g) for g in groups]
        top, low = loads.index(max(loads)), loads.index(min(loads))
        gap = loads[top] - loads[low]
        swaps = [(abs(gap - 2 * (w[a] - w[b])), i, j) for i, a in enumerate(groups[top])
                 for j, b in enumerate(groups[low]) if 0 < w[a] - w[b] < gap]
        if not swaps:
            return
        _, i, j = min(swaps)
        groups[top][i], groups[low][j] = groups[low][j], groups[top][i]


def rank_work(layout: TokenLayout, documents: torch.Tensor) -> list[int]:
    """Score elements each rank's ring computes (chunk pairs times their size squared)."""
    seq_len = documents.shape[-1]
    chunks = len(layout) * layout.pieces
    work, size = chunk_work(documents, chunks), seq_len // chunks
    return [int(work[r[::size] // size].sum()) * size * size for r in layout.ranks]


def _assigned(documents: torch.Tensor, cp: int, pieces: int) -> TokenLayout:
    """cp x `pieces` chunks partitioned by their work."""
    size = documents.shape[-1] // (cp * pieces)
    groups = _partition(chunk_work(documents, cp * pieces), cp)
    return TokenLayout(tuple(torch.cat([torch.arange(c * size, (c + 1) * size) for c in g])
                             for g in groups), pieces)


def work_balanced(documents: torch.Tensor, cp: int) -> TokenLayout:
    """The layout whose most loaded rank computes least on these documents `[b, S]` (host):
    of head-tail and the cuts of `PIECES` chunks per rank, the coarsest within `TOLERANCE` of
    the least (finer chunks skip more and balance closer, in smaller blocks)."""
    seq_len = documents.shape[-1]
    layouts = [head_tail(seq_len, cp)] + [_assigned(documents, cp, m) for m in PIECES
                                          if seq_len % (cp * m) == 0]
    most = [max(rank_work(layout, documents)) for layout in layouts]
    return next(layout for layout, work in zip(layouts, most, strict=True)
                if work <= TOLERANCE * min(most))
