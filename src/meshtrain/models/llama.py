"""Llama (the Llama 2 / 3 architecture): RMSNorm computed in fp32, rotary position embedding
(half-split convention, configurable theta, Llama 3.1's `llama3` frequency scaling), SwiGLU
MLP, grouped-query attention, no biases, an untied output layer (Llama 2/3) or a tied one
(Llama 3.2).

Grouped-query attention under Megatron's 1D scheme: with kv_heads % tp == 0 each rank holds
kv_heads/tp whole key/value heads; with tp % kv_heads == 0 each key/value head is replicated on
tp/kv_heads consecutive ranks (their weight gradients are summed over them); otherwise the
layout is refused. The query, key and value projections run as one column group (one input
communication); MoE experts are SwiGLU MLPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.models.blocks import (
    MLP,
    Attention,
    Block,
    Embedding,
    Rotary,
    generator,
    init_embedding,
    init_linear,
    rope_frequencies,
    split_grouped_qkv,
    swiglu,
)
from meshtrain.models.causal_lm import CausalLM
from meshtrain.models.family import WIDE_BYTES, ModelFamily, TransformerConfig
from meshtrain.parallel.layers.norms import RMSNorm


@dataclass(frozen=True)
class LlamaConfig(TransformerConfig):
    """Llama's architecture; the SwiGLU width defaults to 8h/3 rounded up to a multiple of 256
    (Llama's own rule)."""

    vocab_size: int = 32000
    max_seq_len: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str | None = None
    """None, or "llama3" (Llama 3.1+: long wavelengths slowed by `rope_factor`)."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    tie_word_embeddings: bool = False
    """Llama 3.2 ties the output layer to the embedding; Llama 2 and 3 do not."""
    POSITIVE_FIELDS: ClassVar[tuple[str, ...]] = (
        *TransformerConfig.POSITIVE_FIELDS, "rms_norm_eps", "rope_theta", "rope_factor",
        "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions")

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 256 * math.ceil(8 * self.hidden_size / 3 / 256)

    @property
    def rope(self) -> dict | None:
        """The `llama3` scaling parameters, or None."""
        if self.rope_scaling is None:
            return None
        return {"factor": self.rope_factor, "low_freq_factor": self.rope_low_freq_factor,
                "high_freq_factor": self.rope_high_freq_factor,
                "original_max_positions": self.rope_original_max_positions}

    def validate(self) -> None:
        super().validate()
        if self.head_dim % 2:
            raise SettingError(Code.MODEL_SHAPE, (
                f"rotary embeddings need an even head dimension, got {self.head_dim}"
                f" (`head_size`, or hidden {self.hidden_size} / {self.num_heads} heads)"))
        self._validate_rope()

    def _validate_rope(self) -> None:
        """The `llama3` scaling's settings."""
        if self.rope_scaling and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise SettingError(Code.RANGE, (
                f"`rope_high_freq_factor` {self.rope_high_freq_factor} must exceed"
                f" `rope_low_freq_factor` {self.rope_low_freq_factor}: llama3 scaling"
                " blends the wavelengths between them"))
        if self.rope_scaling not in (None, "llama3"):
            raise SettingError(Code.MODEL_UNSUPPORTED, (
                f"`rope_scaling` {self.rope_scaling!r} is not implemented: meshtrain"
                " has none and llama3"))

    def validate_for_tp(self, tp: int) -> None:
        super().validate_for_tp(tp)
        kv = self.kv_heads
        if kv % tp and tp % kv:
            raise SettingError(Code.KV_HEADS_TP, (
                f"the key/value heads ({kv}) and `tp` ({tp}) must divide one another:"
                f" each rank holds kv/tp whole heads, or each head is shared by"
                f" tp/kv ranks; choose a tp that divides {kv} or a multiple of it"))

    def attention_parameters(self, *, weights_only: bool = False) -> int:
        """q and output projections of all heads, k and v of the key/value heads, the q, k
        and v biases where `qkv_bias` and the q and k head norms where `qk_norm`."""
        h, d = self.hidden_size, self.head_dim
        weights = 2 * h * self.num_heads * d + 2 * h * self.kv_heads * d
        biases = (self.num_heads + 2 * self.kv_heads) * d if self.qkv_bias else 0
        norms = 2 * d if self.qk_norm else 0
        return weights + (0 if weights_only else biases + norms)

    def mlp_parameters(self, *, weights_only: bool = False, width: int | None = None) -> int:
        return 3 * self.hidden_size * (width or self.ffn_size)  # gate, up, down

    def other_parameters(self) -> int:
        """Token table, untied output layer, two RMSNorms a layer and the final one."""
        h, v = self.hidden_size, self.vocab_size
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + head + self.num_layers * 2 * h + h

    def norm_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.hidden_size,)}

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """q of every head, k | v of the key/value heads (one tensor), their biases where
        `qkv_bias`, the output projection, and the q and k head norms where `qk_norm` (in the
        order of the model's parameters)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {"qkv.q.weight": (q, h), "qkv.kv.weight": (2 * kv, h)}
        if self.qkv_bias:
            shapes |= {"qkv.q.bias": (q,), "qkv.kv.bias": (2 * kv,)}
        shapes["proj.weight"] = (h, q)
        if self.qk_norm:
            shapes |= {"q_norm.weight": (self.head_dim,), "k_norm.weight": (self.head_dim,)}
        return shapes

    def mlp_shapes(self, width: int | None = None) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden_size, width or self.ffn_size
        return {"fc.weight": (2 * f, h), "proj.weight": (h, f)}  # fc: gate | up

    def pointwise_bytes(self, *, hidden: float, tp: int, element_size: int,
                        fused: bool) -> float:
        """Two RMSNorms, two residual adds, rotary positions on q and k, SwiGLU; eager: each
        norm's six passes in fp32 (`_RMSNormFn`: widen, square, mean, scale, round, weight:
        4 e + 7 x 4 bytes an element), rotary's five (`Rotary`: x cos, negate, concatenate,
        x sin, add: 10 e), silu and the product (5 e of f), and the attention output's copy
        back to [b, s, h]; with `qk_norm` the head norms' passes over the rotated q and k."""
        e, f = element_size, self.ffn_size / tp
        q = self.num_heads * self.head_dim / tp
        rotated = q + self.kv_heads * self.head_dim / tp
        heads = 1 if self.qk_norm else 0
        if fused:
            return 2 * 2 * e * hidden + 2 * 3 * e * hidden + (2 + 2 * heads) * e * rotated \
                + 4 * e * f
        norm = 4 * e + 7 * WIDE_BYTES
        return hidden * (2 * norm + 2 * 3 * e) + (10 * e + heads * norm) * rotated \
            + 5 * e * f + 2 * e * q

    def activation_bytes(self, *, seq_len: int, micro_batch: int, tp: int = 1,
                         sequence_parallel: bool = False, recompute: str = "none",
                         element_size: int = 2, mask_size: int = 1,
                         dropout: bool = True) -> float:
        """Bytes one transformer layer saves for backward with the eager attention core,
        counted from what this implementation saves (the dtype-aware form of docs/design.md: e
        bytes per activation, mu per dropout-mask element; the s x s causal mask and the rotary
        tables are left out):

        - replicated: both norms' inputs and outputs 4sbh e, their fp32 1/rms 8sb, residual
          dropout masks 2sbh mu (split by t under sequence parallelism);
        - attention, of query width w = a d (h unless `head_size`): q, k and v repeated to
          every query head, the output projection's input 4sbw e/t, and the probabilities
          as^2b e/t (dropout: a second as^2b e and its mask);
        - head norms (`qk_norm`): their inputs, the q and k/v projection outputs (w/t + 2 kv
          widths per rank) e, unless recompute keeps them anyway, and their fp32 1/rms;
        - SwiGLU: the gate-and-up output, silu(gate) and the product 4sbf e/t;
        - selective recompute keeps the core's inputs instead of its internals: q, the rotated
          k, and the joined q/k/v projection output (v is a view of it);
        - full recompute keeps only the layer input sbh e (/t under sequence parallelism).
        """
        s, b, h, a = seq_len, micro_batch, self.hidden_size, self.num_heads
        e, mu, t, w = element_size, mask_size, tp, self.num_heads * self.head_dim
        replicated_split = t if sequence_parallel else 1
        if recompute == "full":
            return s * b * h * e / replicated_split
        replicated = s * b * (h * (4 * e + (2 * mu if dropout else 0)) + 8)
        local_kv = max(self.kv_heads // t, 1) * self.head_dim  # key (or value) width per rank
        if recompute == "selective":
            attention = s * b * (3 * w / t + 3 * local_kv) * e
        else:
            attention = (4 * s * b * w + a * s * s * b * (2 if dropout else 1)) * e / t \
                + (a * s * s * b * mu / t if dropout else 0)
        if self.qk_norm:
            inputs = 0 if recompute == "selective" else (w / t + 2 * local_kv) * e
            attention += s * b * (inputs + (a / t + local_kv / self.head_dim) * WIDE_BYTES)
        return replicated / replicated_split + attention + 4 * s * b * self.ffn_size * e / t

    def mlp_activation_bytes(self, tokens: float, width: int, *, tp: int,
                             element_size: int) -> float:
        """SwiGLU's gate-and-up output, silu(gate) and their product."""
        return 4 * tokens * width * element_size / tp


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, **kw) -> LlamaConfig:
    return LlamaConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                       ffn_hidden_size=ffn, **kw)


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0)
_LLAMA31 = _LLAMA3 | dict(max_seq_len=131072, rope_scaling="llama3")

