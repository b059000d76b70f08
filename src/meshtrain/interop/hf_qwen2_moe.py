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
    layers_from_hf,
    layers_to_hf,
    normalises,
    routing_from_hf,
    routing_to_hf,
    shared_from_hf,
)
from meshtrain.interop.hf_llama import LlamaMapping
from meshtrain.interop.hf_mapping import expect, hf_flag, hf_size
from meshtrain.models.layer_pattern import LayerPattern
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
        pattern = layers_from_hf(hf)
        moe_layers = LayerPattern(pattern.get("moe_every", 1), 0,
                                  pattern.get("moe_layers")).count(layers)
        return super().config_fields(hf) | pattern | shared_from_hf(hf) | routing_from_hf(
            hf, experts_field="num_experts", moe_layers=moe_layers,
            norm_topk_prob=hf_flag(hf, "norm_topk_prob", False)) | {
            "qkv_bias": hf_flag(hf, "qkv_bias", True),
            "moe_ffn_size": hf_size(hf, "moe_intermediate_size")}

    def config_to_hf(self, cfg: Qwen2MoeConfig) -> dict:
        if cfg.moe_shared_gate != "sigmoid":
            raise SettingError(Code.HF_EXPORT, "the model has no sigmoid-gated shared expert"
                               f" (`moe_shared_gate`): {self.architecture} always has one;"
                               " export it with format meshtrain")
        hf = super().config_to_hf(cfg)
        for llama_only in ("attention_bias", "mlp_bias", "head_dim"):
            del hf[llama_only]
        return hf | layers_to_hf(cfg) | routing_to_hf(cfg, self.architecture,
                                                      experts_field="num_experts") | {
            "qkv_bias": cfg.qkv_bias, "moe_intermediate_size": cfg.expert_ffn_size,
            "shared_expert_intermediate_size": cfg.moe_shared_ffn_size,
            "norm_topk_prob": normalises(cfg), "use_sliding_window": False}


MAPPING = Qwen2MoeMapping()
