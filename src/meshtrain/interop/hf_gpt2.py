"""GPT and Hugging Face's GPT2LMHeadModel.

Names: `transformer.wte`/`wpe`/`h.{i}`/`ln_f` are our embedding, positions, layers and final
norm. GPT-2's Conv1D layers store weights [in, out]: they are transposed both ways. Its c_attn
columns are q | k | v, which are our fused projection's rows q, k, v. The output layer is the
token embedding (`lm_head.weight`, when a file has it, is not read, and is never written).

Refused: another activation than the tanh GeLU, unscaled or layer-scaled attention scores,
cross-attention, an untied output layer. Dropout probabilities are not carried over (meshtrain's
`dropout` is the run's setting); token ids and the initializer range do not change the model
(an export takes its token ids from the run's tokenizer: see `hf_io.export_hf`).
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_mapping import (
    HFMapping,
    TensorMap,
    check_divides,
    expect,
    hf_number,
    hf_size,
)
from meshtrain.models.gpt import GPTConfig

_LAYER = (  # ours, theirs, transposed (Conv1D)
    ("ln1.weight", "ln_1.weight", False), ("ln1.bias", "ln_1.bias", False),
    ("attn.qkv.weight", "attn.c_attn.weight", True), ("attn.qkv.bias", "attn.c_attn.bias", False),
    ("attn.proj.weight", "attn.c_proj.weight", True),
    ("attn.proj.bias", "attn.c_proj.bias", False),
    ("ln2.weight", "ln_2.weight", False), ("ln2.bias", "ln_2.bias", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", True), ("mlp.fc.bias", "mlp.c_fc.bias", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", True), ("mlp.proj.bias", "mlp.c_proj.bias", False),
)
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


class GPT2Mapping(HFMapping):
    family = "gpt"
    architecture = "GPT2LMHeadModel"
    model_type = "gpt2"
    base_prefix = "transformer."
    buffers = (".attn.bias", ".attn.masked_bias")  # causal masks older files saved

    def config_from_hf(self, hf: dict) -> GPTConfig:
        expect(hf, "activation_function", _TANH_GELU, "gelu_new",
               "meshtrain's GPT uses the tanh approximation of GeLU (gelu_new)")
        expect(hf, "scale_attn_weights", (True,), True,
               "meshtrain's GPT scales attention scores by 1/sqrt(head_dim)")
        expect(hf, "scale_attn_by_inverse_layer_idx", (False,), False,
               "meshtrain's GPT does not scale scores by layer")
        expect(hf, "add_cross_attention", (False,), False, "meshtrain's GPT is decoder-only")
        expect(hf, "tie_word_embeddings", (True,), True,
               "meshtrain's GPT ties its output layer to the token embedding")
        hidden, heads = hf_size(hf, "n_embd"), hf_size(hf, "n_head")
        check_divides(("n_head", heads), ("n_embd", hidden), "each head has n_embd / n_head"
                                                             " dimensions")
        return GPTConfig(
            num_layers=hf_size(hf, "n_layer"), hidden_size=hidden, num_heads=heads,
            vocab_size=hf_size(hf, "vocab_size"), max_seq_len=hf_size(hf, "n_positions", 1024),
            ffn_hidden_size=hf_size(hf, "n_inner", None),  # None: 4h, as there
            layernorm_eps=hf_number(hf, "layer_norm_epsilon", 1e-5),
            init_std=hf_number(hf, "initializer_range", 0.02, positive=False))

    def config_to_hf(self, cfg: GPTConfig) -> dict:
        if cfg.moe_experts:
            raise SettingError(Code.HF_EXPORT, f"`moe_experts` {cfg.moe_experts}:"
                               f" {self.architecture} has no experts; export it with format"
                               " meshtrain")
        return {"architectures": [self.architecture], "model_type": self.model_type,
                "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len,
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
                "n_inner": cfg.ffn_hidden_size, "activation_function": "gelu_pytorch_tanh",
                "layer_norm_epsilon": cfg.layernorm_eps, "initializer_range": cfg.init_std,
                "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
                "scale_attn_weights": True, "tie_word_embeddings": True}

    def tensor_maps(self, cfg: GPTConfig) -> list[TensorMap]:
        t = self.base_prefix
        maps = [TensorMap("embedding.word.weight", (t + "wte.weight",)),
                TensorMap("embedding.position.weight", (t + "wpe.weight",))]
        for i in range(cfg.num_layers):
            maps += [TensorMap(f"layers.{i}.{ours}", (f"{t}h.{i}.{theirs}",), transpose)
                     for ours, theirs, transpose in _LAYER]
        return maps + [TensorMap("final_norm.weight", (t + "ln_f.weight",)),
                       TensorMap("final_norm.bias", (t + "ln_f.bias",))]


MAPPING = GPT2Mapping()
