"""Qwen3-MoE and Hugging Face's Qwen3MoeForCausalLM: Llama's mapping (names, rotary settings,
"head_dim" as `head_size`) with Qwen3's head norms and, on the MoE layers, the MLP as
`hf_experts` maps it under `mlp` (the router `gate` and the experts; no shared expert).

Config: "head_dim" is read from config.json although transformers' config class does not
declare it (its attention reads it where present; absent, heads have hidden_size /
num_attention_heads dimensions); "num_experts" (transformers writes it as "num_local_experts"),
"num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step" and
"mlp_only_layers", the balancing loss as `hf_experts` says; "use_sliding_window" slides
"sliding_window" on every layer ("max_window_layers", which its attention ignores, is not
read). Refused: "attention_bias" (it biases the output projection too), "layer_types" (the
class has none: every layer's attention comes from "use_sliding_window"), and whatever
Llama's mapping refuses.
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_experts import (
    ExpertNames,
    qwen_experts_from_hf,
    qwen_experts_to_hf,
)
from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import expect, hf_field, hf_flag, hf_size, refused, shown
from meshtrain.models.qwen3_moe import Qwen3MoeConfig

_EXPERTS = ("num_experts", "num_local_experts")
"""The expert count's two spellings: the published files' and transformers' own on save."""


class Qwen3MoeMapping(LlamaMapping):
    family = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    config_class = Qwen3MoeConfig
    qk_norms = True
    experts = ExpertNames()

    def config_fields(self, hf: dict) -> dict:
        expect(hf, "layer_types", (None,), None, f"{self.architecture} sets every layer's"
               ' attention by "use_sliding_window": drop the field')
        field = _experts_field(hf)
        window = {"sliding_window": hf_size(hf, "sliding_window")} \
            if hf_flag(hf, "use_sliding_window", False) else {}
        return super().config_fields(hf) | window | qwen_experts_from_hf(hf, field) | {
            "qk_norm": True}

    def config_to_hf(self, cfg: Qwen3MoeConfig) -> dict:
        hf = super().config_to_hf(cfg)
        del hf["mlp_bias"]
        return hf | qwen_experts_to_hf(cfg, self.architecture)

    def window_to_hf(self, cfg: Qwen3MoeConfig) -> dict:
        if cfg.window_start_layer:
            raise SettingError(Code.HF_EXPORT, f"`window_start_layer` {cfg.window_start_layer}:"
                               f" {self.architecture} windows every layer; export it with"
                               " format meshtrain")
        return {"use_sliding_window": cfg.sliding_window is not None,
                "sliding_window": cfg.sliding_window}


def _experts_field(hf: dict) -> str:
    """The field holding the expert count; both spellings must agree where both are given."""
    given = [name for name in _EXPERTS if hf_field(hf, name, None) is not None]
    if len(given) == 2 and hf[_EXPERTS[0]] != hf[_EXPERTS[1]]:
        raise refused(f'config.json "{_EXPERTS[0]}" {shown(hf[_EXPERTS[0]])} and'
                      f' "{_EXPERTS[1]}" {shown(hf[_EXPERTS[1]])} differ (they name one'
                      " count); keep one")
    return given[0] if given else _EXPERTS[0]


MAPPING = Qwen3MoeMapping()
