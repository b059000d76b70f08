"""Llama and Hugging Face's LlamaForCausalLM.

Names: `model.embed_tokens`/`layers.{i}`/`norm` and `lm_head` are our embedding, layers, final
norm and untied output layer; q_proj is our query projection, k_proj and v_proj are the two
blocks of our key/value projection, gate_proj and up_proj the two blocks of our SwiGLU input.
Both use the half-split rotary convention, so no weight is permuted.

Rotary settings are read in both forms: transformers 4's "rope_theta" and "rope_scaling" and
transformers 5's "rope_parameters" (written on export). Refused: a rotary type other than
default and llama3 (or a partial rotary factor), biases (Hugging Face's attention_bias also
biases the output projection), another activation than silu. "head_dim" (when it is not
hidden_size / num_attention_heads) is our `head_size`. A family built on Llama's blocks (Qwen2,
Qwen3) extends this mapping. Token ids, dropout, the initializer
range, "pretraining_tp" and the like do not change the model and are not refused (an export
takes its token ids from the run's tokenizer: see `hf_io.export_hf`).
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_experts import ExpertNames
from meshtrain.interop.hf_mapping import (
    HFMapping,
    TensorMap,
    check_divides,
    expect,
    hf_flag,
    hf_number,
    hf_size,
    refused,
    shown,
)
from meshtrain.models.llama import LlamaConfig

_LAYER = (  # ours, theirs (joined along the rows)
    ("ln1.weight", ("input_layernorm.weight",)),
    ("attn.qkv.q.weight", ("self_attn.q_proj.weight",)),
    ("attn.qkv.kv.weight", ("self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("attn.proj.weight", ("self_attn.o_proj.weight",)),
    ("ln2.weight", ("post_attention_layernorm.weight",)),
    ("mlp.fc.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.proj.weight", ("mlp.down_proj.weight",)),
)
_LLAMA3 = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
           "rope_high_freq_factor": "high_freq_factor",
           "rope_original_max_positions": "original_max_position_embeddings"}
_DEFAULT_THETA = 10000.0


def _rope_parameters(hf: dict) -> tuple[str, dict]:
    """The rotary settings' field and a copy of its object, from either form of config.json
    (transformers 5's "rope_parameters" wins, as there)."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise refused(f'config.json "{field}": {shown(params)} is not an object of rotary'
                      " settings; fix the field")
    return field, dict(params)


def _rope(hf: dict) -> dict:
    """Our rotary fields from either form of config.json (the original context defaults to
    "max_position_embeddings", as there)."""
    field, params = _rope_parameters(hf)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise refused(f'config.json "{field}": rope type {shown(kind)} cannot be imported:'
                      " meshtrain implements default and llama3 rotary positions")
    expect(params, "partial_rotary_factor", (1, 1.0), 1.0,
           "meshtrain rotates the whole head dimension")
    theta = hf_number(params, "rope_theta") if params.get("rope_theta") is not None else \
        hf_number(hf, "rope_theta", _DEFAULT_THETA)
    if kind == "default":
        return {"rope_theta": theta}
    params.setdefault("original_max_position_embeddings",
                      hf_size(hf, "max_position_embeddings", 2048))
    return {"rope_theta": theta, "rope_scaling": "llama3",
            **{ours: hf_number(params, theirs) for ours, theirs in _LLAMA3.items()
               if ours != "rope_original_max_positions"},
            "rope_original_max_positions": hf_size(params, "original_max_position_embeddings")}


