"""Qwen2 and Qwen2.5 (Qwen team 2024): Llama's blocks (RMSNorm in fp32, rotary positions,
SwiGLU, grouped-query attention) with a bias on the query, key and value projections (the
output projection and the MLP have none), rotary theta 10^6, and the output layer tied to the
embedding at the small sizes.

Qwen2's sliding windows (`use_sliding_window`, off in every released Qwen2.5 model) apply to
the layers from `max_window_layers` on: here `sliding_window` from `window_start_layer` on.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import Code, SettingError
from meshtrain.models.family import ModelFamily
from meshtrain.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """Qwen2's architecture (a Llama with q/k/v biases)."""

    vocab_size: int = 151936
    max_seq_len: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    qkv_bias: bool = True

    def validate(self) -> None:
        super().validate()
        if not self.qkv_bias:
            raise SettingError(Code.MODEL_UNSUPPORTED, "`qkv_bias` cannot be off in Qwen2 (its"
                                                       " q, k and v projections have biases):"
                                                       " drop it")


def _qwen2(layers: int, hidden: int, heads: int, kv: int, ffn: int, **kw) -> Qwen2Config:
    return Qwen2Config(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                       ffn_hidden_size=ffn, **kw)


PRESETS: dict[str, Qwen2Config] = {
    # 4 layers, 8 heads sharing 2 key/value heads, tied: tp 1/2 (tp 4 shares each key/value
    # head by two ranks), pp 2 and 2d (q = 2) all divide it.
    "qwen2-tiny": _qwen2(4, 64, 8, 2, 176, vocab_size=256, max_seq_len=256,
                         tie_word_embeddings=True),
    # Published shapes (the Qwen2.5 model cards and configs).
    "qwen2.5-0.5b": _qwen2(24, 896, 14, 2, 4864, tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen2(28, 1536, 12, 2, 8960, tie_word_embeddings=True),
    "qwen2.5-7b": _qwen2(28, 3584, 28, 4, 18944, vocab_size=152064),
}


class Qwen2(Llama):
    """Qwen2: Llama's model, its q/k/v biases from `Qwen2Config.qkv_bias`."""

    family = "qwen2"
    cfg: Qwen2Config


FAMILY = ModelFamily("qwen2", Qwen2Config, Qwen2, PRESETS)
