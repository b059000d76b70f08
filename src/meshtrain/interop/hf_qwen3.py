"""Qwen3 and Hugging Face's Qwen3ForCausalLM: Llama's mapping (names, rotary settings in both
config forms, tied or untied output layer, "head_dim" as `head_size`) with the head norms
"self_attn.q_norm" and "self_attn.k_norm", which `LlamaMapping` maps after the output
projection, and Qwen2's window fields (`hf_qwen2.window_fields`: "use_sliding_window",
"sliding_window", "max_window_layers", "layer_types", an interleaved or unknown "layer_types"
refused).

Refused: "attention_bias" (in Qwen3 it biases the output projection too), and whatever Llama's
mapping refuses. Exports write "head_dim" always (Qwen3's default is 128, not hidden / heads).
"""

from __future__ import annotations

from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import hf_size
from meshtrain.interop.hf_qwen2 import window_fields, window_to_hf
from meshtrain.models.qwen3 import Qwen3Config


class Qwen3Mapping(LlamaMapping):
    family = "qwen3"
    architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"
    config_class = Qwen3Config
    qk_norms = True

    def config_fields(self, hf: dict) -> dict:
        """Llama's fields (refusing "attention_bias"), the head norms, Qwen3's head size (its
        config class defaults "head_dim" to 128) and windows."""
        hf = {"head_dim": 128} | hf
        return super().config_fields(hf) | window_fields(hf) | {
            "qk_norm": True, "head_size": hf_size(hf, "head_dim")}

    def config_to_hf(self, cfg: Qwen3Config) -> dict:
        hf = super().config_to_hf(cfg)
        del hf["mlp_bias"]
        return hf

    def window_to_hf(self, cfg: Qwen3Config) -> dict:
        return window_to_hf(cfg)


MAPPING = Qwen3Mapping()