class LlamaMapping(HFMapping):
    """LlamaForCausalLM; a family built on Llama's blocks extends it (`config_class`,
    `config_fields`, `config_to_hf`, `layer_tensors`) rather than writing its own."""

    family = "llama"
    architecture = "LlamaForCausalLM"
    model_type = "llama"
    base_prefix = "model."
    buffers = ("rotary_emb.inv_freq",)  # rotary tables older files saved
    config_class = LlamaConfig
    qkv_biases = False
    """Whether the architecture can bias q, k and v alone (Llama's attention_bias also biases
    the output projection)."""
    qk_norms = False
    """Whether the architecture normalises each head's queries and keys (Qwen3)."""
    experts: ExpertNames | None = None
    """How the files name an MoE layer's tensors (`hf_experts`); None: no MoE layers."""

    def config_from_hf(self, hf: dict) -> LlamaConfig:
        expect(hf, "hidden_act", ("silu",), "silu", f"meshtrain's {self.family} uses SwiGLU"
                                                    " (silu)")
        return self.config_class(**self.config_fields(hf))

    def config_fields(self, hf: dict) -> dict:
        """Our config's fields from config.json's (refusing what the family cannot
        compute)."""
        for bias in ("attention_bias", "mlp_bias"):
            expect(hf, bias, (False,), False, "meshtrain's Llama has no biases")
        hidden, heads = hf_size(hf, "hidden_size"), hf_size(hf, "num_attention_heads")
        kv_heads = hf_size(hf, "num_key_value_heads", heads)
        head_dim = hf_size(hf, "head_dim", None)
        if head_dim is None:
            check_divides(("num_attention_heads", heads), ("hidden_size", hidden),
                          "without \"head_dim\" each head has hidden_size /"
                          " num_attention_heads dimensions")
        check_divides(("num_key_value_heads", kv_heads), ("num_attention_heads", heads),
                      "each key/value head serves a group of query heads")
        return dict(
            num_layers=hf_size(hf, "num_hidden_layers"), hidden_size=hidden, num_heads=heads,
            num_kv_heads=kv_heads, vocab_size=hf_size(hf, "vocab_size"),
            head_size=None if head_dim in (None, hidden / heads) else head_dim,
            max_seq_len=hf_size(hf, "max_position_embeddings", 2048),
            ffn_hidden_size=hf_size(hf, "intermediate_size"),
            rms_norm_eps=hf_number(hf, "rms_norm_eps", 1e-6),
            tie_word_embeddings=hf_flag(hf, "tie_word_embeddings", False),
            init_std=hf_number(hf, "initializer_range", 0.02, positive=False), **_rope(hf))

    def config_to_hf(self, cfg: LlamaConfig) -> dict:
        if cfg.moe_experts and self.experts is None:
            raise SettingError(Code.HF_EXPORT, f"`moe_experts` {cfg.moe_experts}:"
                               f" {self.architecture} has no experts; export it with format"
                               " meshtrain")
        if cfg.qkv_bias and not self.qkv_biases:
            raise SettingError(Code.HF_EXPORT, f"`qkv_bias`: {self.architecture}'s attention_bias"
                               " also biases the output projection; export it with format"
                               " meshtrain")
        if cfg.qk_norm and not self.qk_norms:
            raise SettingError(Code.HF_EXPORT, f"`qk_norm`: {self.architecture} has no query"
                               " and key norms; export it with format meshtrain")
        rope = {"rope_type": cfg.rope_scaling or "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling:
            rope |= {theirs: getattr(cfg, ours) for ours, theirs in _LLAMA3.items()}
        return {"architectures": [self.architecture], "model_type": self.model_type,
                "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
                "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
                "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
                "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
                "attention_bias": False, "mlp_bias": False,
                "tie_word_embeddings": cfg.tie_word_embeddings,
                "initializer_range": cfg.init_std, "rope_parameters": rope}

    def layer_tensors(self, cfg: LlamaConfig, layer: int
                      ) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Layer `layer`'s tensors: (ours, theirs joined along the rows), q/k/v biases after
        their weights and the q/k head norms after the output projection where the config has
        them, an MoE layer's MLP as `experts` names it."""
        tensors = _LAYER
        if cfg.is_moe_layer(layer):
            tensors = tuple(t for t in _LAYER if not t[0].startswith("mlp.")) \
                + self.experts.layer_tensors(cfg)
        after = {}
        if cfg.qkv_bias:
            after |= {"attn.qkv.q.weight": (("attn.qkv.q.bias", ("self_attn.q_proj.bias",)),),
                      "attn.qkv.kv.weight": (("attn.qkv.kv.bias", ("self_attn.k_proj.bias",
                                                                   "self_attn.v_proj.bias")),)}
        if cfg.qk_norm:
            after["attn.proj.weight"] = (("attn.q_norm.weight", ("self_attn.q_norm.weight",)),
                                         ("attn.k_norm.weight", ("self_attn.k_norm.weight",)))
        return tuple(entry for ours, theirs in tensors
                     for entry in ((ours, theirs), *after.get(ours, ())))

    def tensor_maps(self, cfg: LlamaConfig) -> list[TensorMap]:
        m = self.base_prefix
        maps = [TensorMap("embedding.word.weight", (m + "embed_tokens.weight",))]
        for i in range(cfg.num_layers):
            maps += [TensorMap(f"layers.{i}.{ours}",
                               tuple(f"{m}layers.{i}.{name}" for name in theirs))
                     for ours, theirs in self.layer_tensors(cfg, i)]
        maps.append(TensorMap("final_norm.weight", (m + "norm.weight",)))
        if not cfg.tie_word_embeddings:
            maps.append(TensorMap("head.weight", ("lm_head.weight",)))
        return maps


MAPPING = LlamaMapping()
