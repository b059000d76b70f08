"""Routing of tokens to experts: the choice of each token's experts and weights, the
capacity rule, the balancing losses, and the routing statistics of an optimizer step.

Routing is computed in fp32 (the wide dtype) whatever the training precision. Top-k (Switch for
k=1: the weight is the top probability; GShard for k=2: the two weights renormalised to sum to
1; no random routing), optionally group-limited (DeepSeek-V3: the experts are split into equal
groups, each token keeps its best groups, ranked by the sum of their two best biased scores, and
chooses its k experts inside them). Expert capacity C = ceil(c * T * k / E) with T the tokens
of this micro-batch on this rank; a capacity factor of 0 means dropless (every choice kept). Token
dropping is deterministic: every token's first choice is placed before any second choice, and
within one choice tokens are placed in position order; a choice past its expert's capacity is
dropped (its token still passes through the residual connection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.precision import wide_dtype

SCORES = ("softmax", "sigmoid")
"""The `moe_score` choices: how router logits become the scores experts are chosen by."""
AUX_TOKENS = ("first", "all")
"""The `moe_aux_loss_tokens` choices: the balancing loss counts first choices or all k."""
AUX_SCOPES = ("micro-batch", "global")
"""The `moe_aux_loss_scope` choices: whose expert fractions the balancing loss weighs."""

@dataclass
class Routing:
    """Where each token's choices go. All tensors are over this rank's T tokens."""

    experts: torch.Tensor  # [T, k] chosen expert per choice
    weights: torch.Tensor  # [T, k] combine weights (differentiable)
    slots: torch.Tensor  # [T, k] position in the expert's buffer (choice-major, token order)
    kept: torch.Tensor  # [T, k] bool: within capacity
    aux_loss: torch.Tensor  # Switch load-balancing loss E * sum_i f_i P_i
    z_loss: torch.Tensor  # mean squared log-sum-exp of the router logits
    seq_aux_loss: torch.Tensor  # DeepSeek's sequence-wise loss (0 when not asked for)
    tokens_per_expert: torch.Tensor  # [E] kept choices per expert
    choices_per_expert: torch.Tensor  # [E] all k choices per expert, before capacity
    first_per_expert: torch.Tensor  # [E] first choices per expert


@dataclass(frozen=True)
class RoutingRule:
    """How scores become choices and weights (the `moe_*` routing settings)."""

    top_k: int
    capacity_factor: float
    score: str = "softmax"
    norm_topk_prob: bool | None = None  # None: renormalise for k >= 2 only
    routed_scaling: float = 1.0
    aux_tokens: str = "first"  # the balancing loss's fractions: "first" choices or "all" k
    groups: int = 1  # expert groups of group-limited routing (1: none)
    topk_groups: int = 1  # the groups each token chooses its experts from

    def check_groups(self, num_experts: int) -> None:
        """Refuse group-limited routing that cannot be built: the groups must split the experts
        evenly, two or more in each (a group is ranked by its two best), and the chosen groups
        must hold the k experts."""
        groups, chosen = self.groups, self.topk_groups
        if groups < 1 or not 1 <= chosen <= groups:
            raise SettingError(Code.MOE_GROUPS, (
                f"`moe_topk_groups` {chosen} must be 1 .. `moe_groups` {groups} (and"
                " `moe_groups` >= 1): choose fewer groups per token"))
        if groups > 1 and (num_experts % groups or num_experts // groups < 2):
            raise SettingError(Code.MOE_GROUPS, (
                f"`moe_groups` {groups} must divide `moe_experts` {num_experts} into groups of"
                " two or more experts (a group is ranked by its two best)"))
        if self.top_k > chosen * (num_experts // groups):
            raise SettingError(Code.MOE_GROUPS, (
                f"`moe_top_k` {self.top_k} exceeds the {chosen * (num_experts // groups)}"
                f" experts of `moe_topk_groups` {chosen} of {groups} groups: choose more groups"
                " per token or a smaller k"))


def capacity(num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Choices one expert takes; a factor of 0 is dropless (room for every choice)."""
    if capacity_factor == 0:
        return num_tokens * top_k
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def scores_of(logits: torch.Tensor, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores experts are chosen and weighted by, probabilities the balancing losses use):
    softmax gives both; sigmoid scores each expert alone, normalised per token for the losses
    (DeepSeek-V3)."""
    if score == "softmax":
        probs = logits.softmax(dim=-1)
        return probs, probs
    scores = logits.sigmoid()
    return scores, scores / scores.sum(dim=-1, keepdim=True)


def choice_keys(scores: torch.Tensor, rule: RoutingRule, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """What each token's experts are ranked by `[T, E]`: the scores plus the bias `[E]`, and
    with groups -inf outside each token's `topk_groups` best groups (ranked by the sum of their
    two best keys, as DeepSeek-V3 does)."""
    keys = scores if bias is None else scores + bias
    if rule.groups == 1:
        return keys
    grouped = keys.unflatten(-1, (rule.groups, -1))  # [T, G, E/G]
    ranked = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    chosen = ranked.topk(rule.topk_groups, dim=-1).indices
    kept = torch.zeros_like(ranked, dtype=torch.bool).scatter_(-1, chosen, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), -math.inf).flatten(-2)


def choose(scores: torch.Tensor, rule: RoutingRule, bias: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts (by `choice_keys`, best first) and combine weights `[T, k]`. A
    bias `[E]` and groups move the choice only: the weights are the unbiased scores of the
    chosen experts."""
    experts = choice_keys(scores, rule, bias).topk(rule.top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    norm = rule.top_k > 1 if rule.norm_topk_prob is None else rule.norm_topk_prob
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if rule.routed_scaling != 1.0:
        weights = weights * rule.routed_scaling
    return experts, weights


def place(experts: torch.Tensor, num_experts: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, kept) `[T, k]`: every first choice is placed before any second choice, tokens in
    position order; a slot at or past `cap` is dropped."""
    placed = torch.zeros(num_experts, dtype=torch.long, device=experts.device)
    slots = torch.empty_like(experts)
    for choice in range(experts.shape[1]):
        onehot = F.one_hot(experts[:, choice], num_experts)  # [T, E]
        position = (onehot.cumsum(dim=0) - 1 + placed) * onehot
        slots[:, choice] = position.sum(dim=-1)
        placed += onehot.sum(dim=0)
    return slots, slots < cap


def own_fractions(experts: torch.Tensor, num_experts: int, aux_tokens: str) -> torch.Tensor:
    """Each expert's share `[E]` of this micro-batch's first choices, or of all k choices."""
    if aux_tokens == "first":
        return F.one_hot(experts[:, 0], num_experts).float().mean(dim=0)
    return F.one_hot(experts.flatten(), num_experts).float().mean(dim=0)


def sequence_aux_loss(probs: torch.Tensor, experts: torch.Tensor, sequences: int
                      ) -> torch.Tensor:
    """DeepSeek's sequence-wise balancing loss: E * sum_i f_i P_i within each sequence (f over
    all k choices, P the mean normalised score), averaged over the `sequences` rows."""
    num_experts = probs.shape[-1]
    fractions = F.one_hot(experts.reshape(sequences, -1), num_experts).float().mean(dim=1)
    mean_probs = probs.reshape(sequences, -1, num_experts).mean(dim=1)
    return num_experts * (fractions * mean_probs).sum(dim=-1).mean()


def route(logits: torch.Tensor, rule: RoutingRule | None = None, *, top_k: int = 1,
          capacity_factor: float = 1.25, bias: torch.Tensor | None = None,
          fractions: torch.Tensor | None = None, sequences: int = 0,
          token_axis: MeshAxis | None = None) -> Routing:
    """Top-k routing with deterministic capacity dropping; `logits` `[T, E]`. `rule` (or
    `top_k` and `capacity_factor` for the default softmax rule); `bias` `[E]` for the choice;
    `fractions` `[E]`: the global batch's expert fractions the balancing loss weighs (all zero:
    none yet, this micro-batch's own); `sequences` > 0 computes the sequence-wise loss over
    that many equal rows of tokens. `token_axis`: the ranks holding the rest of this
    micro-batch's tokens (context parallelism), over which the balancing loss's own fractions
    are averaged, so its ranks' losses average to the micro-batch's."""
    rule = rule or RoutingRule(top_k=top_k, capacity_factor=capacity_factor)
    num_tokens, num_experts = logits.shape
    logits = logits.to(wide_dtype(logits.dtype))
    scores, probs = scores_of(logits, rule.score)
    experts, weights = choose(scores, rule, bias)
    slots, kept = place(experts, num_experts, capacity(
        num_tokens, num_experts=num_experts, top_k=rule.top_k,
        capacity_factor=rule.capacity_factor))
    share = own_fractions(experts, num_experts, rule.aux_tokens)
    if token_axis is not None and token_axis.size > 1:
        comm.all_reduce(share, token_axis)
        share /= token_axis.size
    if fractions is not None:
        share = torch.where(fractions.sum() > 0, fractions, share)
    aux_loss = num_experts * (share * probs.mean(dim=0)).sum()
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    seq_aux = sequence_aux_loss(probs, experts, sequences) if sequences \
        else torch.zeros((), device=logits.device)
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    tokens_per_expert.index_add_(0, experts.flatten(), kept.flatten().long())  # no masked select
    return Routing(experts, weights, slots, kept, aux_loss, z_loss, seq_aux, tokens_per_expert,
                   torch.bincount(experts.flatten(), minlength=num_experts),
                   torch.bincount(experts[:, 0], minlength=num_experts))


class Router(nn.Module):
    """The router's `[E, h]` weight (named `router.weight`), the choice bias of
    auxiliary-loss-free balancing and the previous step's global expert fractions (global
    balancing loss), all kept in the wide dtype whatever the model is cast to: a bf16 model
    still scores experts in fp32 (as Megatron's fp32 router and transformers do)."""

    def __init__(self, linear: nn.Linear, *, bias_rate: float = 0.0,
                 global_fractions: bool = False, aux_tokens: str = "first"):
        super().__init__()
        self.weight = linear.weight
        num_experts = self.weight.shape[0]
        self.bias_rate, self.aux_tokens = bias_rate, aux_tokens
        zeros = torch.zeros(num_experts, dtype=wide_dtype(self.weight.dtype))
        self.register_buffer("expert_bias", zeros.clone() if bias_rate else None,
                             persistent=False)
        self.register_buffer("load_fractions", zeros.clone() if global_fractions else None,
                             persistent=False)

    def _apply(self, fn, recurse=True):
        def widened(t: torch.Tensor) -> torch.Tensor:
            t = fn(t)
            return t.to(wide_dtype(t.dtype)) if t.is_floating_point() else t
        return super()._apply(widened, recurse)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(tokens.to(self.weight.dtype), self.weight)

    @torch.no_grad()
    def update(self, counts: torch.Tensor) -> None:
        """After an optimizer step, from the global batch's integer counts `[3, E]` (kept,
        all choices, first choices; the same on every rank): the bias moves each expert by
        the rate toward the mean load, `bias += rate * sign(mean - load)`, and the fractions
        become the batch's."""
        if self.expert_bias is not None:
            load = counts[1].to(self.expert_bias.dtype)
            self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)
        if self.load_fractions is not None:
            chosen = counts[2 if self.aux_tokens == "first" else 1].to(self.load_fractions.dtype)
            self.load_fractions.copy_(chosen / chosen.sum())


