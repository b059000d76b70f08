"""Qwen3-MoE (Qwen team 2025: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head
query/key norms, heads of 128 whatever the hidden size, no biases) whose MLPs are, on the MoE
layers, many narrow SwiGLU experts (`moe_ffn_size`) and no shared expert. A token's top k come
from a softmax over the router's logits, renormalised to sum to 1 (`moe_norm_topk_prob`, on in
the published models), dropless. The MoE layers are every n-th ("decoder_sparse_step") but those
listed dense ("mlp_only_layers": none in the published models); a dense one keeps an MLP of
`ffn_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import Code, SettingError
from meshtrain.models.family import ModelFamily, require_experts
from meshtrain.models.qwen3 import Qwen3, Qwen3Config


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3-MoE's architecture (Qwen3-30B-A3B's routing by default)."""

    moe_experts: int = 128
    moe_top_k: int = 8
    moe_norm_topk_prob: bool | None = True
    moe_capacity_factor: float = 0.0
    moe_aux_loss_tokens: str = "all"

    def validate(self) -> None:
        super().validate()
        require_experts(self, "Qwen3-MoE", "qwen3")
        if self.moe_shared_ffn_size:
            raise SettingError(Code.MODEL_UNSUPPORTED, "`moe_shared_ffn_size` cannot be set in"
                                                       " Qwen3-MoE (it has no shared expert):"
                                                       " drop it")


def _qwen3_moe(layers: int, hidden: int, heads: int, kv: int, ffn: int, expert: int, **kw
               ) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(num_layers=layers, hidden_size=hidden, num_heads=heads,
                          num_kv_heads=kv, ffn_hidden_size=ffn, moe_ffn_size=expert, **kw)


PRESETS: dict[str, Qwen3MoeConfig] = {
    # 4 layers, 8 heads of 16 on a hidden size of 64 sharing 2 key/value heads, every MLP 8
    # experts of width 32 (top 2, renormalised): tp 1/2, ep 2/4/8, pp 2 all divide it.
    "qwen3-moe-tiny": _qwen3_moe(4, 64, 8, 2, 176, 32, head_size=16, vocab_size=256,
                                 max_seq_len=256, moe_experts=8, moe_top_k=2),
    # Published shapes (the Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json files).
    "qwen3-30b-a3b": _qwen3_moe(48, 2048, 32, 4, 6144, 768),
    "qwen3-235b-a22b": _qwen3_moe(94, 4096, 64, 4, 12288, 1536),
}


class Qwen3Moe(Qwen3):
    """Qwen3-MoE: Qwen3's model; its MoE layers' routed experts are
    `CausalLM.build_feed_forward`'s."""

    family = "qwen3_moe"
    cfg: Qwen3MoeConfig


FAMILY = ModelFamily("qwen3_moe", Qwen3MoeConfig, Qwen3Moe, PRESETS)
