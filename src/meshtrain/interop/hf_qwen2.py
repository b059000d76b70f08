"""Qwen2 and Hugging Face's Qwen2ForCausalLM: Llama's mapping (names, rotary settings in both
config forms, tied or untied output layer) with the q/k/v biases, which `LlamaMapping` maps
after their weights where the config has them.

Windows: "use_sliding_window" slides "sliding_window" on the layers from "max_window_layers" on
(`window_start_layer`), or "layer_types" names each layer's attention; meshtrain windows the
layers from one layer on, so "layer_types" with a full layer after a sliding one is refused.
Exports write all four fields. Llama's bias fields are left out.
"""

from __future__ import annotations

from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import expect, hf_field, hf_flag, hf_size
from meshtrain.models.qwen2 import Qwen2Config


class Qwen2Mapping(LlamaMapping):
    family = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    config_class = Qwen2Config
    qkv_biases = True

    def config_fields(self, hf: dict) -> dict:
        return super().config_fields(hf) | {"qkv_bias": True} | _window(hf)

    def config_to_hf(self, cfg: Qwen2Config) -> dict:
        hf = super().config_to_hf(cfg)
        for llama_only in ("attention_bias", "mlp_bias", "head_dim"):
            del hf[llama_only]
        return hf

    def window_to_hf(self, cfg: Qwen2Config) -> dict:
        windowed = cfg.sliding_window is not None
        start = cfg.window_start_layer if windowed else cfg.num_layers
        return {"use_sliding_window": windowed, "sliding_window": cfg.sliding_window,
                "max_window_layers": start,
                "layer_types": ["sliding_attention" if i >= start else "full_attention"
                                for i in range(cfg.num_layers)]}


def _window(hf: dict) -> dict:
    """`sliding_window` and `window_start_layer` of a Qwen2 config.json (as transformers reads
    it: no window without "use_sliding_window", whatever "layer_types" says)."""
    if not hf_flag(hf, "use_sliding_window", False):
        return {}
    layers = hf_size(hf, "num_hidden_layers")
    types = hf_field(hf, "layer_types", None)
    if types is None:
        start = min(hf_size(hf, "max_window_layers", layers), layers)
    else:
        kinds = ("full_attention", "sliding_attention")
        listed = isinstance(types, list) and len(types) == layers and set(types) <= set(kinds)
        start = types.index(kinds[1]) if listed and kinds[1] in types else layers
        expect(hf, "layer_types", (types,) if listed and kinds[0] not in types[start:] else (),
               None, f"meshtrain windows the layers from one layer on: list {kinds[0]} then"
               f" {kinds[1]} for each of the {layers} layers")
    if start == layers:
        return {}
    return {"sliding_window": hf_size(hf, "sliding_window"), "window_start_layer": start}


MAPPING = Qwen2Mapping()
