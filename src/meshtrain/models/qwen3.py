"""Qwen3 (Qwen team 2025, dense models): Llama's blocks (RMSNorm in fp32, rotary positions,
SwiGLU, grouped-query attention, no biases) with an RMSNorm over each head's queries and keys
before their rotary positions (`qk_norm`: one scale of head_dim shared by all heads, which
replaced Qwen2's q/k/v biases) and heads of 128 dimensions at every size (`head_size`, not
hidden / heads: 0.6B has 16 heads of 128 on a hidden size of 1024).

Qwen3's sliding windows (off in every released model) are Qwen2's: `sliding_window` from
`window_start_layer` on.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import Code, SettingError
from meshtrain.models.family import ModelFamily
from meshtrain.models.llama import Llama, LlamaConfig


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Qwen3's architecture (a Llama with query/key head norms and its own head size)."""

    vocab_size: int = 151936
    max_seq_len: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    qk_norm: bool = True
    head_size: int | None = 128

    def validate(self) -> None:
        super().validate()
        if not self.qk_norm:
            raise SettingError(Code.MODEL_UNSUPPORTED, "`qk_norm` cannot be off in Qwen3 (its"
                                                       " queries and keys are normalised per"
                                                       " head): drop it")


def _qwen3(layers: int, hidden: int, heads: int, kv: int, ffn: int, **kw) -> Qwen3Config:
    return Qwen3Config(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                       ffn_hidden_size=ffn, **kw)


PRESETS: dict[str, Qwen3Config] = {
    # 4 layers, 8 heads of 16 on a hidden size of 64 (heads wider than hidden / heads, as in
    # 0.6B) sharing 2 key/value heads, tied: tp 1/2, cp 2, pp 2 and 2d (q = 2) all divide it.
    "qwen3-tiny": _qwen3(4, 64, 8, 2, 176, head_size=16, vocab_size=256, max_seq_len=256,
                         tie_word_embeddings=True),
    # Published shapes (the Qwen3 model cards and config.json files).
    "qwen3-0.6b": _qwen3(28, 1024, 16, 8, 3072, tie_word_embeddings=True),
    "qwen3-8b": _qwen3(36, 4096, 32, 8, 12288),
}


class Qwen3(Llama):
    """Qwen3: Llama's model, its head norms from `Qwen3Config.qk_norm`."""

    family = "qwen3"
    cfg: Qwen3Config


FAMILY = ModelFamily("qwen3", Qwen3Config, Qwen3, PRESETS)
