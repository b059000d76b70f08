"""Multi-head latent attention (MLA; DeepSeek-V2/V3): keys and values come from one compressed
latent per token, and one rotary key shared by all heads, so a key/value cache holds
`kv_lora_rank + qk_rope_head_dim` numbers per token and layer instead of every head's keys and
values.

Per token x `[h]`: the query is `q_up(norm(q_down(x)))` (or `q(x)` without a query rank), each
head `qk_nope_head_dim` non-rotary then `qk_rope_head_dim` rotary dimensions; `kv_down(x)` gives
the latent `c` (`kv_lora_rank`) and the shared rotary key; `kv_up(norm(c))` gives each head's
non-rotary key and its value (`v_head_dim`). The math is transformers' `DeepseekV3Attention`.

Tensor parallelism (1D): the up-projections split by heads (column-parallel), the output
projection is row-parallel, and the down-projections and their norms stay whole on every rank
(`factory.replicated`), computed on this rank's hidden states (its s/tp tokens under sequence
parallelism, whose all-gather then moves the latent, not the hidden states). docs/guide.md
("Multi-head latent attention") counts the bytes of that choice.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshtrain.models.blocks import Rotary
from meshtrain.models.kv_cache import LayerCache
from meshtrain.parallel.layers.masks import CAUSAL, AttentionMask
from meshtrain.parallel.layers.rng import RNGTracker


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for positions stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, *, theta: float, factor: float, original: int,
                     beta_fast: float, beta_slow: float) -> torch.Tensor:
    """YaRN's rotary inverse frequencies `[dim/2]` (Peng et al. 2023, as transformers computes
    them, truncated bounds): the dimensions turning fewer than `beta_slow` times over the
    original context are interpolated (divided by `factor`), those turning more than
    `beta_fast` times kept, and a linear ramp between."""
    def turns_dim(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(turns_dim(beta_fast)), 0)
    high = min(math.ceil(turns_dim(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (1.0 / (factor * pos)) * (1 - keep) + (1.0 / pos) * keep


def deinterleaved(x: torch.Tensor) -> torch.Tensor:
    """Rotary pairs (x0, x1), (x2, x3), ... -> the half-split layout (x0, x2, ... | x1, x3,
    ...): transformers' `rope_interleave`, rotated then as `Rotary` rotates."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """MLA over this rank's heads. `q` is either one column-parallel projection or a
    (`q_down`, `q_norm`, `q_up`) triple; `kv_down` and the norms are whole on every rank;
    `into_heads` carries the shared rotary key into the heads' region (the factory's
    `into_heads`); `rope_scale` multiplies the rotated dimensions (YaRN's attention factor) and
    `q_scale` the queries (YaRN's softmax correction, `mscale_all_dim`). With a layer's `cache`
    the normed latent and the rotated shared key are what is cached."""

    def __init__(self, *, q: nn.Module | tuple[nn.Module, nn.Module, nn.Module],
                 kv_down: nn.Module, kv_norm: nn.Module, kv_up: nn.Module, proj: nn.Module,
                 core: nn.Module, rotary: Rotary, into_heads, dims: tuple[int, int, int, int],
                 interleave: bool, rope_scale: float = 1.0, q_scale: float = 1.0):
        super().__init__()
        if isinstance(q, tuple):
            self.q_down, self.q_norm, self.q_up = q
        else:
            self.q = q
        self.kv_down, self.kv_norm, self.kv_up, self.proj = kv_down, kv_norm, kv_up, proj
        self.core, self.rotary, self.into_heads = core, rotary, into_heads
        self.rank, self.nope, self.rope, self.v_dim = dims
        self.interleave, self.rope_scale, self.q_scale = interleave, rope_scale, q_scale

    def _rotated(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.rotary(deinterleaved(x) if self.interleave else x, positions)
        return x if self.rope_scale == 1.0 else x * self.rope_scale

    def _queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`[b, a/tp, s, nope + rope]`, rotated and scaled."""
        q = self.q(x) if hasattr(self, "q") else self.q_up(self.q_norm(self.q_down(x)))
        b, s, _ = q.shape
        q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)
        q = torch.cat([q[..., :self.nope], self._rotated(q[..., self.nope:], positions)], -1)
        return q if self.q_scale == 1.0 else q * self.q_scale

    def forward(self, x: torch.Tensor, rng: RNGTracker, positions: torch.Tensor | None,
                cache: LayerCache | None = None, mask: AttentionMask = CAUSAL):
        q = self._queries(x, positions)
        latent, k_rope = self.kv_down(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_norm(latent)  # [b, s(/tp), r]
        k_rope = self.into_heads(k_rope)  # [b, s, rope]: whole sequence, gradient summed
        k_rope = self._rotated(k_rope.unsqueeze(1), positions)  # [b, 1, s, rope]
        k_start = 0
        if cache is not None:
            latent, k_rope, k_start = cache.extend(latent.unsqueeze(1), k_rope)
            latent = latent.squeeze(1)
        kv = self.kv_up(latent)  # [b, t, a/tp * (nope + v)]
        b, t, _ = kv.shape
        kv = kv.view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = self.core(q, k, v, rng, mask, k_start)  # [b, a/tp, s, v]
        return self.proj(out.transpose(1, 2).reshape(b, out.shape[2], -1))
