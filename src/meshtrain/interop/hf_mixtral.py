"""Mixtral and Hugging Face's MixtralForCausalLM: Mistral's mapping (names, rotary settings,
"sliding_window", null in 8x7B) with every layer's MLP as `hf_experts` maps it under
`block_sparse_moe` (experts' w1 | w3 -> our fc, w2 -> proj; `gate` -> our router).

Config: "num_local_experts" and "num_experts_per_tok" are `moe_experts` and `moe_top_k`;
"intermediate_size" is every expert's width; the k chosen weights are always renormalised
(`moe_norm_topk_prob`, even at k = 1, as transformers does); the balancing loss as
`hf_experts` says. Refused: "router_jitter_noise" other than 0 (meshtrain does not scale
the router's input by noise). Exports refuse what MixtralForCausalLM cannot hold: a dense
layer, a shared expert, unnormalised weights.
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_experts import ExpertNames, normalises, routing_from_hf, routing_to_hf
from meshtrain.interop.hf_mapping import expect, hf_size
from meshtrain.interop.hf_mistral import MistralMapping
from meshtrain.models.mixtral import MixtralConfig


class MixtralMapping(MistralMapping):
    family = "mixtral"
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    config_class = MixtralConfig
    experts = ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")

    def config_fields(self, hf: dict) -> dict:
        expect(hf, "router_jitter_noise", (0, 0.0), 0.0,
               "meshtrain does not multiply the router's input by noise; set it to 0")
        return super().config_fields(hf) | routing_from_hf(
            hf, experts_field="num_local_experts", moe_layers=hf_size(hf, "num_hidden_layers"),
            norm_topk_prob=True)

    def config_to_hf(self, cfg: MixtralConfig) -> dict:
        for refused, why in ((cfg.num_moe_layers() < cfg.num_layers, "a dense layer"),
                             (cfg.moe_shared_ffn_size > 0, "a shared expert"),
                             (not normalises(cfg), "unnormalised top-k weights")):
            if refused:
                raise SettingError(Code.HF_EXPORT, f"the model has {why}: {self.architecture}"
                                   " has none; export it with format meshtrain")
        return super().config_to_hf(cfg) | {"intermediate_size": cfg.expert_ffn_size,
                                            "router_jitter_noise": 0.0} \
            | routing_to_hf(cfg, self.architecture, experts_field="num_local_experts")


MAPPING = MixtralMapping()
