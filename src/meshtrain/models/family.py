"""What a model family is, and what every family shares.

A family (`gpt.py`, `llama.py`) gives: its config class (a `TransformerConfig`: validation,
parameter count, FLOPs per token, activation bytes), its presets, and its model class (a
`CausalLM`: built from the layer factory it is given for one pipeline stage, reporting the
`contracts.ParameterRoles` of its parameters). The trainer, gradient sync, ZeRO, clipping and
checkpoints ask these, never a family's attribute names.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from torch import nn

from meshtrain.errors import Code, SettingError, alternatives
from meshtrain.models.layer_pattern import LayerPattern
from meshtrain.parallel.layers.attention import ATTENTION_KERNELS
from meshtrain.parallel.layers.expert import SHARED_GATES
from meshtrain.parallel.layers.grouped_matmul import GEMMS
from meshtrain.parallel.layers.routing import AUX_SCOPES, AUX_TOKENS, SCORES, RoutingRule


def _setting(help: str, default: Any = MISSING, *, choices: tuple | None = None) -> Any:
    """A field a run sets by name, declared once: its help and choices make the flag and the
    [model] key of `meshtrain train` (`config.settings.ModelSettings`)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class TransformerConfig(ABC):
    """Architecture fields every decoder-only family has (parallel layout lives elsewhere).

    Error messages name settings in backticks (`num_heads`); the CLI shows them as flags.
    Fields declared with `_setting` are the run's [model] settings; `model_arg` sets the others.
    """

    num_layers: int = _setting("transformer layers")
    hidden_size: int = _setting("hidden size")
    num_heads: int = _setting("attention heads")
    vocab_size: int = _setting("token ids the embedding and output layer cover", 50257)
    max_seq_len: int = _setting("positions the model can embed", 1024)
    ffn_hidden_size: int | None = None
    """Width of the MLP; None means the family's default."""
    num_kv_heads: int | None = _setting("key/value heads of grouped-query attention (unset: as"
                                        " many as query heads)", None)
    qkv_bias: bool = False
    """Whether the query, key and value projections add a bias."""
    head_size: int | None = _setting("dimensions of each attention head (unset: hidden_size /"
                                     " num_heads; Qwen3 sets 128 at every size)", None)
    qk_norm: bool = _setting("an RMSNorm over each head's queries and keys before rotary"
                             " positions, one scale of head_dim shared by all heads (Qwen3)",
                             False)
    tie_word_embeddings: bool = _setting("tie the output layer to the embedding (Llama"
                                         " presets; the Llama 3.2 ones are tied, GPT always"
                                         " is)", True)
    sliding_window: int | None = None
    """Each token attends the last `sliding_window` positions (itself included); None: all."""
    window_start_layer: int = 0
    """The first layer the window applies to (Qwen2's `max_window_layers`): the layers before
    it attend every earlier position."""
    dropout: float = _setting("dropout on embeddings, attention probabilities and residual"
                              " branches (0 keeps runs comparable across layouts)", 0.0)
    init_std: float = 0.02
    attention: str = _setting("attention kernel: sdpa (torch's fused kernel) or eager"
                              " (explicit softmax(QK^T)V, saving the s x s scores)", "sdpa",
                              choices=ATTENTION_KERNELS)
    q_lora_rank: int = _setting("multi-head latent attention (deepseek-v3): the queries' latent"
                                " rank (0: one full query projection)", 0)
    kv_lora_rank: int = _setting("multi-head latent attention: the keys' and values' latent"
                                 " rank, cached per token with the shared rotary key (0: no"
                                 " MLA, which the deepseek-v3 family needs)", 0)
    qk_rope_head_dim: int = _setting("MLA: rotary dimensions of each query/key head", 0)
    qk_nope_head_dim: int = _setting("MLA: non-rotary dimensions of each query/key head", 0)
    v_head_dim: int = _setting("MLA: dimensions of each value head", 0)
    rope_interleave: bool = _setting("MLA: rotary pairs are adjacent dimensions (transformers'"
                                     " rope_interleave) rather than halves", True)
    moe_experts: int = _setting("experts per MoE layer (0: dense MLPs only)", 0)
    moe_top_k: int = _setting("experts per token, 1 .. moe_experts (1: Switch, 2: GShard)", 1)
    moe_every: int = _setting("every n-th MLP is an MoE layer (layers n-1, 2n-1, ...)", 1)
    moe_first_dense: int = _setting("the first k layers keep a dense MLP (DeepSeek's"
                                    " first_k_dense_replace)", 0)
    moe_layers: tuple[int, ...] | None = _setting(
        "the MoE layers listed, e.g. 1,3 (instead of `moe_every` and `moe_first_dense`)", None)
    moe_ffn_size: int = _setting("width of each expert's MLP (0: `ffn_size`, the dense MLP's)",
                                 0)
    moe_shared_ffn_size: int = _setting("width of the shared expert, an MLP every token of an"
                                        " MoE layer passes besides its routed experts (0: none;"
                                        " DeepSeek's: expert width x shared experts)", 0)
    moe_shared_gate: str | None = _setting("how the shared expert joins: none (DeepSeek: added)"
                                           " or sigmoid (Qwen2-MoE: scaled by a learned"
                                           " per-token gate); required with a shared expert",
                                           None, choices=SHARED_GATES)
    moe_capacity_factor: float = _setting("expert capacity = ceil(factor x tokens x k /"
                                          " experts) per micro-batch and rank; excess choices"
                                          " are dropped (0: dropless, every choice kept)",
                                          1.25)
    moe_aux_loss_coef: float = _setting("weight of the Switch load-balancing loss", 0.01)
    moe_z_loss_coef: float = _setting("weight of the router z-loss (mean squared"
                                      " log-sum-exp of the router logits)", 0.0)
    moe_score: str = _setting("router scores: softmax over experts (Mixtral, Qwen) or a"
                              " sigmoid each (DeepSeek-V3)", "softmax", choices=SCORES)
    moe_norm_topk_prob: bool | None = _setting("renormalise the k chosen scores to sum to 1"
                                               " (unset: only when moe_top_k >= 2)", None)
    moe_routed_scaling: float = _setting("factor on the combine weights of the routed"
                                         " experts (DeepSeek's routed_scaling_factor)", 1.0)
    moe_groups: int = _setting("expert groups of group-limited routing (DeepSeek's n_group)", 1)
    moe_topk_groups: int = _setting("the best groups a token's experts come from (topk_group)", 1)
    moe_aux_loss_tokens: str = _setting("the balancing loss's expert fractions count first"
                                        " choices (Switch) or all k (transformers, Megatron)",
                                        "first", choices=AUX_TOKENS)
    moe_aux_loss_scope: str = _setting("the balancing loss weighs this micro-batch's fractions,"
                                       " or the previous step's whole global batch's (the same"
                                       " at every layout)", "micro-batch", choices=AUX_SCOPES)
    moe_seq_aux_loss_coef: float = _setting("weight of DeepSeek's sequence-wise balancing loss"
                                            " (fractions and scores per sequence)", 0.0)
    moe_bias_rate: float = _setting("auxiliary-loss-free balancing: each step, an expert's"
                                    " choice bias moves by this toward the mean load (0: off)",
                                    0.0)
    moe_gemm: str = _setting("how the experts are computed: auto (the measured best on the"
                             " device), loop (one expert at a time), padded (one batched"
                             " matmul) or grouped (torch's grouped matmul)", "auto",
                             choices=GEMMS)

    LATENT_ATTENTION: ClassVar[bool] = False
    """Whether the family's attention is multi-head latent attention (the MLA settings)."""
    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
        "num_layers", "hidden_size", "num_heads", "vocab_size", "ffn_size", "moe_experts",
        "moe_every", "moe_first_dense", "moe_layers", "expert_ffn_size", "moe_shared_ffn_size",
        "moe_shared_gate", "kv_heads", "head_dim", "qkv_bias", "qk_norm", "tie_embeddings")
    """What a checkpoint's tensors depend on (fields or their resolved properties): they must
    match to load it."""
    POSITIVE_FIELDS: ClassVar[tuple[str, ...]] = ("init_std",)
    """Numbers that must be above 0 (a family adds its epsilons and rotary constants)."""

    def __post_init__(self):
        """A config that exists can be built: its shape is checked here, once, wherever it
        comes from (presets, settings, Hugging Face files, checkpoints: a JSON list)."""
        if self.moe_layers is not None:
            object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        self.validate()

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def expert_ffn_size(self) -> int:
        """Width of each routed expert's MLP."""
        return self.moe_ffn_size or self.ffn_size

    @property
    def moe_pattern(self) -> LayerPattern:
        """Which layers' MLPs are MoE (when `moe_experts`)."""
        return LayerPattern(self.moe_every, self.moe_first_dense, self.moe_layers,
                            names=("moe_every", "moe_first_dense", "moe_layers"))

    @property
    def head_dim(self) -> int:
        """Dimensions of each head: `head_size`, or hidden_size / num_heads."""
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def core_width(self) -> float:
        """Per-token width of the attention core's two matmuls on average (scores over the
        query/key head dimension, values over the value one): heads x head dimension."""
        return self.num_heads * self.head_dim

    def kv_width(self, tp: int) -> float:
        """Per token, the width of this rank's keys and of its values on average (what ring
        attention passes): its key/value heads (at least one) x head dimension."""
        return max(self.kv_heads // tp, 1) * self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention has fewer than query heads)."""
        return self.num_kv_heads or self.num_heads

    @property
    def tie_embeddings(self) -> bool:
        """Whether the output layer is the input embedding."""
        return self.tie_word_embeddings

    def validate(self) -> None:
        """Raise SettingError naming the setting for a shape that cannot be built (runs when
        the config is made)."""
        for f in fields(self):  # (an int is finite; a bool is no number here)
            if type(value := getattr(self, f.name)) is float and not math.isfinite(value):
                raise SettingError(Code.RANGE, f"`{f.name}` must be a finite number, got {value}")
        for name in self.POSITIVE_FIELDS:
            if not getattr(self, name) > 0:
                raise SettingError(Code.RANGE, f"`{name}` must be positive, got"
                                               f" {getattr(self, name)}")
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise SettingError(Code.RANGE, (
                    f"`{name}` must be positive, got {getattr(self, name)}"))
        for name in ("ffn_hidden_size", "num_kv_heads", "head_size"):  # (0 would read as unset)
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise SettingError(Code.RANGE, (
                    f"`{name}` must be positive (or unset for the family's default), got"
                    f" {getattr(self, name)}"))
        if self.head_size is None and self.hidden_size % self.num_heads:
            raise SettingError(Code.MODEL_SHAPE, (
                f"hidden size {self.hidden_size} must be divisible by the number of"
                f" heads {self.num_heads} (or set `head_size`)"))
        if self.kv_heads < 1 or self.num_heads % self.kv_heads:
            raise SettingError(Code.MODEL_SHAPE, (
                f"`num_kv_heads` ({self.kv_heads}) must divide the number of heads"
                f" ({self.num_heads}): each key/value head serves a group of them"))
        self._validate_window()
        if not 0.0 <= self.dropout < 1.0:
            raise SettingError(Code.RANGE, (
                f"`dropout` must be in [0, 1), got {self.dropout}"))
        if self.attention not in ATTENTION_KERNELS:
            raise SettingError(Code.CHOICE, (
                f"`attention` must be {alternatives(ATTENTION_KERNELS)}, got"
                f" {self.attention!r}"))
        if self.moe_gemm not in GEMMS:
            raise SettingError(Code.CHOICE, f"`moe_gemm` must be {alternatives(GEMMS)},"
                                            f" got {self.moe_gemm!r}")
        latent = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                  "v_head_dim")
        if not self.LATENT_ATTENTION and any(getattr(self, name) for name in latent):
            raise SettingError(Code.MODEL_UNSUPPORTED, (
                f"`{next(n for n in latent if getattr(self, n))}` shapes multi-head latent"
                " attention, which this family has not: use a deepseek-v3 model or unset it"))
        if self.moe_experts < 0:
            raise SettingError(Code.RANGE, f"`moe_experts` must be >= 0, got {self.moe_experts}")
        if self.moe_experts:
            self._validate_moe()
        elif self.moe_shared_ffn_size or self.moe_ffn_size or self.moe_layers:
            raise SettingError(Code.MOE_SHARED, (
                "`moe_ffn_size`, `moe_shared_ffn_size` and `moe_layers` shape MoE layers, and"
                " `moe_experts` is 0: set `moe_experts`"))

    def _validate_window(self) -> None:
        """`sliding_window` and the layer it starts from."""
        if self.sliding_window is not None and self.sliding_window < 1:
            raise SettingError(Code.RANGE, (
                f"`sliding_window` must be positive (or unset for none), got"
                f" {self.sliding_window}"))
        if self.window_start_layer and self.sliding_window is None:
            raise SettingError(Code.MODEL_SHAPE, (
                f"`window_start_layer` {self.window_start_layer} places a window, and"
                " `sliding_window` is unset: set both or neither"))
        if not 0 <= self.window_start_layer < self.num_layers:
            raise SettingError(Code.RANGE, (
                f"`window_start_layer` must be 0 .. num_layers - 1 = {self.num_layers - 1}"
                f" (unset `sliding_window` for no window), got {self.window_start_layer}"))

    def _validate_moe(self) -> None:
        if self.moe_top_k < 1:
            raise SettingError(Code.RANGE, f"`moe_top_k` must be >= 1, got {self.moe_top_k}")
        if self.moe_top_k > self.moe_experts:
            raise SettingError(Code.MOE_TOP_K, (
                f"`moe_top_k` {self.moe_top_k} exceeds `moe_experts`"
                f" {self.moe_experts}: use more experts or a smaller k"))
        self.routing_rule().check_groups(self.moe_experts)
        self.moe_pattern.validate(self.num_layers)
        for name, zero in (("moe_ffn_size", "`ffn_size`"), ("moe_shared_ffn_size", "none")):
            if getattr(self, name) < 0:
                raise SettingError(Code.RANGE, (
                    f"`{name}` must be >= 0 (0: {zero}), got {getattr(self, name)}"))
        if self.moe_shared_gate not in (None, *SHARED_GATES):
            raise SettingError(Code.CHOICE, (
                f"`moe_shared_gate` must be {alternatives(SHARED_GATES)}, got"
                f" {self.moe_shared_gate!r}"))
        if self.moe_shared_ffn_size and self.moe_shared_gate is None:
            raise SettingError(Code.MOE_SHARED, (
                f"`moe_shared_ffn_size` {self.moe_shared_ffn_size} needs `moe_shared_gate`:"
                " none (DeepSeek: added as it is) or sigmoid (Qwen2-MoE: gated per token)"))
        if not self.moe_shared_ffn_size and self.moe_shared_gate is not None:
            raise SettingError(Code.MOE_SHARED, (
                f"`moe_shared_gate` {self.moe_shared_gate!r} gates a shared expert, and"
                " `moe_shared_ffn_size` is 0: set both or neither"))
        if not 0 <= self.moe_capacity_factor < math.inf:
            raise SettingError(Code.RANGE, (
                f"`moe_capacity_factor` must be > 0, or 0 for dropless routing, got"
                f" {self.moe_capacity_factor}"))
        if not (0 <= self.moe_aux_loss_coef < math.inf and 0 <= self.moe_z_loss_coef < math.inf):
            raise SettingError(Code.RANGE, "`moe_aux_loss_coef` and `moe_z_loss_coef` must be >= 0")
        self._validate_routing()

    def _validate_routing(self) -> None:
        for name, choices in (("moe_score", SCORES), ("moe_aux_loss_tokens", AUX_TOKENS),
                              ("moe_aux_loss_scope", AUX_SCOPES)):
            if (value := getattr(self, name)) not in choices:
                raise SettingError(Code.CHOICE, f"`{name}` must be {alternatives(choices)},"
                                                f" got {value!r}")
        for name in ("moe_bias_rate", "moe_seq_aux_loss_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                raise SettingError(Code.RANGE, (
                    f"`{name}` must be a finite number >= 0 (0: off), got"
                    f" {getattr(self, name)}"))
        if not 0 < self.moe_routed_scaling < math.inf:
            raise SettingError(Code.RANGE, (
                "`moe_routed_scaling` must be a finite number > 0 (1: unscaled), got"
                f" {self.moe_routed_scaling}"))

    def routing_rule(self) -> RoutingRule:
        """The MoE layers' routing settings as `routing.route` takes them."""
        return RoutingRule(top_k=self.moe_top_k, capacity_factor=self.moe_capacity_factor,
                           score=self.moe_score, norm_topk_prob=self.moe_norm_topk_prob,
                           routed_scaling=self.moe_routed_scaling,
                           aux_tokens=self.moe_aux_loss_tokens, groups=self.moe_groups,
                           topk_groups=self.moe_topk_groups)

    def routing_state_shapes(self) -> dict[str, tuple[int, ...]]:
        """The MoE routers' balancing state a checkpoint holds (as `routing/<name>`): the
        choice bias with `moe_bias_rate`, the global fractions with a global balancing loss."""
        names = ("expert_bias",) * bool(self.moe_bias_rate) \
            + ("load_fractions",) * (self.moe_aux_loss_scope == "global")
        return {f"layers.{i}.mlp.router.{name}": (self.moe_experts,)
                for i in self.moe_layer_indices() for name in names}

    def moe_layer_indices(self) -> tuple[int, ...]:
        """The model layer indices whose MLP is an MoE layer."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_experts > 0 and self.moe_pattern.matches(layer)

    @property
    def moe_capacity(self) -> bool:
        """Whether MoE layers drop choices past an expert capacity (a factor > 0): a token's
        routing then depends on the tokens routed with it; dropless routing is per token."""
        return bool(self.moe_experts) and self.moe_capacity_factor > 0

    def validate_for_ep(self, ep: int) -> None:
        if ep > 1 and self.moe_experts == 0:
            raise SettingError(Code.EP_WITHOUT_MOE, (
                f"`ep` {ep} needs an MoE model: set `moe_experts`"))
        if self.moe_experts % ep:
            raise SettingError(Code.EXPERTS_EP, (
                f"`moe_experts` {self.moe_experts} must be divisible by `ep` {ep}:"
                " each EP rank holds the same number of experts"))

    def validate_for_tp(self, tp: int) -> None:
        """The shapes Megatron's 1D scheme splits over `tp` ranks."""
        if self.num_heads % tp:
            raise SettingError(Code.HEADS_TP, (
                f"the number of heads ({self.num_heads}) must be divisible by tp"
                f" ({tp}): choose a tp that divides it"))
        for what, width in (("MLP", self.ffn_size), ("expert", self.expert_ffn_size),
                            ("shared expert", self.moe_shared_ffn_size)):
            if width % tp:
                raise SettingError(Code.MLP_WIDTH_TP, (
                    f"the {what} width ({width}) must be divisible by tp ({tp})"))

    def num_moe_layers(self) -> int:
        return self.moe_pattern.count(self.num_layers) if self.moe_experts else 0

    @abstractmethod
    def attention_parameters(self, *, weights_only: bool = False) -> int:
        """Parameters of one attention (`weights_only`: its matrices, without biases)."""

    @abstractmethod
    def mlp_parameters(self, *, weights_only: bool = False, width: int | None = None) -> int:
        """Parameters of one MLP of `width` (None: the dense MLP's, `ffn_size`)."""

    @abstractmethod
    def other_parameters(self) -> int:
        """Everything outside the attentions and MLPs: embeddings, norms, an untied head."""

    @abstractmethod
    def activation_bytes(self, *, seq_len: int, micro_batch: int, tp: int = 1,
                         sequence_parallel: bool = False, recompute: str = "none",
                         element_size: int = 2, mask_size: int = 1,
                         dropout: bool = True) -> float:
        """Bytes one transformer layer saves for backward (checked against measurement)."""

    @abstractmethod
    def mlp_activation_bytes(self, tokens: float, width: int, *, tp: int,
                             element_size: int) -> float:
        """What one MLP of `width` saves for backward that grows with its width, for `tokens`
        rows (a dense MLP's part of `activation_bytes`; the planner prices an MoE layer's
        experts and shared expert by it)."""

    @abstractmethod
    def pointwise_bytes(self, *, hidden: float, tp: int, element_size: int,
                        fused: bool) -> float:
        """Bytes per token one layer's memory-bound forward kernels read and write (norms,
        residual adds, activation, positions; not the attention core): `hidden` the norms'
        width on this rank (h, or h / tp where it is split), `tp` splitting the heads and the
        MLP; `fused`: compiled blocks, each tensor read and written once. The planner prices
        them by memory bandwidth."""

    @abstractmethod
    def norm_shapes(self) -> dict[str, tuple[int, ...]]:
        """One norm's parameters (name within the norm: shape)."""

    @abstractmethod
    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """One attention's parameters (name within `attn`: logical shape)."""

    @abstractmethod
    def mlp_shapes(self, width: int | None = None) -> dict[str, tuple[int, ...]]:
        """One MLP's parameters of `width` (None: the dense one's; name within `mlp`, within
        one expert, or within the shared expert: shape)."""

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's logical (unsharded) shape by its name in the family's `CausalLM`:
        what a checkpoint of this config holds, so that metadata and tensors are checked
        against each other without building a model."""
        h = self.hidden_size
        shapes = {"embedding.word.weight": (self.vocab_size, h)} | {
            f"embedding.{name}": shape for name, shape in self.embedding_shapes().items()}
        for i in range(self.num_layers):
            shapes |= self._layer_shapes(f"layers.{i}.", i)
        shapes |= {f"final_norm.{name}": shape for name, shape in self.norm_shapes().items()}
        if not self.tie_embeddings:
            shapes["head.weight"] = (self.vocab_size, h)
        return shapes

    def embedding_shapes(self) -> dict[str, tuple[int, ...]]:
        """Embedding parameters besides the word table (GPT's positions)."""
        return {}

    def _layer_shapes(self, prefix: str, layer: int) -> dict[str, tuple[int, ...]]:
        norm = self.norm_shapes()
        shapes = {f"{prefix}{ln}.{name}": shape for ln in ("ln1", "ln2")
                  for name, shape in norm.items()}
        shapes |= {f"{prefix}attn.{name}": s for name, s in self.attention_shapes().items()}
        if not self.is_moe_layer(layer):
            return shapes | {f"{prefix}mlp.{name}": s for name, s in self.mlp_shapes().items()}
        shapes[f"{prefix}mlp.router.weight"] = (self.moe_experts, self.hidden_size)
        expert = self.mlp_shapes(self.expert_ffn_size)
        shapes |= {f"{prefix}mlp.experts.{e}.{name}": shape
                   for e in range(self.moe_experts) for name, shape in expert.items()}
        if self.moe_shared_ffn_size:
            shapes |= {f"{prefix}mlp.shared_expert.{name}": shape
                       for name, shape in self.mlp_shapes(self.moe_shared_ffn_size).items()}
        if self.moe_shared_gate == "sigmoid":
            shapes[f"{prefix}mlp.shared_expert_gate.weight"] = (1, self.hidden_size)
        return shapes

    def moe_mlp_parameters(self, *, weights_only: bool = False, experts: int | None = None
                           ) -> int:
        """One MoE layer's MLP: the router [E, h], `experts` routed experts (None: all E), the
        shared expert and its gate [1, h]."""
        h = self.hidden_size
        experts = self.moe_experts if experts is None else experts
        shared = self.mlp_parameters(weights_only=weights_only,
                                     width=self.moe_shared_ffn_size) \
            if self.moe_shared_ffn_size else 0
        gate = h if self.moe_shared_gate == "sigmoid" else 0
        return self.moe_experts * h + gate + shared + experts * self.mlp_parameters(
            weights_only=weights_only, width=self.expert_ffn_size)

    def num_parameters(self) -> int:
        """Every parameter, each tied one once (an MoE layer's MLP is `moe_mlp_parameters`)."""
        moe = self.num_moe_layers()
        mlps = (self.num_layers - moe) * self.mlp_parameters() + moe * self.moe_mlp_parameters()
        return self.other_parameters() + self.num_layers * self.attention_parameters() + mlps

    def matmul_parameters_per_token(self) -> int:
        """Weights one token is multiplied with: each layer's attention and MLP matrices (on
        MoE layers the router, top-k experts and the shared expert only), and the output layer
        (the input embedding is a lookup)."""
        moe = self.num_moe_layers()
        mlp = (self.num_layers - moe) * self.mlp_parameters(weights_only=True) \
            + moe * self.moe_mlp_parameters(weights_only=True, experts=self.moe_top_k)
        layers = self.num_layers * self.attention_parameters(weights_only=True) + mlp
        return layers + self.vocab_size * self.hidden_size

    def pipeline_work_shares(self, seq_len: int) -> tuple[float, float]:
        """The output layer's matmul FLOPs and one layer's attention-core FLOPs (scores and
        their use of the values, over the keys a query attends), each over one layer's
        weight-matmul FLOPs (MoE: top-k experts): what ZB-V weighs chunks by
        (`zero_bubble.estimated_costs`)."""
        mlp = self.moe_mlp_parameters(weights_only=True, experts=self.moe_top_k) \
            - self.moe_experts * self.hidden_size if self.moe_experts \
            else self.mlp_parameters(weights_only=True)  # (without the router's, as always)
        weights = self.attention_parameters(weights_only=True) + mlp
        attention = 2 * self.attended_keys(seq_len) * self.core_width
        return self.vocab_size * self.hidden_size / weights, attention / weights

    def layer_window(self, index: int) -> int | None:
        """The sliding window of layer `index` (global), None where it attends all."""
        return self.sliding_window if index >= self.window_start_layer else None

    @property
    def windowed_fraction(self) -> float:
        """The share of the layers that slide a window."""
        if self.sliding_window is None:
            return 0.0
        return (self.num_layers - self.window_start_layer) / self.num_layers

    def attention_span(self, seq_len: int) -> float:
        """Keys per query the FLOP convention counts, over the layers on average: the whole
        sequence under the causal mask (Megatron-LM counts the masked half), the window where
        one is shorter."""
        f = self.windowed_fraction
        return f * min(seq_len, self.sliding_window or seq_len) + (1 - f) * seq_len

    def attended_keys(self, seq_len: int) -> float:
        """Keys a query attends on average over the layers (what a kernel skipping masked work
        computes): (s + 1) / 2 under the causal mask, nearly the window W when W is much
        shorter than s."""
        f = self.windowed_fraction
        full = window_keys(seq_len, seq_len)
        return f * window_keys(self.sliding_window or seq_len, seq_len) + (1 - f) * full

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs to train on one token (forward and backward, no recomputation), in the
        convention of Megatron-LM (Narayanan et al. 2021): 6 x the weights each token multiplies,
        plus 12 x layers x `attention_span` x attention width for the scores and their use of
        the values (the causal mask's skipped half is counted, as there)."""
        attention = 12 * self.num_layers * self.attention_span(seq_len) * self.core_width
        return 6 * self.matmul_parameters_per_token() + attention


def window_keys(window: int, seq_len: int) -> float:
    """Keys a query attends on average in a sequence of `seq_len` under a causal window."""
    w = min(window, seq_len)
    return (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len


def require_experts(cfg: TransformerConfig, family: str, dense: str) -> None:
    """A family whose MLPs are experts refuses `moe_experts` 0, naming its dense twin."""
    if not cfg.moe_experts:
        raise SettingError(Code.MODEL_UNSUPPORTED, f"`moe_experts` cannot be 0 in {family}: use"
                                                   f" the {dense} family for a dense model")


WIDE_BYTES = 4
"""Norms compute in fp32 whatever the precision (`precision.wide_dtype`)."""


@dataclass(frozen=True)
class ModelFamily:
    """A model family: its name (recorded in checkpoints), config class, model class and
    presets. Its Hugging Face mapping, if it has a Hugging Face twin, is interop's
    (`hf_io.MAPPINGS`): interop sits above models, so models never load interop code."""

    name: str
    config: type[TransformerConfig]
    model: type[nn.Module]
    """Its `CausalLM` subclass (typed loosely: `causal_lm` builds on this module)."""
    presets: dict[str, TransformerConfig]
