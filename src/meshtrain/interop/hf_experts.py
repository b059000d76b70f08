"""The MoE layer of a Hugging Face checkpoint, shared by every MoE family's mapping (Mixtral,
Qwen2-MoE, Qwen3-MoE): its tensors as the files name them, and the MoE fields of config.json.

Names: transformers 5 holds a layer's experts fused in memory (`experts.gate_up_proj`
[E, 2f, h], `experts.down_proj` [E, h, f]) but converts them on load and save, so files of
either version hold one tensor per expert and projection: `{block}.experts.{e}.{gate}`, `{up}`
and `{down}` (Qwen: `mlp` and gate_proj/up_proj/down_proj; Mixtral: `block_sparse_moe` and
w1/w3/w2), the router `{block}.gate`, and Qwen2-MoE's `shared_expert.*` and
`shared_expert_gate`. Ours: `mlp.router.weight`, `mlp.experts.{e}.fc` (gate | up as two
blocks) and `.proj`, `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`: the same numbers,
joined or split along the rows, so import then export is bitwise.

Config: "num_experts_per_tok" is `moe_top_k`; transformers routes dropless (`moe_capacity_factor`
0) by a softmax over the experts, its balancing loss counting all k choices (`moe_aux_loss_tokens`
all). That loss is added only with "output_router_logits", as "router_aux_loss_coef" x E x
sum_i F_i P_i with F and P pooled over the MoE layers (F summing to k); meshtrain's sums a loss per
layer (F summing to 1), so the coefficient is scaled by k / MoE layers: the two agree when every
layer routes alike, and cannot agree exactly otherwise. Which layers are MoE comes from
"decoder_sparse_step" and "mlp_only_layers" (Qwen), or is every layer (Mixtral).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import Code, SettingError
from meshtrain.interop.hf_mapping import hf_field, hf_flag, hf_number, hf_size, refused, shown
from meshtrain.models import TransformerConfig
from meshtrain.models.layer_pattern import LayerPattern


@dataclass(frozen=True)
class ExpertNames:
    """How a family's files name an MoE layer's tensors, under `model.layers.{i}.`."""

    block: str = "mlp"
    router: str = "gate"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "shared_expert"
    """The shared expert's name (DeepSeek: shared_experts)."""

    def layer_tensors(self, cfg: TransformerConfig) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """An MoE layer's MLP tensors (ours, theirs joined along the rows), in the order of our
        parameters: the router, the shared expert and its gate where the config has them, then
        every expert."""
        b = self.block
        tensors = [("mlp.router.weight", (f"{b}.{self.router}.weight",))]
        if cfg.moe_shared_ffn_size:
            tensors += self._mlp("mlp.shared_expert", f"{b}.{self.shared}")
        if cfg.moe_shared_gate == "sigmoid":
            tensors.append(("mlp.shared_expert_gate.weight", (f"{b}.shared_expert_gate.weight",)))
        for e in range(cfg.moe_experts):
            tensors += self._mlp(f"mlp.experts.{e}", f"{b}.experts.{e}")
        return tuple(tensors)

    def _mlp(self, ours: str, theirs: str) -> list[tuple[str, tuple[str, ...]]]:
        return [(f"{ours}.fc.weight", (f"{theirs}.{self.gate}.weight",
                                       f"{theirs}.{self.up}.weight")),
                (f"{ours}.proj.weight", (f"{theirs}.{self.down}.weight",))]


def routing_from_hf(hf: dict, *, experts_field: str, moe_layers: int,
                    norm_topk_prob: bool) -> dict:
    """Our routing fields of config.json: the expert count under `experts_field`, top-k,
    renormalisation (the architecture's rule), dropless softmax routing and the balancing
    loss (see the module doc); `moe_layers` MoE layers."""
    experts, top_k = hf_size(hf, experts_field), hf_size(hf, "num_experts_per_tok")
    if top_k > experts:
        raise refused(f'config.json "num_experts_per_tok" {top_k} exceeds "{experts_field}"'
                      f" {experts}; fix the fields")
    coef = hf_number(hf, "router_aux_loss_coef", 0.001, positive=False)
    aux = coef * top_k / moe_layers if hf_flag(hf, "output_router_logits", False) else 0.0
    return dict(moe_experts=experts, moe_top_k=top_k, moe_norm_topk_prob=norm_topk_prob,
                moe_capacity_factor=0.0, moe_aux_loss_coef=aux, moe_aux_loss_tokens="all")


