"""GPT (the GPT-2 architecture): learned positions, pre-LayerNorm blocks, GeLU MLP of 4h, causal
multi-head attention with a fused QKV projection, dropout, tied input/output embedding.

Under the 1D scheme, per transformer layer and direction, exactly two all-reduces of b*s*h over
TP: g after the attention output projection and after the MLP (forward), f before the QKV and
the first MLP projection (backward). LayerNorm, dropout and residuals are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.memory import layer_activation_formula
from meshtrain.models.blocks import (
    MLP,
    Attention,
    Block,
    Embedding,
    gelu_tanh,
    generator,
    init_embedding,
    init_linear,
    split_fused_qkv,
)
from meshtrain.models.causal_lm import CausalLM
from meshtrain.models.family import WIDE_BYTES, ModelFamily, TransformerConfig


@dataclass(frozen=True)
class GPTConfig(TransformerConfig):
    """GPT-2's architecture; the MLP width defaults to 4 x hidden_size."""

    layernorm_eps: float = 1e-5
    qkv_bias: bool = True
    """GPT-2 has a bias on every linear layer."""

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = TransformerConfig.SHAPE_FIELDS + ("max_seq_len",)
    """The learned position table has max_seq_len rows."""
    POSITIVE_FIELDS: ClassVar[tuple[str, ...]] = (*TransformerConfig.POSITIVE_FIELDS,
                                                  "layernorm_eps")

    def validate(self) -> None:
        super().validate()
        for setting, value, why in (
                ("num_kv_heads", self.kv_heads != self.num_heads,
                 "its fused QKV projection has as many key/value heads as query heads"),
                ("qkv_bias", not self.qkv_bias, "GPT-2 has a bias on every linear layer"),
                ("head_size", self.head_size is not None,
                 "its fused QKV projection has heads of hidden_size / num_heads"),
                ("qk_norm", self.qk_norm, "GPT-2 has no query and key norms"),
                ("tie_word_embeddings", not self.tie_word_embeddings,
                 "its output layer is the token embedding")):
            if value:
                raise SettingError(Code.MODEL_UNSUPPORTED, f"`{setting}` cannot change in GPT"
                                                           f" ({why}): drop it")

    def attention_parameters(self, *, weights_only: bool = False) -> int:
        h = self.hidden_size
        return 4 * h * h + (0 if weights_only else 4 * h)  # fused QKV and output projection

    def mlp_parameters(self, *, weights_only: bool = False, width: int | None = None) -> int:
        h, f = self.hidden_size, width or self.ffn_size
        return 2 * h * f + (0 if weights_only else f + h)

    def other_parameters(self) -> int:
        """Token and position tables; two LayerNorms a layer and the final one (weight and
        bias); the output layer is the token table."""
        h = self.hidden_size
        return (self.vocab_size + self.max_seq_len) * h + self.num_layers * 4 * h + 2 * h

    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"position.weight": (self.max_seq_len, self.hidden_size)}

    def norm_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.hidden_size,), "bias": (self.hidden_size,)}

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.hidden_size
        return {"qkv.weight": (3 * h, h), "qkv.bias": (3 * h,), "proj.weight": (h, h),
                "proj.bias": (h,)}

    def mlp_shapes(self, width: int | None = None) -> dict[str, tuple[int, ...]]:
        h, f = self.hidden_size, width or self.ffn_size
        return {"fc.weight": (f, h), "fc.bias": (f,), "proj.weight": (h, f), "proj.bias": (h,)}

    def pointwise_bytes(self, *, hidden: float, tp: int, element_size: int,
                        fused: bool) -> float:
        """Two LayerNorms, two residual adds, GeLU; eager: each norm's nine passes in fp32
        (`_LayerNormFn`: widen, mean, centre, square, sum, scale, weight, bias, round: 2 e +
        15 x 4 bytes an element) and the attention output's copy back to [b, s, h]."""
        e, f = element_size, self.ffn_size / tp
        if fused:
            return 2 * 2 * e * hidden + 2 * 3 * e * hidden + 2 * e * f
        norm = 2 * e + 15 * WIDE_BYTES
        return hidden * (2 * norm + 2 * 3 * e) + 2 * e * f + 2 * e * self.hidden_size / tp

    def activation_bytes(self, *, seq_len: int, micro_batch: int, tp: int = 1,
                         sequence_parallel: bool = False, recompute: str = "none",
                         element_size: int = 2, mask_size: int = 1,
                         dropout: bool = True) -> float:
        """Bytes one transformer layer saves for backward (Korthikanti et al.; see
        `memory.layer_activation_formula`)."""
        return layer_activation_formula(
            s=seq_len, b=micro_batch, h=self.hidden_size, a=self.num_heads, tp=tp,
            sequence_parallel=sequence_parallel, recompute=recompute,
            element_size=element_size, mask_size=mask_size, dropout=dropout)

    def mlp_activation_bytes(self, tokens: float, width: int, *, tp: int,
                             element_size: int) -> float:
        """The fc output (GeLU's input) and GeLU's output (the projection's input)."""
        return 2 * tokens * width * element_size / tp


