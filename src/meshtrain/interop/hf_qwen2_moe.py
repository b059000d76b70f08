"""Qwen2-MoE and Hugging Face's Qwen2MoeForCausalLM: Llama's mapping (names, rotary settings)
with q/k/v biases ("qkv_bias", true unless the file says otherwise) and, on the MoE layers, the
MLP as `hf_experts` maps it under `mlp`: the router `gate`, the experts, the shared expert and
its sigmoid gate `shared_expert_gate`.

Config: "num_experts", "num_experts_per_tok", "moe_intermediate_size" (each expert's width),
"shared_expert_intermediate_size", "norm_topk_prob" (false: the k chosen softmax weights are
used as they are), "decoder_sparse_step" and "mlp_only_layers" (which layers are MoE; the others
keep an MLP of "intermediate_size"), the balancing loss as `hf_experts` says. Refused:
"use_sliding_window" (transformers slides the window on alternate lower layers, which
meshtrain's windows from one layer on cannot express) and a "layer_types" naming any other
kind than full_attention.
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_experts import (
    ExpertNames,
    qwen_experts_from_hf,
    qwen_experts_to_hf,
    shared_from_hf,
)
from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import expect, hf_flag, hf_size
from meshtrain.models.qwen2_moe import Qwen2MoeConfig


class Qwen2MoeMapping(LlamaMapping):
    family = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    config_class = Qwen2MoeConfig
    qkv_biases = True
    experts = ExpertNames()

    def config_fields(self, hf: dict) -> dict:
        layers = hf_size(hf, "num_hidden_layers")
        expect(hf, "use_sliding_window", (False,), False, "Qwen2-MoE slides its window on"
               " alternate layers, and meshtrain windows the layers from one layer on; set it"
               " to false")
        expect(hf, "layer_types", (None, ["full_attention"] * layers), None,
               f"meshtrain's Qwen2-MoE attends in full: list full_attention {layers} times")
        return super().config_fields(hf) | shared_from_hf(hf) | qwen_experts_from_hf(
            hf, "num_experts") | {"qkv_bias": hf_flag(hf, "qkv_bias", True)}

    def config_to_hf(self, cfg: Qwen2MoeConfig) -> dict:
        if cfg.moe_shared_gate != "sigmoid":
            raise SettingError(Code.HF_EXPORT, "the model has no sigmoid-gated shared expert"
                               f" (`moe_shared_gate`): {self.architecture} always has one;"
                               " export it with format meshtrain")
        hf = super().config_to_hf(cfg)
        llama_only = ("attention_bias", "mlp_bias") + ("head_dim",) * (cfg.head_size is None)
        for name in llama_only:  # (transformers' Qwen2-MoE reads "head_dim" where it is written)
            del hf[name]
        return hf | qwen_experts_to_hf(cfg, self.architecture) | {
            "qkv_bias": cfg.qkv_bias, "shared_expert_intermediate_size": cfg.moe_shared_ffn_size,
            "use_sliding_window": False}


MAPPING = Qwen2MoeMapping()
