"""DeepSeek-V3 and Hugging Face's DeepseekV3ForCausalLM.

Names: Llama's for the embedding, norms, dense MLPs and output layer; the attention's q_proj
(or q_a_proj, q_a_layernorm, q_b_proj), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and
o_proj are our q (q_down, q_norm, q_up), kv_down, kv_norm, kv_up and proj, unpermuted (both
rotate interleaved pairs by `rope_interleave`); an MoE layer's router, experts and shared
expert are `hf_experts.ExpertNames`' (its shared expert named shared_experts), and
mlp.gate.e_score_correction_bias is our router's choice bias, kept in the checkpoint's routing
state (`routing/...expert_bias`).

config.json, field by field (mapped, ignored as not changing the model, or refused):
- vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
  max_position_embeddings, rms_norm_eps, initializer_range, tie_word_embeddings: as Llama's.
- num_key_value_heads: must equal num_attention_heads (MLA's keys have every head).
- q_lora_rank (null: 0), kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim,
  rope_interleave: the MLA settings of the same names.
- rope_parameters / rope_scaling: default or yarn (factor, original_max_position_embeddings,
  beta_fast, beta_slow, mscale, mscale_all_dim); another type, an explicit attention_factor or
  truncate false refused.
- n_routed_experts, num_experts_per_tok, moe_intermediate_size: `moe_experts`, `moe_top_k`,
  `moe_ffn_size`; n_shared_experts: `moe_shared_ffn_size` = it x moe_intermediate_size (0:
  none); first_k_dense_replace: `moe_first_dense`; moe_layer_freq: must be 1.
- norm_topk_prob, routed_scaling_factor: `moe_norm_topk_prob`, `moe_routed_scaling`.
- scoring_func: must be sigmoid; topk_method: must be noaux_tc (the bias-corrected choice).
- n_group, topk_group: `moe_groups`, `moe_topk_groups` (group-limited routing; their checks,
  e.g. topk_group above n_group, are the config's).
- hidden_act: must be silu; attention_bias: must be false.
- num_nextn_predict_layers (the multi-token-prediction layers, model.layers.{n + i}.*): their
  tensors are kept as they are (`verify.KEPT`) and written back by export; meshtrain does not
  build or train them (a checkpoint saved by training has none).
- aux_loss_alpha, seq_aux (DeepSeek's sequence-wise balancing loss in training; transformers
  computes none, and the import leaves `moe_seq_aux_loss_coef` 0: set it to train with one),
  use_cache, output_router_logits, attention_dropout, ep_size,
  pretraining_tp, token ids, torch_dtype/dtype, quantization_config (refused when present:
  fp8 block-quantized weights are not imported): ignored unless said otherwise.
Imported routing trains its bias at DeepSeek's rate 0.001 (`moe_bias_rate`), dropless.
DeepseekV2ForCausalLM (softmax scores, greedy routing) is refused by `hf_io.mapping_for`.
"""

from __future__ import annotations

from meshtrain.checkpointing.model_files import ROUTING
from meshtrain.interop.hf_experts import ExpertNames
from meshtrain.interop.hf_llama import _LAYER as _LLAMA_LAYER
from meshtrain.interop.hf_llama import LlamaMapping, _rope_parameters
from meshtrain.interop.hf_mapping import (
    TensorMap,
    check_divides,
    expect,
    hf_field,
    hf_flag,
    hf_number,
    hf_size,
    refused,
)
from meshtrain.models.deepseek_v3 import DeepseekV3Config

_ATTENTION = {"q.weight": ("q_proj",), "q_down.weight": ("q_a_proj",),
              "q_norm.weight": ("q_a_layernorm",), "q_up.weight": ("q_b_proj",),
              "kv_down.weight": ("kv_a_proj_with_mqa",), "kv_norm.weight": ("kv_a_layernorm",),
              "kv_up.weight": ("kv_b_proj",), "proj.weight": ("o_proj",)}
_YARN = {"rope_factor": "factor", "rope_beta_fast": "beta_fast",
         "rope_beta_slow": "beta_slow", "rope_mscale": "mscale",
         "rope_mscale_all_dim": "mscale_all_dim"}
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}


