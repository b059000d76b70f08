"""Mistral and Hugging Face's MistralForCausalLM: Llama's mapping (names, rotary settings in
both config forms, tied or untied output layer) plus "sliding_window", which v0.2 and v0.3
configs set to null (imported as windowless). Mistral has no bias fields in its config, so an
export leaves Llama's out.
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import hf_size
from meshtrain.models.mistral import MistralConfig


class MistralMapping(LlamaMapping):
    family = "mistral"
    architecture = "MistralForCausalLM"
    model_type = "mistral"
    config_class = MistralConfig

    def config_fields(self, hf: dict) -> dict:
        return super().config_fields(hf) | {"sliding_window": hf_size(hf, "sliding_window",
                                                                      None)}

    def config_to_hf(self, cfg: MistralConfig) -> dict:
        hf = super().config_to_hf(cfg)
        for llama_only in ("attention_bias", "mlp_bias"):
            del hf[llama_only]
        return hf

    def window_to_hf(self, cfg: MistralConfig) -> dict:
        if cfg.window_start_layer:
            raise SettingError(Code.HF_EXPORT, f"`window_start_layer` {cfg.window_start_layer}:"
                               f" {self.architecture} windows every layer; export it with"
                               " format meshtrain")
        return {"sliding_window": cfg.sliding_window}


MAPPING = MistralMapping()
