"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): Mistral's blocks (RMSNorm, rotary
positions, grouped-query attention, no biases, untied output layer, a window where the config
sets one; 8x7B's is null) with every MLP replaced by E SwiGLU experts of the full MLP width, a
token's top 2 chosen by a softmax over the router's logits and their two weights renormalised
to sum to 1 (`moe_norm_topk_prob`), dropless (`moe_capacity_factor` 0), as transformers routes.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.models.family import ModelFamily, require_experts
from meshtrain.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """Mixtral's architecture: a Mistral whose MLPs are routed experts."""

    vocab_size: int = 32000
    max_seq_len: int = 32768
    rope_theta: float = 1000000.0
    moe_experts: int = 8
    moe_top_k: int = 2
    moe_norm_topk_prob: bool | None = True
    moe_capacity_factor: float = 0.0
    moe_aux_loss_tokens: str = "all"

    def validate(self) -> None:
        super().validate()
        require_experts(self, "Mixtral", "mistral")


def _mixtral(layers: int, hidden: int, heads: int, kv: int, ffn: int, **kw) -> MixtralConfig:
    return MixtralConfig(num_layers=layers, hidden_size=hidden, num_heads=heads,
                         num_kv_heads=kv, ffn_hidden_size=ffn, **kw)


PRESETS: dict[str, MixtralConfig] = {
    # 4 layers, 8 heads sharing 2 key/value heads, 8 experts of width 64, top 2: tp 1/2,
    # ep 2/4/8, pp 2 and cp 2 all divide it.
    "mixtral-tiny": _mixtral(4, 64, 8, 2, 64, vocab_size=256, max_seq_len=256),
    # Published shapes (the Mixtral 8x7B v0.1 config.json; its router_aux_loss_coef 0.02 is
    # transformers' pooled loss: 0.02 x 2 / 32 layers per layer here, see `hf_experts`).
    "mixtral-8x7b": _mixtral(32, 4096, 32, 8, 14336, moe_aux_loss_coef=0.02 * 2 / 32),
}


class Mixtral(Llama):
    """Mixtral: Llama's model, every MLP routed experts (`CausalLM.build_feed_forward`)."""

    family = "mixtral"
    cfg: MixtralConfig


FAMILY = ModelFamily("mixtral", MixtralConfig, Mixtral, PRESETS)
