"""DeepSeek-V3 (DeepSeek-AI 2024) and the models built like it (Moonlight, Kimi K2): Llama's
blocks (RMSNorm in fp32, SwiGLU, no biases, untied output layer) with multi-head latent
attention (`latent_attention.py`), YaRN rotary scaling, and MoE layers after the first
`moe_first_dense` dense ones: sigmoid router scores with a choice bias trained by its update
rule (`moe_bias_rate`), `moe_top_k` of many narrow experts from the best `moe_topk_groups` of
`moe_groups` groups, combine weights renormalised and
scaled (`moe_routed_scaling`), plus a shared expert added unchanged.

Parameter counts are of the main model: the multi-token-prediction module of DeepSeek-V3's
checkpoints (its 62nd layer) is not part of it, so `deepseek-v3`'s `num_parameters()` is
671.0B, not the 685B the checkpoint holds with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.models.blocks import Block, Rotary, generator, init_linear, rope_frequencies
from meshtrain.models.family import WIDE_BYTES, ModelFamily
from meshtrain.models.latent_attention import LatentAttention, yarn_frequencies, yarn_mscale
from meshtrain.models.llama import Llama, LlamaConfig
from meshtrain.parallel.layers.norms import RMSNorm

LATENT_EPS = 1e-6
"""The latent norms' epsilon (transformers' default, whatever `rms_norm_eps`)."""


@dataclass(frozen=True)
class DeepseekV3Config(LlamaConfig):
    """DeepSeek-V3's architecture: Llama's fields, the MLA settings (`kv_lora_rank` and the
    head dimensions, required), and YaRN scaling (`rope_scaling` "yarn": `rope_factor`,
    `rope_original_max_positions`, the ramp's `rope_beta_fast`/`rope_beta_slow`, and the
    magnitude corrections `rope_mscale` and `rope_mscale_all_dim`, 0 where unset)."""

    vocab_size: int = 129280
    rms_norm_eps: float = 1e-6
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    LATENT_ATTENTION: ClassVar[bool] = True
    POSITIVE_FIELDS: ClassVar[tuple[str, ...]] = (
        *LlamaConfig.POSITIVE_FIELDS, "rope_beta_fast", "rope_beta_slow")

    @property
    def head_dim(self) -> int:
        """A query's (and key's) head dimension: non-rotary and rotary parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def core_width(self) -> float:
        return self.num_heads * (self.head_dim + self.v_head_dim) / 2

    def kv_width(self, tp: int) -> float:
        """Every head has its key (`head_dim`) and value (`v_head_dim`)."""
        return self.num_heads / tp * (self.head_dim + self.v_head_dim) / 2

    def validate(self) -> None:
        for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise SettingError(Code.RANGE, f"`{name}` must be positive in multi-head latent"
                                               f" attention, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise SettingError(Code.RANGE, f"`q_lora_rank` must be >= 0 (0: a full query"
                                           f" projection), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise SettingError(Code.MODEL_SHAPE, f"`qk_rope_head_dim` {self.qk_rope_head_dim}"
                                                 " must be even: rotary dimensions pair up")
        for name, value in (("head_size", self.head_size), ("qk_norm", self.qk_norm or None)):
            if value is not None:
                raise SettingError(Code.MODEL_UNSUPPORTED, (
                    f"`{name}` does not apply to multi-head latent attention (its head dims are"
                    " `qk_nope_head_dim` + `qk_rope_head_dim` and `v_head_dim`): drop it"))
        super().validate()

    def _validate_rope(self) -> None:
        """YaRN's settings (in place of Llama's llama3 checks)."""
        if self.rope_scaling not in (None, "yarn"):
            raise SettingError(Code.MODEL_UNSUPPORTED, (
                f"`rope_scaling` {self.rope_scaling!r} is not implemented for deepseek-v3:"
                " meshtrain has none and yarn"))
        if self.rope_mscale < 0 or self.rope_mscale_all_dim < 0:
            raise SettingError(Code.RANGE, "`rope_mscale` and `rope_mscale_all_dim` must be"
                                           " >= 0 (0: unset)")

    @property
    def attention_factor(self) -> float:
        """YaRN's factor on the rotated dimensions (1 without scaling)."""
        if self.rope_scaling is None:
            return 1.0
        f = self.rope_factor
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(f, self.rope_mscale) / yarn_mscale(f, self.rope_mscale_all_dim)
        return yarn_mscale(f)

    @property
    def query_scale(self) -> float:
        """The factor on the queries that YaRN's `mscale_all_dim` puts on the softmax scale."""
        if self.rope_scaling is None or not self.rope_mscale_all_dim:
            return 1.0
        return yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2

    def rope_inverse_frequencies(self):
        d = self.qk_rope_head_dim
        if self.rope_scaling is None:
            return rope_frequencies(d, theta=self.rope_theta)
        return yarn_frequencies(d, theta=self.rope_theta, factor=self.rope_factor,
                                original=self.rope_original_max_positions,
                                beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow)

    def attention_parameters(self, *, weights_only: bool = False) -> int:
        return sum(math.prod(s) for name, s in self.attention_shapes().items()
                   if not (weights_only and "norm" in name))

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """The query projection (or its down- and up-projections and norm), the key/value
        down-projection (latent | shared rotary key), its norm, its up-projection (each head's
        non-rotary key | value) and the output projection."""
        h, a, r, qr = self.hidden_size, self.num_heads, self.kv_lora_rank, self.q_lora_rank
        q = {"q.weight": (a * self.head_dim, h)} if not qr else {
            "q_down.weight": (qr, h), "q_norm.weight": (qr,),
            "q_up.weight": (a * self.head_dim, qr)}
        return q | {"kv_down.weight": (r + self.qk_rope_head_dim, h), "kv_norm.weight": (r,),
                    "kv_up.weight": (a * (self.qk_nope_head_dim + self.v_head_dim), r),
                    "proj.weight": (h, a * self.v_head_dim)}

    def pointwise_bytes(self, *, hidden: float, tp: int, element_size: int,
                        fused: bool) -> float:
        """Llama's kernels (two norms, residual adds, SwiGLU) with MLA's in place of its rotary
        positions: the two latent norms (whole, as the hidden ones: fp32 passes when eager), the
        rotary part of this rank's queries and of the shared key, and the copies joining each
        head's non-rotary and rotary parts (queries, keys)."""
        e, a, rope = element_size, self.num_heads / tp, self.qk_rope_head_dim
        latents = self.q_lora_rank + self.kv_lora_rank
        rotated = a * rope + rope
        joined = 2 * a * self.head_dim
        base = super().pointwise_bytes(hidden=hidden, tp=tp, element_size=e, fused=fused)
        llama_rotary = (2 if fused else 10) * e * 2 * self.num_heads * self.head_dim / tp
        if fused:
            return base - llama_rotary + 2 * 2 * e * latents + 2 * e * rotated + 2 * e * joined
        norm = 4 * e + 7 * WIDE_BYTES
        return base - llama_rotary + latents * norm + 12 * e * rotated + 2 * e * joined

    def cached_bytes_per_token(self, element_size: int = 2) -> int:
        """What a key/value cache holds per token: each layer's latent and shared rotary key
        (whole on every tensor-parallel rank)."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * element_size

    def activation_bytes(self, *, seq_len: int, micro_batch: int, tp: int = 1,
                         sequence_parallel: bool = False, recompute: str = "none",
                         element_size: int = 2, mask_size: int = 1,
                         dropout: bool = True) -> float:
        """Llama's count (`LlamaConfig.activation_bytes`) with MLA's projections in place of
        grouped-query attention's: the latents (the down-projections' outputs and the norms'
        outputs, split by t under sequence parallelism, like the hidden states) and per head
        the queries, keys and values (selective: what the core keeps, and the queries' rotated
        part) and the output projection's input; the probabilities are counted as there
        (tests/test_memory.py measures it within 10%)."""
        s, b, a, e, t = seq_len, micro_batch, self.num_heads, element_size, tp
        dense = super().activation_bytes(seq_len=s, micro_batch=b, tp=t,
                                         sequence_parallel=sequence_parallel,
                                         recompute=recompute, element_size=e,
                                         mask_size=mask_size, dropout=dropout)
        if recompute == "full":
            return dense
        qk, v = self.head_dim, self.v_head_dim
        latents = s * b * (2 * (self.q_lora_rank + self.kv_lora_rank)
                           + self.qk_rope_head_dim) * e / (t if sequence_parallel else 1)
        w = a * qk  # the query width Llama's count uses (its heads are `head_dim` wide)
        if recompute == "selective":
            gqa = s * b * (3 * w / t + 3 * max(self.kv_heads // t, 1) * qk) * e
            return dense - gqa + latents \
                + s * b * a * (2 * qk + 2 * v + self.qk_rope_head_dim) * e / t
        gqa = 4 * s * b * w * e / t
        return dense - gqa + latents + s * b * a * (2 * qk + 2 * v) * e / t


def _deepseek(layers: int, hidden: int, heads: int, ffn: int, experts: int, top_k: int,
              expert_ffn: int, shared: int = 1, **kw) -> DeepseekV3Config:
    return DeepseekV3Config(
        num_layers=layers, hidden_size=hidden, num_heads=heads, ffn_hidden_size=ffn,
        moe_experts=experts, moe_top_k=top_k, moe_ffn_size=expert_ffn,
        moe_shared_ffn_size=shared * expert_ffn, moe_shared_gate="none", moe_score="sigmoid",
        moe_norm_topk_prob=True, moe_capacity_factor=0.0, moe_aux_loss_coef=0.0,
        moe_bias_rate=0.001, **kw)



PRESETS: dict[str, DeepseekV3Config] = {
    # 4 layers (the first dense), 8 heads, a query latent, 8 experts in 2 groups, a token's 2
    # from the better group:
    # tp 1/2/4, ep 2/4, pp 2 and cp 2 all divide it.
    "deepseek-v3-tiny": _deepseek(4, 64, 8, 128, 8, 2, 32, moe_first_dense=1, vocab_size=256,
                                  max_seq_len=256, q_lora_rank=32, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                  moe_routed_scaling=2.5, moe_groups=2, moe_topk_groups=1),
    # Published shapes (the models' config.json): Moonlight-16B-A3B (moonshotai), and
    # DeepSeek-V3 (its 671B main model; YaRN to 160k positions).
    "moonlight-16b-a3b": _deepseek(27, 2048, 16, 11264, 64, 6, 1408, 2, moe_first_dense=1,
                                   vocab_size=163840, max_seq_len=8192, kv_lora_rank=512,
                                   qk_rope_head_dim=64, qk_nope_head_dim=128,
                                   v_head_dim=128, rope_theta=50000.0,
                                   moe_routed_scaling=2.446, rms_norm_eps=1e-5),
    "deepseek-v3": _deepseek(61, 7168, 128, 18432, 256, 8, 2048, moe_first_dense=3,
                             max_seq_len=163840, q_lora_rank=1536, kv_lora_rank=512,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                             moe_routed_scaling=2.5, moe_groups=8, moe_topk_groups=4,
                             rope_scaling="yarn", rope_factor=40.0,
                             rope_original_max_positions=4096, rope_mscale=1.0,
                             rope_mscale_all_dim=1.0),
}


class DeepseekV3(Llama):
    """DeepSeek-V3: Llama's model with multi-head latent attention. The attention's weights
    draw from the layer's generator in the order of `attention_shapes`."""

    family = "deepseek-v3"
    cfg: DeepseekV3Config

    def build_block(self, seed: int, index: int) -> nn.Module:
        gen = generator(seed, 1 + index)
        attn = self._latent_attention(gen)
        mlp = self.build_feed_forward(seed, index, gen)
        return Block(ln1=self._norm(), attn=attn, ln2=self._norm(), mlp=mlp,
                     dropout=self.cfg.dropout, stream=self.factory.hidden_stream)

    def _latent_attention(self, gen) -> LatentAttention:
        cfg, factory = self.cfg, self.factory
        h, a, std, qk = cfg.hidden_size, cfg.num_heads, cfg.init_std, cfg.head_dim
        if cfg.q_lora_rank:
            qr = cfg.q_lora_rank
            q = (factory.replicated(init_linear(h, qr, std, gen, bias=False)),
                 factory.replicated(RMSNorm(qr, eps=LATENT_EPS)),
                 factory.column(init_linear(qr, a * qk, std, gen, bias=False), heads=a))
        else:
            q = factory.column(init_linear(h, a * qk, std, gen, bias=False), heads=a)
        r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        kv_down = factory.replicated(init_linear(h, r + rope, std, gen, bias=False))
        kv_up = factory.column(init_linear(r, a * (cfg.qk_nope_head_dim + cfg.v_head_dim), std,
                                           gen, bias=False), heads=a)
        proj = factory.row(init_linear(a * cfg.v_head_dim, h, self._out_std, gen, bias=False))
        core = factory.attention_core(dropout=cfg.dropout, eager=cfg.attention == "eager")
        return LatentAttention(
            q=q, kv_down=kv_down, kv_norm=factory.replicated(RMSNorm(r, eps=LATENT_EPS)),
            kv_up=kv_up, proj=proj, core=core, rotary=Rotary(cfg.rope_inverse_frequencies()),
            into_heads=factory.into_heads,
            dims=(r, cfg.qk_nope_head_dim, rope, cfg.v_head_dim),
            interleave=cfg.rope_interleave, rope_scale=cfg.attention_factor,
            q_scale=cfg.query_scale)


FAMILY = ModelFamily("deepseek-v3", DeepseekV3Config, DeepseekV3, PRESETS)
