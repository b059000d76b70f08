"""Mistral (Jiang et al. 2023, "Mistral 7B"): Llama's blocks (RMSNorm, rotary positions, SwiGLU,
grouped-query attention, no biases, untied output layer) with sliding-window attention: the
token at position i attends the positions j with i - W < j <= i, W = `sliding_window` (4096 in
v0.1). Information still travels further than W through the layers (k layers reach k W back).
v0.2 and v0.3 dropped the window (their configs import as windowless) and raised rope theta.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.models.family import ModelFamily
from meshtrain.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """Mistral's architecture (a Llama whose attention may slide)."""

    vocab_size: int = 32000
    max_seq_len: int = 32768
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    sliding_window: int | None = 4096


def _mistral(layers: int, hidden: int, heads: int, kv: int, ffn: int, **kw) -> MistralConfig:
    return MistralConfig(num_layers=layers, hidden_size=hidden, num_heads=heads,
                         num_kv_heads=kv, ffn_hidden_size=ffn, **kw)


PRESETS: dict[str, MistralConfig] = {
    # 4 layers, 8 heads sharing 2 key/value heads and a window of 16: sequences of 32 and more
    # see it cut; tp 1/2, cp 2 and pp 2 all divide it.
    "mistral-tiny": _mistral(4, 64, 8, 2, 176, vocab_size=256, max_seq_len=256,
                             sliding_window=16),
    # Published shapes (the Mistral 7B paper and the v0.1 config.json).
    "mistral-7b-v0.1": _mistral(32, 4096, 32, 8, 14336, sliding_window=4096),
}


class Mistral(Llama):
    """Mistral: Llama's model; its window reaches every attention path through the mask."""

    family = "mistral"
    cfg: MistralConfig


FAMILY = ModelFamily("mistral", MistralConfig, Mistral, PRESETS)