def routing_to_hf(cfg: TransformerConfig, architecture: str, *, experts_field: str) -> dict:
    """config.json's routing fields for `cfg`; routing transformers does not compute (sigmoid
    scores, scaled weights, a choice bias) is refused."""
    for name, value, plain in (("moe_score", cfg.moe_score, "softmax"),
                               ("moe_routed_scaling", cfg.moe_routed_scaling, 1.0),
                               ("moe_bias_rate", cfg.moe_bias_rate, 0.0)):
        if value != plain:
            raise SettingError(Code.HF_EXPORT, f"`{name}` {value!r}: {architecture} routes by"
                               f" {name} {plain!r}; export it with format meshtrain")
    coef = cfg.moe_aux_loss_coef * cfg.num_moe_layers() / cfg.moe_top_k
    return {experts_field: cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
            "output_router_logits": coef > 0, "router_aux_loss_coef": coef}


def normalises(cfg: TransformerConfig) -> bool:
    """Whether the k chosen weights are renormalised to sum to 1 (`moe_norm_topk_prob`)."""
    return cfg.moe_top_k > 1 if cfg.moe_norm_topk_prob is None else cfg.moe_norm_topk_prob


def layers_from_hf(hf: dict) -> dict:
    """Our MoE layer pattern of "decoder_sparse_step" and "mlp_only_layers" (transformers: layer
    i is MoE when not listed and (i + 1) % step == 0)."""
    layers, step = hf_size(hf, "num_hidden_layers"), hf_size(hf, "decoder_sparse_step", 1)
    dense = hf_field(hf, "mlp_only_layers", [])
    if not isinstance(dense, list) or not all(type(i) is int for i in dense):
        raise refused(f'config.json "mlp_only_layers": {shown(dense)} is not a list of layer'
                      " indices; fix the field")
    chosen = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    if not chosen:
        raise refused(f'config.json "decoder_sparse_step" {step} and "mlp_only_layers"'
                      f" {shown(dense)} leave no MoE layer of {layers}: import a dense family")
    return {"moe_every": step} if not dense else {"moe_layers": tuple(chosen)}


def layers_to_hf(cfg: TransformerConfig) -> dict:
    """"decoder_sparse_step" and "mlp_only_layers" selecting `cfg`'s MoE layers."""
    pattern = cfg.moe_pattern
    step = pattern.every if pattern.layers is None else 1
    return {"decoder_sparse_step": step,
            "mlp_only_layers": [i for i in range(cfg.num_layers)
                                if (i + 1) % step == 0 and not cfg.is_moe_layer(i)]}


def shared_from_hf(hf: dict) -> dict:
    """Qwen2-MoE's shared expert: "shared_expert_intermediate_size" wide, sigmoid-gated."""
    return {"moe_shared_ffn_size": hf_size(hf, "shared_expert_intermediate_size"),
            "moe_shared_gate": "sigmoid"}


def qwen_experts_from_hf(hf: dict, experts_field: str) -> dict:
    """Qwen's MoE fields of config.json (Qwen2-MoE's and Qwen3-MoE's alike): the MoE layers,
    the routing ("norm_topk_prob" false unless set) and each expert's width."""
    pattern = layers_from_hf(hf)
    moe_layers = LayerPattern(pattern.get("moe_every", 1), 0, pattern.get("moe_layers")).count(
        hf_size(hf, "num_hidden_layers"))
    return pattern | routing_from_hf(
        hf, experts_field=experts_field, moe_layers=moe_layers,
        norm_topk_prob=hf_flag(hf, "norm_topk_prob", False)) | {
        "moe_ffn_size": hf_size(hf, "moe_intermediate_size")}


def qwen_experts_to_hf(cfg: TransformerConfig, architecture: str) -> dict:
    """config.json's Qwen MoE fields for `cfg` (the inverse of `qwen_experts_from_hf`)."""
    return layers_to_hf(cfg) | routing_to_hf(cfg, architecture, experts_field="num_experts") | {
        "moe_intermediate_size": cfg.expert_ffn_size, "norm_topk_prob": normalises(cfg)}
