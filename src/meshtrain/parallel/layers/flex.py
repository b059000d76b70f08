"""Masked attention on a GPU without a dense mask: flex_attention over a `BlockMask` built from
`AttentionMask.mask_mod` (the same rule as the dense `allowed`).

A block mask stores, per 128 x 128 tile of the score matrix, whether the tile is empty, full or
partial; the fused kernel skips empty tiles and evaluates the rule only inside partial ones, so
a window or document mask costs neither an s x t tensor nor the masked work. Both flex_attention
and create_block_mask must be compiled to do that (uncompiled, flex_attention materialises every
score and create_block_mask the whole s x t mask), so on a GPU they are compiled once per
process, lazily; inside compiled code (`compile`) the enclosing compile traces them instead.

The CPU runs them eagerly, and torch 2.13's flex_attention has no CPU backward: the CPU's own
paths stay the dense ones (`attention.attention_kernel`), and its tests call
`flex_attention_masked` directly, forward only.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from meshtrain.parallel.layers.masks import AttentionMask


@functools.cache
def _compiled() -> tuple:
    """flex_attention and create_block_mask compiled, built at the first GPU call (not at
    import: torch.compile imports dynamo, about 1 s, which eager CPU processes never need)."""
    return torch.compile(flex_attention), torch.compile(create_block_mask)


def _kernels(device: torch.device) -> tuple:
    """The compiled pair on a GPU outside compiled code, else the plain functions."""
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled()
    return flex_attention, create_block_mask


def block_mask(mask: AttentionMask, s: int, t: int, k_start: int,
               device: torch.device) -> BlockMask:
    """The block mask of `s` queries (the last of the keys' tokens) over `t` keys from sequence
    index `k_start`; one per mask and shape (`mask.block_masks`), except for the shared plain
    causal mask and inside compiled code (whose graph must not read or grow the cache), which
    build it every call."""
    if mask.causal_only or torch.compiler.is_compiling():
        return _build(mask, s, t, k_start, device)
    key = (s, t, k_start, device)
    if key not in mask.block_masks:
        mask.block_masks[key] = _build(mask, s, t, k_start, device)
    return mask.block_masks[key]


def _build(mask: AttentionMask, s: int, t: int, k_start: int, device: torch.device) -> BlockMask:
    """create_block_mask over the mask's rule: a row of tiles per document row (one for
    all rows without documents), shared by every head."""
    batch = None if mask.documents is None else mask.documents.shape[0]
    return _kernels(device)[1](mask.mask_mod(k_start + t - s, k_start, device), batch, None, s,
                               t, device=device)


def flex_attention_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: AttentionMask, k_start: int = 0) -> torch.Tensor:
    """Attention `[b, a, s, d]` under `mask`, keys `[b, kv, t, d]` from sequence index `k_start`
    (kv divides a: grouped-query attention runs natively). No dropout: flex has none, so a
    core with dropout keeps the dense SDPA mask."""
    attend = _kernels(q.device)[0]
    blocks = block_mask(mask, q.shape[-2], k.shape[-2], k_start, q.device)
    return attend(q, k, v, block_mask=blocks, enable_gqa=k.shape[1] != q.shape[1])