PRESETS: dict[str, LlamaConfig] = {
    # 4 layers, 8 heads sharing 4 key/value heads: tp 1/2/4 (tp 4 holds one key/value head per
    # rank), pp and cp up to 4 and pp 2 x 2 virtual stages all divide it.
    "llama-tiny": _llama(4, 64, 8, 4, 176, vocab_size=256, max_seq_len=256),
    # Published shapes (Touvron et al. 2023; Llama 3 model cards and configs).
    "llama2-7b": _llama(32, 4096, 32, 32, 11008),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824),
    "llama2-70b": _llama(80, 8192, 64, 8, 28672),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, max_seq_len=8192, **_LLAMA3),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, max_seq_len=8192, **_LLAMA3),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, **_LLAMA31),
    "llama3.2-1b": _llama(16, 2048, 32, 8, 8192, rope_factor=32.0, tie_word_embeddings=True,
                          **_LLAMA31),
    "llama3.2-3b": _llama(28, 3072, 24, 8, 8192, rope_factor=32.0, tie_word_embeddings=True,
                          **_LLAMA31),
}


class Llama(CausalLM):
    """Llama whose forward maps token ids `[b, s]` to local logits `[b, s, V_padded/tp]`.

    Weights are drawn per layer from `generator(seed, 1 + layer)` (the embedding from stream
    0, the untied output layer from 1 + num_layers, each expert from its own).
    """

    family = "llama"
    cfg: LlamaConfig

    def build_embedding(self, seed: int, *, with_position: bool) -> nn.Module:
        cfg = self.cfg
        word = self.factory.vocab_embedding(
            init_embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std, generator(seed, 0)))
        return Embedding(word, None, dropout=cfg.dropout, factory=self.factory)

    def build_block(self, seed: int, index: int) -> nn.Module:
        cfg, factory, gen = self.cfg, self.factory, generator(seed, 1 + index)
        h, d, std = cfg.hidden_size, cfg.head_dim, cfg.init_std
        qkv = factory.column_group(
            q=factory.column(init_linear(h, cfg.num_heads * d, std, gen, bias=cfg.qkv_bias),
                             heads=cfg.num_heads),
            kv=factory.column(init_linear(h, 2 * cfg.kv_heads * d, std, gen,
                                          bias=cfg.qkv_bias), blocks=2, heads=cfg.kv_heads))
        proj = factory.row(init_linear(cfg.num_heads * d, h, self._out_std, gen, bias=False))
        core = factory.attention_core(dropout=cfg.dropout, eager=cfg.attention == "eager")
        rotary = Rotary(rope_frequencies(d, theta=cfg.rope_theta, scaling=cfg.rope))
        q_norm, k_norm = (factory.head_norm(RMSNorm(d, eps=cfg.rms_norm_eps))
                          for _ in range(2)) if cfg.qk_norm else (None, None)
        attn = Attention(qkv, proj, core, split=split_grouped_qkv, head_dim=d, rotary=rotary,
                         q_norm=q_norm, k_norm=k_norm)
        mlp = self.build_feed_forward(seed, index, gen)
        return Block(ln1=self._norm(), attn=attn, ln2=self._norm(), mlp=mlp,
                     dropout=cfg.dropout, stream=factory.hidden_stream)

    @property
    def _out_std(self) -> float:
        """Output projections' init, scaled by depth as in Megatron-LM."""
        return self.cfg.init_std / math.sqrt(2 * self.cfg.num_layers)

    def _norm(self) -> nn.Module:
        return self.factory.norm(RMSNorm(self.cfg.hidden_size, eps=self.cfg.rms_norm_eps))

    def build_mlp(self, gen, width: int | None = None) -> MLP:
        """SwiGLU: `fc` holds the gate and up projections as two blocks."""
        h, f = self.cfg.hidden_size, width or self.cfg.ffn_size
        return MLP(self.factory.column(init_linear(h, 2 * f, self.cfg.init_std, gen, bias=False),
                                       blocks=2),
                   self.factory.row(init_linear(f, h, self._out_std, gen, bias=False)),
                   activation=swiglu)

    def build_final_norm(self) -> nn.Module:
        return self._norm()

    def build_head(self, seed: int) -> nn.Module:
        cfg = self.cfg
        return self.factory.vocab_head(init_linear(
            cfg.hidden_size, cfg.vocab_size, cfg.init_std,
            generator(seed, 1 + cfg.num_layers), bias=False))


FAMILY = ModelFamily("llama", LlamaConfig, Llama, PRESETS)
