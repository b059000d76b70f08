"""Qwen2 and Hugging Face's Qwen2ForCausalLM: Llama's mapping (names, rotary settings in both
config forms, tied or untied output layer) with the q/k/v biases, which `LlamaMapping` maps
after their weights where the config has them.

Windows: "use_sliding_window" slides "sliding_window" on the layers from "max_window_layers" on
(`window_start_layer`), or "layer_types" names each layer's attention; meshtrain windows the
layers from one layer on, so "layer_types" with a full layer after a sliding one is refused.
Exports write all four fields. Llama's bias fields are left out, and "head_dim" unless
`head_size` is set.
"""

from __future__ import annotations

from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import expect, hf_field, hf_flag, hf_size
from meshtrain.models import TransformerConfig
from meshtrain.models.qwen2 import Qwen2Config


class Qwen2Mapping(LlamaMapping):
    family = "qwen2"
    architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    config_class = Qwen2Config
    qkv_biases = True

    def config_fields(self, hf: dict) -> dict:
        return super().config_fields(hf) | {"qkv_bias": True} | window_fields(hf)

    def config_to_hf(self, cfg: Qwen2Config) -> dict:
        hf = super().config_to_hf(cfg)
        llama_only = ("attention_bias", "mlp_bias") + ("head_dim",) * (cfg.head_size is None)
        for name in llama_only:  # (transformers' Qwen2 reads "head_dim" where it is written)
            del hf[name]
        return hf

    def window_to_hf(self, cfg: Qwen2Config) -> dict:
        return window_to_hf(cfg)


def window_to_hf(cfg: TransformerConfig) -> dict:
    """The four window fields of a Qwen2 or Qwen3 config.json."""
    windowed = cfg.sliding_window is not None
    start = cfg.window_start_layer if windowed else cfg.num_layers
    return {"use_sliding_window": windowed, "sliding_window": cfg.sliding_window,
            "max_window_layers": start,
            "layer_types": ["sliding_attention" if i >= start else "full_attention"
                            for i in range(cfg.num_layers)]}


def window_fields(hf: dict) -> dict:
    """`sliding_window` and `window_start_layer` of a Qwen2 or Qwen3 config.json (as
    transformers reads it: no window without "use_sliding_window", whatever "layer_types"
    says); "layer_types" other than full and sliding attention, one a layer, refused."""
    layers = hf_size(hf, "num_hidden_layers")
    types, kinds = hf_field(hf, "layer_types", None), ("full_attention", "sliding_attention")
    listed = isinstance(types, list) and len(types) == layers and all(t in kinds for t in types)
    expect(hf, "layer_types", (types,) if types is None or listed else (), None,
           f"meshtrain's layers attend as {kinds[0]} or {kinds[1]}, one entry for each of the"
           f" {layers} layers")
    if not hf_flag(hf, "use_sliding_window", False):
        return {}
    if types is None:
        start = min(hf_size(hf, "max_window_layers", layers), layers)
    else:
        start = types.index(kinds[1]) if kinds[1] in types else layers
        expect(hf, "layer_types", (types,) if kinds[0] not in types[start:] else (), None,
               f"meshtrain windows the layers from one layer on: list {kinds[0]} then"
               f" {kinds[1]} for each of the {layers} layers")
    if start == layers:
        return {}
    return {"sliding_window": hf_size(hf, "sliding_window"), "window_start_layer": start}


MAPPING = Qwen2Mapping()
