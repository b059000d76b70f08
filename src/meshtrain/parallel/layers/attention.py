"""The attention core: softmax(QK^T / sqrt(d))V over this rank's heads, under an
`AttentionMask` (causal; a sliding window; documents of packed sequences).

It runs one of: torch's SDPA, an explicit eager path (whose saved tensors match the
activation-memory formulas), ring attention, Ulysses all-to-all or both (hybrid: all-to-all
inside, ring outside) over the context-parallel axis.
A mask other than plain causal is a dense bool tensor on the CPU and, on a GPU, a flex_attention
block mask (`layers/flex.py`; also under Ulysses, whose gathered sequences take the local core),
except with dropout, the eager path and the ring's blocks, which stay dense there too.
Dropout on the probabilities draws from the per-TP-rank stream (heads differ per TP rank, so must
their masks). Selective recomputation recomputes only this core in backward. Grouped-query
attention (fewer key/value heads than query heads) runs natively in SDPA; the other paths repeat
each key/value head for its query heads first.

With a key/value cache (generation) the queries are the last of the keys' tokens: each query sees
the keys up to its own position (the causal mask aligned to the bottom right). The keys start at
sequence index `k_start` (a windowed cache drops the oldest).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.layers.context_parallel import (
    hybrid_attention,
    ring_attention,
    ulysses_attention,
)
from meshtrain.parallel.layers.eager import eager_under_compile
from meshtrain.parallel.layers.flex import flex_attention_masked
from meshtrain.parallel.layers.masks import CAUSAL, AttentionMask
from meshtrain.parallel.layers.recompute import recomputed
from meshtrain.parallel.layers.rng import TENSOR_PARALLEL, RNGTracker

ATTENTION_KERNELS = ("sdpa", "eager")
"""The `attention` choices: torch's fused kernel, or explicit softmax(QK^T)V."""
CP_MODES = ("ring", "all2all", "hybrid")
"""The `cp_mode` choices: K/V blocks around a ring, Ulysses' all-to-all over heads, or the
all-to-all over `cp_a2a` ranks inside and the ring outside."""


def eager_attention(q, k, v, p: float, mask: AttentionMask = CAUSAL,
                    k_start: int = 0) -> torch.Tensor:
    """Explicit attention `[b, a, s, d]` under `mask`: saves the s x s probabilities (and mask).
    Keys may be more than the queries (cached ones before them, from sequence index
    `k_start`)."""
    q_pos, k_pos = _query_key_positions(q, k, k_start)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # [b, a/tp, s, t]
    probs = scores.masked_fill(~mask.allowed(q_pos, k_pos), float("-inf")).softmax(dim=-1)
    if p > 0.0:
        probs = F.dropout(probs, p, training=True)
    return probs @ v


def _query_key_positions(q, k, k_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence indices of the keys (from `k_start`) and of the queries (the last of them)."""
    s, t = q.shape[-2], k.shape[-2]
    k_pos = torch.arange(k_start, k_start + t, device=q.device)
    return k_pos[t - s:], k_pos


class AttentionCore(nn.Module):
    """`core(q, k, v, rng, mask)`: q `[b, a, s, d]`, k and v `[b, kv, t, d]` (kv divides a) for
    this rank's heads and tokens -> `[b, a, s, d]`; t = s, or t > s with a key/value cache
    (whose tokens come first, from sequence index `k_start`). No parameters. `cp_split`:
    under `cp_mode` hybrid, the cp axis's (cp_a2a, cp_ring) sub-axes."""

    def __init__(self, *, dropout: float, eager: bool, cp_axis: MeshAxis, cp_mode: str,
                 recompute: bool, cp_split: tuple[MeshAxis, MeshAxis] | None = None):
        super().__init__()
        self.dropout, self.eager = dropout, eager
        self.cp_axis, self.cp_mode, self.cp_split = cp_axis, cp_mode, cp_split
        self.recompute = recompute

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rng: RNGTracker,
                mask: AttentionMask = CAUSAL, k_start: int = 0) -> torch.Tensor:
        def core(q, k, v):
            if not (self.dropout and self.training):  # nothing random: skip the RNG swap
                return self._core(q, k, v, mask, k_start)
            return self._dropped_core(q, k, v, rng, mask, k_start)

        if self.recompute and self.training:
            return recomputed(core, rng, q, k, v)
        return core(q, k, v)

    @eager_under_compile  # its masks come from meshtrain's stream
    def _dropped_core(self, q, k, v, rng: RNGTracker, mask: AttentionMask, k_start: int):
        with rng.fork(TENSOR_PARALLEL):
            return self._core(q, k, v, mask, k_start)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              k_start: int) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.cp_axis.size > 1:
            k, v = _repeat_heads(k, q), _repeat_heads(v, q)
            seq_len = q.shape[-2] * self.cp_axis.size
            if self.cp_mode == "ring":
                return ring_attention(q, k, v, self.cp_axis, seq_len, mask)
            if self.cp_mode == "hybrid":
                return hybrid_attention(q, k, v, *self.cp_split, seq_len, mask)
            return ulysses_attention(q, k, v, self.cp_axis, seq_len,
                                     lambda q, k, v: self._local(q, k, v, mask), mask)
        return self._local(q, k, v, mask, p, k_start)

    def _local(self, q, k, v, mask: AttentionMask, p: float = 0.0,
               k_start: int = 0) -> torch.Tensor:
        if self.eager:
            return eager_attention(q, _repeat_heads(k, q), _repeat_heads(v, q), p, mask, k_start)
        s, t = q.shape[-2], k.shape[-2]
        kernel = attention_kernel(q.device, mask, p, s, t)
        if kernel == "flex":
            return flex_attention_masked(q, k, v, mask, k_start)
        # SDPA's is_causal aligns the mask to the top left and knows no window or documents
        allowed = mask.allowed(*_query_key_positions(q, k, k_start)) if kernel == "dense" else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p,
                                              is_causal=kernel == "causal",
                                              enable_gqa=k.shape[1] != q.shape[1])


def attention_kernel(device: torch.device, mask: AttentionMask, p: float, s: int,
                     t: int) -> str:
    """What the (non-eager) local core runs for `s` queries over `t` keys: "causal" (SDPA's
    `is_causal`), "unmasked" (one query sees every cached key), "flex" (a GPU's block mask,
    never a dense s x t one) or "dense" (SDPA with `mask.allowed`: on the CPU, whose golden
    runs it keeps bitwise; with dropout, which flex has not; for one query, whose mask is a
    row and would compile flex again at every cache length)."""
    if mask.causal_only and s == t:
        return "causal"
    if mask.causal_only and s == 1:
        return "unmasked"
    if device.type == "cuda" and p == 0.0 and s > 1:
        return "flex"
    return "dense"


def _repeat_heads(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Key/value heads `[b, kv, s, d]` repeated for their query heads: `[b, a, s, d]`."""
    groups = q.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)
