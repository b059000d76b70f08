"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's blocks (RMSNorm, rotary theta 10^6,
grouped-query attention with biases on q, k and v) whose MLPs are, on the MoE layers, many
narrow SwiGLU experts (`moe_ffn_size`) beside a shared expert (`moe_shared_ffn_size`) scaled per
token by sigmoid(w . x) (`moe_shared_gate` sigmoid). A token's top k come from a softmax over
the router's logits; their weights are renormalised only with `moe_norm_topk_prob`
(transformers' norm_topk_prob; off in Qwen1.5-MoE). The MoE layers are every n-th
("decoder_sparse_step") but those listed dense ("mlp_only_layers"); the dense ones keep an MLP
of `ffn_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.models.family import ModelFamily, require_experts
from meshtrain.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class Qwen2MoeConfig(LlamaConfig):
    """Qwen2-MoE's architecture (Qwen1.5-MoE-A2.7B's routing by default)."""

    vocab_size: int = 151936
    max_seq_len: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    qkv_bias: bool = True
    moe_experts: int = 60
    moe_top_k: int = 4
    moe_norm_topk_prob: bool | None = False
    moe_capacity_factor: float = 0.0
    moe_aux_loss_tokens: str = "all"

    def validate(self) -> None:
        super().validate()
        require_experts(self, "Qwen2-MoE", "qwen2")


def _qwen2_moe(layers: int, hidden: int, heads: int, kv: int, ffn: int, **kw
               ) -> Qwen2MoeConfig:
    return Qwen2MoeConfig(num_layers=layers, hidden_size=hidden, num_heads=heads,
                          num_kv_heads=kv, ffn_hidden_size=ffn, moe_shared_gate="sigmoid", **kw)


PRESETS: dict[str, Qwen2MoeConfig] = {
    # 4 layers (layer 0 dense, as "mlp_only_layers" [0]), 8 heads sharing 4 key/value heads,
    # 8 experts of width 32 (top 4) beside a gated shared expert of 64: tp 1/2, ep 2/4/8 and
    # pp 2 all divide it.
    "qwen2-moe-tiny": _qwen2_moe(4, 64, 8, 4, 176, vocab_size=256, max_seq_len=256,
                                 moe_experts=8, moe_ffn_size=32, moe_shared_ffn_size=64,
                                 moe_layers=(1, 2, 3)),
    # Published shapes (the Qwen/Qwen1.5-MoE-A2.7B config.json).
    "qwen1.5-moe-a2.7b": _qwen2_moe(24, 2048, 16, 16, 5632, moe_ffn_size=1408,
                                    moe_shared_ffn_size=5632),
}


class Qwen2Moe(Llama):
    """Qwen2-MoE: Llama's model with q/k/v biases; its MoE layers' routed experts, shared
    expert and gate are `CausalLM.build_feed_forward`'s."""

    family = "qwen2_moe"
    cfg: Qwen2MoeConfig


FAMILY = ModelFamily("qwen2_moe", Qwen2MoeConfig, Qwen2Moe, PRESETS)
