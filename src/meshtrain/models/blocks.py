"""Building blocks every family assembles: embedding, attention (projections cut into heads by
a split function, optional rotary positions, the factory's core), MLP (GeLU or SwiGLU),
the pre-norm block, and seeded weight initialisation.

Blocks hold layers a `LayerFactory` made; they never decide how anything is split. Shapes are
batch-first; `h/tp` marks a tensor-parallel region under the 1D scheme.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.models.kv_cache import LayerCache
from meshtrain.parallel.layers.eager import eager_under_compile
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.layers.masks import CAUSAL, AttentionMask
from meshtrain.parallel.layers.rng import RNGTracker


def generator(seed: int, stream: int) -> torch.Generator:
    """A generator per (seed, stream): a layer's weights do not depend on which other layers
    this rank builds (pipeline stages) nor on the layout."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def init_linear(in_f: int, out_f: int, std: float, gen: torch.Generator, *,
                bias: bool = True) -> nn.Linear:
    """A dense `nn.Linear` with N(0, std) weights and zero bias, drawn from `gen` on the CPU."""
    dense = nn.Linear(in_f, out_f, bias=bias, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        dense.weight.normal_(0.0, std, generator=gen)
        if bias:
            dense.bias.zero_()
    return dense


def init_embedding(num: int, dim: int, std: float, gen: torch.Generator) -> nn.Embedding:
    """A dense `nn.Embedding` with N(0, std) weights drawn from `gen` on the CPU (given as its
    weight: an embedding initialised on the meta device imports torch's compiler, 1.2 s a
    process)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim).normal_(0.0, std, generator=gen))


def dropout(x: torch.Tensor, p: float, training: bool, rng: RNGTracker, stream: str):
    if p == 0.0 or not training:
        return x
    return _dropped(x, p, rng, stream)


@eager_under_compile  # the mask comes from meshtrain's stream
def _dropped(x: torch.Tensor, p: float, rng: RNGTracker, stream: str) -> torch.Tensor:
    with rng.fork(stream):
        return F.dropout(x, p, training=True)


class Embedding(nn.Module):
    """Token embedding (vocab-parallel), plus a learned position embedding in families that have
    one (GPT), then dropout: token ids -> this rank's hidden states. The last pipeline stage of a
    tied model builds it without positions, for its output layer."""

    def __init__(self, word: nn.Module, position: nn.Module | None, *, dropout: float,
                 factory):
        super().__init__()
        self.word, self.position = word, position
        self.dropout = dropout
        self.positions_of, self.stream = factory.hidden_positions, factory.hidden_stream

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, rng: RNGTracker):
        x = self.word(ids)  # [b, s, h], or [b, s/tp, h] under sequence parallelism
        if self.position is not None:
            x = x + self.position(self.positions_of(positions))
        return dropout(x, self.dropout, self.training, rng, self.stream)


def rope_frequencies(head_dim: int, *, theta: float, scaling: dict | None = None
                     ) -> torch.Tensor:
    """Rotary inverse frequencies `[head_dim/2]` in fp32 (computed as Hugging Face does, so
    angles agree bitwise), with Llama 3.1's `llama3` scaling when `scaling` gives its factor,
    low/high frequency factors and original context length: wavelengths longer than
    original/low are slowed by the factor, shorter than original/high kept, and those between
    interpolated."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor, old = scaling["factor"], scaling["original_max_positions"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelength - low) / (high - low)
    between = (1 - smooth) * scaled / factor + smooth * scaled
    middle = ~(wavelength < old / high) & ~(wavelength > old / low)
    return torch.where(middle, between, scaled)


class Rotary(nn.Module):
    """Rotary position embedding in the half-split convention (`rotate_half`: dimension i pairs
    with i + d/2), rotating each token by its true position, so context parallelism's
    load-balanced chunks get the right angles.

    The frequencies stay fp32 whatever dtype the model is cast to (a bf16 copy would misplace
    position 8191 by radians); they are kept per device, not as a buffer, for that reason.
    """

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self._inv_freq = {inv_freq.device: inv_freq.float()}

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """fp32 angles `[s, d]` of the tokens at `positions` `[s]` (`[b, 1, s, d]` for
        per-sequence positions `[b, s]`)."""
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = next(iter(self._inv_freq.values())).to(device)
        angles = positions.float()[..., None] * self._inv_freq[device]
        angles = torch.cat([angles, angles], dim=-1)
        return angles if positions.dim() == 1 else angles.unsqueeze(1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x `[b, heads, s, d]`, positions `[s]` or `[b, s]`."""
        angles = self.angles(positions.to(x.device))
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin


def split_fused_qkv(qkv: torch.Tensor, head_dim: int):
    """A fused projection's `[b, s, 3h/tp]` (three blocks, whole heads of each of q, k and v)
    -> q, k, v `[b, a/tp, s, d]`."""
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, 3, -1, head_dim).permute(2, 0, 3, 1, 4)
    return q, k, v


def split_grouped_qkv(projections: tuple[torch.Tensor, torch.Tensor], head_dim: int):
    """A column group's (q `[b, s, a/tp * d]`, kv `[b, s, 2 kv/tp * d]`: key and value as two
    blocks) -> q `[b, a/tp, s, d]`, k and v `[b, kv/tp, s, d]`."""
    q, kv = projections
    b, s, _ = q.shape
    k, v = kv.view(b, s, 2, -1, head_dim).permute(2, 0, 3, 1, 4)
    return q.view(b, s, -1, head_dim).transpose(1, 2), k, v


class Attention(nn.Module):
    """Causal self-attention over this rank's heads: project to q, k, v (`qkv`, cut into heads by
    `split`), normalise each head's q and k (`q_norm`, `k_norm`: Qwen3), rotate q and k by their
    positions (rotary families), attend (the factory's core), project back. Input and output
    are this rank's hidden states. With a layer's `cache` (generation, `kv_cache.py`) the new
    keys and values are appended to it and the queries attend over all of its tokens."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, core: nn.Module, *,
                 split: Callable, head_dim: int, rotary: Rotary | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None):
        super().__init__()
        self.qkv, self.proj, self.core, self.rotary = qkv, proj, core, rotary
        self.split, self.head_dim = split, head_dim
        self.q_norm, self.k_norm = q_norm, k_norm

    def forward(self, x: torch.Tensor, rng: RNGTracker, positions: torch.Tensor | None,
                cache: LayerCache | None = None, mask: AttentionMask = CAUSAL):
        # q, k, v cover the whole local sequence, also under sequence parallelism
        q, k, v = self.split(self.qkv(x), self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        k_start = 0
        if cache is not None:
            k, v, k_start = cache.extend(k, v)
        out = self.core(q, k, v, rng, mask, k_start)
        b, _, s, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))  # proj input [b, s, h/tp]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the halves of `x` (this rank's gate and up blocks)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """h -> ffn (column-parallel: the activation needs no communication) -> h (row-parallel)."""

    def __init__(self, fc: nn.Module, proj: nn.Module, *,
                 activation: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fc, self.proj = fc, proj
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.activation(self.fc(x)))  # fc: [b, s, ffn/tp]


class Block(nn.Module):
    """Pre-norm transformer block; its MLP is routed experts on MoE layers. Residual-branch
    dropout draws from the factory's hidden-state stream."""

    def __init__(self, *, ln1: nn.Module, attn: Attention, ln2: nn.Module, mlp: nn.Module,
                 dropout: float, stream: str):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = ln1, attn, ln2, mlp
        self.dropout, self.stream = dropout, stream
        self.routed = isinstance(mlp, MoE)

    def forward(self, x: torch.Tensor, rng: RNGTracker, positions: torch.Tensor | None,
                aux, cache: LayerCache | None = None, mask: AttentionMask = CAUSAL
                ) -> torch.Tensor:
        x = x + dropout(self.attn(self.ln1(x), rng, positions, cache, mask), self.dropout,
                        self.training, rng, self.stream)
        hidden = self.ln2(x)
        out = self.mlp(hidden, aux) if self.routed else self.mlp(hidden)
        return x + dropout(out, self.dropout, self.training, rng, self.stream)
