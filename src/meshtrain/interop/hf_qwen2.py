"""Qwen2 and Hugging Face's Qwen2ForCausalLM: Llama's mapping (names, rotary settings in both
config forms, tied or untied output layer) with the q/k/v biases, which `LlamaMapping` maps
after their weights where the config has them.

Refused: "use_sliding_window" true (Qwen2 windows only the layers from "max_window_layers" on;
meshtrain's windows cover every layer). Exported
configs say so ("use_sliding_window": false) and leave Llama's bias fields out.
"""

from __future__ import annotations

from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import expect
from meshtrain.models.qwen2 import Qwen2Config


class Qwen2Mapping(LlamaMapping):
    family = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    config_class = Qwen2Config
    qkv_biases = True

    def config_fields(self, hf: dict) -> dict:
        expect(hf, "use_sliding_window", (False,), False,
               "Qwen2 windows the layers from max_window_layers on, meshtrain every layer")
        return super().config_fields(hf) | {"qkv_bias": True}

    def config_to_hf(self, cfg: Qwen2Config) -> dict:
        hf = super().config_to_hf(cfg)
        for llama_only in ("attention_bias", "mlp_bias", "head_dim"):
            del hf[llama_only]
        return hf | {"use_sliding_window": False, "sliding_window": None,
                     "max_window_layers": cfg.num_layers}


MAPPING = Qwen2Mapping()