def _gpt(layers: int, hidden: int, heads: int, **kw) -> GPTConfig:
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, **kw)


PRESETS: dict[str, GPTConfig] = {
    # 4 layers and 4 heads: tp, pp and cp up to 4, and pp 2 x 2 virtual stages, all divide it.
    "tiny": _gpt(4, 64, 4, vocab_size=256, max_seq_len=256),
    "gpt2": _gpt(12, 768, 12),
    "gpt2-medium": _gpt(24, 1024, 16),
    "gpt2-large": _gpt(36, 1280, 20),
    "gpt2-xl": _gpt(48, 1600, 25),
    # Megatron-LM paper (Table 1) sizes.
    "megatron-1.2b": _gpt(40, 1536, 16),
    "megatron-2.5b": _gpt(54, 1920, 20),
    "megatron-4.2b": _gpt(64, 2304, 24),
    "megatron-8.3b": _gpt(72, 3072, 32),
    # GPT-3 paper sizes (head counts made to divide the hidden size where the paper's do not).
    "gpt3-small": _gpt(12, 768, 12, max_seq_len=2048),
    "gpt3-medium": _gpt(24, 1024, 16, max_seq_len=2048),
    "gpt3-large": _gpt(24, 1536, 16, max_seq_len=2048),
    "gpt3-xl": _gpt(24, 2048, 16, max_seq_len=2048),
    "gpt3-2.7b": _gpt(32, 2560, 32, max_seq_len=2048),
    "gpt3-6.7b": _gpt(32, 4096, 32, max_seq_len=2048),
    "gpt3-13b": _gpt(40, 5120, 40, max_seq_len=2048),
    "gpt3-175b": _gpt(96, 12288, 96, max_seq_len=2048),
}


class GPT(CausalLM):
    """GPT whose forward maps token ids `[b, s]` to local logits `[b, s, V_padded/tp]`.

    Weights are drawn per layer from `generator(seed, 1 + layer)` (the embedding from stream 0,
    each expert from its own: `build_feed_forward`), so they do not depend on the layout.
    """

    family = "gpt"
    cfg: GPTConfig

    def build_embedding(self, seed: int, *, with_position: bool) -> nn.Module:
        cfg, gen = self.cfg, generator(seed, 0)
        word = self.factory.vocab_embedding(
            init_embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std, gen))
        position = self.factory.position_embedding(
            init_embedding(cfg.max_seq_len, cfg.hidden_size, cfg.init_std, gen)) \
            if with_position else None
        return Embedding(word, position, dropout=cfg.dropout, factory=self.factory)

    def build_block(self, seed: int, index: int) -> nn.Module:
        cfg, factory, gen = self.cfg, self.factory, generator(seed, 1 + index)
        h, std = cfg.hidden_size, cfg.init_std
        out_std = std / math.sqrt(2 * cfg.num_layers)
        ln1 = factory.norm(nn.LayerNorm(h, eps=cfg.layernorm_eps))
        attn = Attention(factory.column(init_linear(h, 3 * h, std, gen), blocks=3,
                                        heads=cfg.num_heads),
                         factory.row(init_linear(h, h, out_std, gen)),
                         factory.attention_core(dropout=cfg.dropout,
                                                eager=cfg.attention == "eager"),
                         split=split_fused_qkv, head_dim=cfg.head_dim)
        ln2 = factory.norm(nn.LayerNorm(h, eps=cfg.layernorm_eps))
        mlp = self.build_feed_forward(seed, index, gen)
        return Block(ln1=ln1, attn=attn, ln2=ln2, mlp=mlp, dropout=cfg.dropout,
                     stream=factory.hidden_stream)

    def build_mlp(self, gen, width: int | None = None) -> MLP:
        cfg = self.cfg
        h, f, std = cfg.hidden_size, width or cfg.ffn_size, cfg.init_std
        return MLP(self.factory.column(init_linear(h, f, std, gen)),
                   self.factory.row(init_linear(f, h, std / math.sqrt(2 * cfg.num_layers), gen)),
                   activation=gelu_tanh)

    def build_final_norm(self) -> nn.Module:
        return self.factory.norm(nn.LayerNorm(self.cfg.hidden_size, eps=self.cfg.layernorm_eps))


FAMILY = ModelFamily("gpt", GPTConfig, GPT, PRESETS)