def _yarn(hf: dict) -> dict:
    """Our rotary fields of config.json: default or yarn."""
    field, params = _rope_parameters(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise refused(f'config.json "{field}": rope type {kind!r} cannot be imported: meshtrain'
                      "'s deepseek-v3 implements default and yarn rotary positions")
    theta = hf_number(params, "rope_theta") if params.get("rope_theta") is not None else \
        hf_number(hf, "rope_theta", 10000.0)
    if kind == "default":
        return {"rope_theta": theta}
    expect(params, "attention_factor", (None,), None, "meshtrain derives YaRN's attention"
                                                      " factor from mscale and mscale_all_dim")
    expect(params, "truncate", (True,), True, "meshtrain's YaRN ramp has whole-dimension bounds")
    return {"rope_theta": theta, "rope_scaling": "yarn",
            "rope_original_max_positions": hf_size(params, "original_max_position_embeddings"),
            **{ours: hf_number(params, theirs, _YARN_DEFAULTS.get(theirs),
                               positive=theirs not in ("mscale", "mscale_all_dim"))
               for ours, theirs in _YARN.items()}}


class DeepseekV3Mapping(LlamaMapping):
    """DeepseekV3ForCausalLM."""

    family = "deepseek-v3"
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    config_class = DeepseekV3Config
    experts = ExpertNames(shared="shared_experts")

    kept_note = ("meshtrain: kept {count} multi-token-prediction tensors as they are (export"
                 " writes them back); meshtrain does not train them")

    def kept(self, name: str, hf: dict, cfg: DeepseekV3Config) -> bool:
        """The multi-token-prediction layers: model.layers.{n + i}.* for i below
        "num_nextn_predict_layers"."""
        extra = hf.get("num_nextn_predict_layers") or 0
        layer = name.removeprefix(self.base_prefix + "layers.").split(".", 1)[0]
        return type(extra) is int and name.startswith(self.base_prefix + "layers.") \
            and layer.isdigit() and cfg.num_layers <= int(layer) < cfg.num_layers + extra

    def kept_config(self, names: list[str]) -> dict:
        layers = {name.removeprefix(self.base_prefix + "layers.").split(".", 1)[0]
                  for name in names}
        return {"num_nextn_predict_layers": len(layers)}

    def config_from_hf(self, hf: dict) -> DeepseekV3Config:
        expect(hf, "hidden_act", ("silu",), "silu", "meshtrain's deepseek-v3 uses SwiGLU (silu)")
        return self.config_class(**self.config_fields(hf))

    def config_fields(self, hf: dict) -> dict:
        expect(hf, "attention_bias", (False,), False, "meshtrain's deepseek-v3 has no biases")
        expect(hf, "quantization_config", (None,), None, "meshtrain imports unquantized"
                                                         " weights (dequantize them first)")
        heads = hf_size(hf, "num_attention_heads")
        expect(hf, "num_key_value_heads", (heads,), heads, "multi-head latent attention gives"
               " every head its key")
        fields = dict(
            num_layers=hf_size(hf, "num_hidden_layers"), hidden_size=hf_size(hf, "hidden_size"),
            num_heads=heads, vocab_size=hf_size(hf, "vocab_size"),
            max_seq_len=hf_size(hf, "max_position_embeddings", 4096),
            ffn_hidden_size=hf_size(hf, "intermediate_size"),
            rms_norm_eps=hf_number(hf, "rms_norm_eps", 1e-6),
            tie_word_embeddings=hf_flag(hf, "tie_word_embeddings", False),
            init_std=hf_number(hf, "initializer_range", 0.02, positive=False),
            q_lora_rank=hf_size(hf, "q_lora_rank", None) or 0,
            kv_lora_rank=hf_size(hf, "kv_lora_rank"),
            qk_rope_head_dim=hf_size(hf, "qk_rope_head_dim"),
            qk_nope_head_dim=hf_size(hf, "qk_nope_head_dim"),
            v_head_dim=hf_size(hf, "v_head_dim"),
            rope_interleave=hf_flag(hf, "rope_interleave", True), **_yarn(hf))
        check_divides(("num_attention_heads", heads), ("hidden_size", fields["hidden_size"]),
                      "meshtrain's configs keep hidden_size a multiple of the heads")
        return fields | self._moe_fields(hf)

    def _moe_fields(self, hf: dict) -> dict:
        expect(hf, "scoring_func", ("sigmoid",), "sigmoid", "meshtrain's deepseek-v3 routes by"
                                                            " sigmoid scores")
        expect(hf, "topk_method", ("noaux_tc",), "noaux_tc", "meshtrain's deepseek-v3 chooses"
                                                             " by the bias-corrected scores")
        expect(hf, "moe_layer_freq", (1,), 1, "every layer after the dense ones is MoE")
        experts, width = hf_size(hf, "n_routed_experts"), hf_size(hf, "moe_intermediate_size")
        shared = hf_field(hf, "n_shared_experts", 0)
        if type(shared) is not int or shared < 0:
            raise refused(f'config.json "n_shared_experts": {shared!r} is not an integer >= 0;'
                          " fix the field")
        dense = hf_field(hf, "first_k_dense_replace", 0)
        if type(dense) is not int or dense < 0:
            raise refused(f'config.json "first_k_dense_replace": {dense!r} is not an integer'
                          " >= 0; fix the field")
        return dict(moe_experts=experts, moe_top_k=hf_size(hf, "num_experts_per_tok"),
                    moe_groups=hf_size(hf, "n_group", 1),
                    moe_topk_groups=hf_size(hf, "topk_group", 1),
                    moe_ffn_size=width, moe_shared_ffn_size=shared * width,
                    moe_shared_gate="none" if shared else None, moe_first_dense=dense,
                    moe_score="sigmoid", moe_norm_topk_prob=hf_flag(hf, "norm_topk_prob", True),
                    moe_routed_scaling=hf_number(hf, "routed_scaling_factor", 1.0),
                    moe_capacity_factor=0.0, moe_aux_loss_coef=0.0, moe_bias_rate=0.001)

    def config_to_hf(self, cfg: DeepseekV3Config) -> dict:
        rope = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling:
            rope |= {theirs: getattr(cfg, ours) for ours, theirs in _YARN.items()}
            rope["original_max_position_embeddings"] = cfg.rope_original_max_positions
        width = cfg.expert_ffn_size
        return {"architectures": [self.architecture], "model_type": self.model_type,
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
                "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_norm_eps,
                "hidden_act": "silu", "attention_bias": False,
                "tie_word_embeddings": cfg.tie_word_embeddings,
                "initializer_range": cfg.init_std, "rope_parameters": rope,
                "rope_interleave": cfg.rope_interleave,
                "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_lora_rank,
                "qk_rope_head_dim": cfg.qk_rope_head_dim,
                "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
                "n_routed_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
                "moe_intermediate_size": width,
                "n_shared_experts": cfg.moe_shared_ffn_size // width,
                "first_k_dense_replace": cfg.moe_first_dense, "n_group": cfg.moe_groups,
                "topk_group": cfg.moe_topk_groups,
                "norm_topk_prob": bool(cfg.moe_norm_topk_prob),
                "routed_scaling_factor": cfg.moe_routed_scaling, "scoring_func": "sigmoid",
                "topk_method": "noaux_tc", "num_nextn_predict_layers": 0}

    def tensor_maps(self, cfg: DeepseekV3Config) -> list[TensorMap]:
        m = self.base_prefix
        maps = [TensorMap("embedding.word.weight", (m + "embed_tokens.weight",))]
        for i in range(cfg.num_layers):
            maps += [TensorMap(ours if ours.startswith(ROUTING) else f"layers.{i}.{ours}",
                               tuple(f"{m}layers.{i}.{t}" for t in theirs))
                     for ours, theirs in self._layer(cfg, i)]
        maps.append(TensorMap("final_norm.weight", (m + "norm.weight",)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("head.weight", ("lm_head.weight",)))
        return maps

    def _layer(self, cfg: DeepseekV3Config, i: int) -> list[tuple[str, tuple[str, ...]]]:
        """Layer `i`'s (ours, theirs) pairs in the order of `parameter_shapes`."""
        attention = [(f"attn.{ours}", tuple(f"self_attn.{t}.weight" for t in theirs))
                     for ours, theirs in _ATTENTION.items()
                     if f"{ours}" in cfg.attention_shapes()]
        norms = dict(_LLAMA_LAYER)
        pairs = [("ln1.weight", norms["ln1.weight"]), *attention,
                 ("ln2.weight", norms["ln2.weight"])]
        if not cfg.is_moe_layer(i):
            return pairs + [(ours, theirs) for ours, theirs in _LLAMA_LAYER
                            if ours.startswith("mlp.")]
        pairs += self.experts.layer_tensors(cfg)
        if cfg.moe_bias_rate:
            pairs.append((f"{ROUTING}layers.{i}.mlp.router.expert_bias",
                          ("mlp.gate.e_score_correction_bias",)))
        return pairs


MAPPING = DeepseekV3Mapping()