class RoutingStats:
    """Routing of one optimizer step summed over micro-batches, per MoE layer (by its model
    layer index), kept on the device until `summary`; `update` then moves each local router's
    balancing state."""

    def __init__(self, device: torch.device):
        self.per_layer: dict[int, torch.Tensor] = {}  # layer -> [3, E]: kept, chosen, first
        self.bias: dict[int, torch.Tensor] = {}  # layer -> [2]: the choice bias's min, max
        self.counts = torch.zeros(3, device=device)  # dropped, assigned, aux loss
        self.reduced: dict[int, torch.Tensor] = {}  # `per_layer` over the global batch

    def add(self, routing: list[dict], chunk: int = 0) -> None:
        """One forward's `AuxiliaryOutputs.routing` (of local model chunk `chunk`)."""
        if not routing:
            return
        for layer in routing:
            key = layer["layer"]
            self.per_layer[key] = self.per_layer.get(key, 0) + layer["counts"]
            if layer["bias"] is not None:
                self.bias[key] = torch.stack([layer["bias"].min(), layer["bias"].max()])
        # summed in float64 layer by layer, then added in float32 (the metric's arithmetic)
        sums = [torch.zeros((), dtype=torch.float64, device=self.counts.device)
                for _ in range(3)]
        for layer in routing:
            sums[0] = sums[0] + (layer["assigned"] - layer["kept"].double())
            sums[1] = sums[1] + float(layer["assigned"])
            sums[2] = sums[2] + layer["aux_loss"].double()
        self.counts += torch.stack(sums).float()

    def summary(self, mesh: ParallelMesh, num_micro_batches: int,
                layers: tuple[int, ...] = ()) -> dict:
        """Over the whole global batch (summed over DP ranks, and over pipeline stages):
        tokens each expert processed (min/mean/max over layers and experts), drop rate, aux
        loss per micro-batch, and for each MoE layer of `layers` its max/mean expert load,
        dropped fraction and choice-bias range (the worst max/mean as
        `moe_load_max_over_mean`), as 0-dim device tensors (the step reads them with its
        other scalars). Every rank of a pipeline joins, with or without MoE layers."""
        device = mesh.device
        keys = list(self.per_layer)  # the same order on every dp rank
        stacked = torch.stack([self.per_layer[k] for k in keys]).double() if keys \
            else torch.zeros(0, 3, 1, dtype=torch.double, device=device)
        counts = self.counts.double()
        comm.all_reduce(stacked, mesh.dp_cp)
        comm.all_reduce(counts, mesh.dp_cp)
        self.reduced = dict(zip(keys, stacked, strict=True))
        tokens = stacked[:, 0]
        spread = torch.stack([tokens.sum(), torch.full((), tokens.numel(), dtype=torch.double,
                                                        device=device)])
        low = tokens.min().float() if tokens.numel() else torch.full((), math.inf, device=device)
        high = tokens.max().float() if tokens.numel() else torch.full((), -math.inf,
                                                                        device=device)
        sum_, min_, max_ = (torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MIN,
                            torch.distributed.ReduceOp.MAX)
        for tensor, op in ((counts, sum_), (spread, sum_), (low, min_), (high, max_)):
            comm.all_reduce(tensor, mesh.pp, op=op)
        return {"moe_tokens_per_expert_min": low,
                "moe_tokens_per_expert_mean": spread[0] / spread[1],
                "moe_tokens_per_expert_max": high, "moe_drop_rate": counts[0] / counts[1],
                "moe_aux_loss": counts[2] / (num_micro_batches * mesh.dp_cp.size)} \
            | self._per_layer(mesh, layers)

    def _per_layer(self, mesh: ParallelMesh, layers: tuple[int, ...]) -> dict:
        """Each MoE layer's load columns (max/mean, dropped fraction, bias min, bias max),
        filled by the stage holding it and summed over the pipeline."""
        if not layers:
            return {}
        table = torch.zeros(len(layers), 4, dtype=torch.double, device=mesh.device)
        for key, counts in self.reduced.items():
            row = table[layers.index(key)]
            row[0] = counts[0].max() / counts[0].mean()
            row[1] = 1 - counts[0].sum() / counts[1].sum()
            if key in self.bias:
                row[2:] = self.bias[key]
        comm.all_reduce(table, mesh.pp)
        table = table.float()
        out = {"moe_load_max_over_mean": table[:, 0].max()}
        for i, layer in enumerate(layers):
            out |= {f"moe_load_max_over_mean/{layer}": table[i, 0],
                    f"moe_dropped/{layer}": table[i, 1], f"moe_bias_min/{layer}": table[i, 2],
                    f"moe_bias_max/{layer}": table[i, 3]}
        return out

    def update(self, model: nn.Module) -> None:
        """After the optimizer step: each local router takes its layer's global counts (the
        same on every rank, so every replica's bias moves alike)."""
        for module in model.modules():
            router = getattr(module, "router", None)
            if isinstance(router, Router) and module.layer in self.reduced:
                router.update(self.reduced[module.layer])
