"""Routing of tokens to experts: the choice of each token's experts and weights, the
capacity rule, the balancing losses, and the routing statistics of an optimizer step.

Routing is computed in fp32 (the wide dtype) whatever the training precision. Top-k (Switch for
k=1: the weight is the top probability; GShard for k=2: the two weights renormalised to sum to
1; no random routing). Expert capacity C = ceil(c * T * k / E) with T the tokens of this
micro-batch on this rank; a capacity factor of 0 means dropless (every choice kept). Token
dropping is deterministic: every token's first choice is placed before any second choice, and
within one choice tokens are placed in position order; a choice past its expert's capacity is
dropped (its token still passes through the residual connection).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.precision import wide_dtype


@dataclass
class Routing:
    """Where each token's choices go. All tensors are over this rank's T tokens."""

    experts: torch.Tensor  # [T, k] chosen expert per choice
    weights: torch.Tensor  # [T, k] combine weights (differentiable)
    slots: torch.Tensor  # [T, k] position in the expert's buffer (choice-major, token order)
    kept: torch.Tensor  # [T, k] bool: within capacity
    aux_loss: torch.Tensor  # Switch load-balancing loss E * sum_i f_i P_i
    z_loss: torch.Tensor  # mean squared log-sum-exp of the router logits
    tokens_per_expert: torch.Tensor  # [E] kept choices per expert


def capacity(num_tokens: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Choices one expert takes; a factor of 0 is dropless (room for every choice)."""
    if capacity_factor == 0:
        return num_tokens * top_k
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def route(logits: torch.Tensor, *, top_k: int, capacity_factor: float,
          token_axis: MeshAxis | None = None) -> Routing:
    """Top-k routing with deterministic capacity dropping; `logits` `[T, E]`. `token_axis`:
    the ranks holding the rest of this micro-batch's tokens (context parallelism), over which
    the balancing loss's expert fractions are summed, so its ranks' losses average to the
    micro-batch's."""
    num_tokens, num_experts = logits.shape
    logits = logits.to(wide_dtype(logits.dtype))
    probs = logits.softmax(dim=-1)
    top_probs, experts = probs.topk(top_k, dim=-1)  # [T, k]
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True) if top_k > 1 else top_probs
    cap = capacity(num_tokens, num_experts=num_experts, top_k=top_k,
                   capacity_factor=capacity_factor)
    placed = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    slots = torch.empty_like(experts)
    for choice in range(top_k):  # all first choices before any second choice
        onehot = F.one_hot(experts[:, choice], num_experts)  # [T, E]
        position = (onehot.cumsum(dim=0) - 1 + placed) * onehot
        slots[:, choice] = position.sum(dim=-1)
        placed += onehot.sum(dim=0)
    kept = slots < cap
    top1_fraction = F.one_hot(experts[:, 0], num_experts).float().mean(dim=0)
    if token_axis is not None and token_axis.size > 1:
        comm.all_reduce(top1_fraction, token_axis)
        top1_fraction /= token_axis.size
    aux_loss = num_experts * (top1_fraction * probs.mean(dim=0)).sum()
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    tokens_per_expert.index_add_(0, experts.flatten(), kept.flatten().long())  # no masked select
    return Routing(experts, weights, slots, kept, aux_loss, z_loss, tokens_per_expert)


class RoutingStats:
    """Routing of one optimizer step summed over micro-batches and MoE layers, kept on the
    device until `summary`."""

    def __init__(self, device: torch.device):
        self.tokens_per_expert: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, layer) -> [E]
        self.counts = torch.zeros(3, device=device)  # dropped, assigned, aux loss

    def add(self, routing: list[dict], chunk: int = 0) -> None:
        """One forward's `AuxiliaryOutputs.routing` (of local model chunk `chunk`)."""
        if not routing:
            return
        for i, layer in enumerate(routing):
            key = (chunk, i)
            self.tokens_per_expert[key] = self.tokens_per_expert.get(key, 0) \
                + layer["tokens_per_expert"]
        # summed in float64 layer by layer, then added in float32 (the metric's arithmetic)
        sums = [torch.zeros((), dtype=torch.float64, device=self.counts.device)
                for _ in range(3)]
        for layer in routing:
            sums[0] = sums[0] + (layer["assigned"] - layer["kept"].double())
            sums[1] = sums[1] + float(layer["assigned"])
            sums[2] = sums[2] + layer["aux_loss"].double()
        self.counts += torch.stack(sums).float()

    def summary(self, mesh: ParallelMesh, num_micro_batches: int) -> dict:
        """Over the whole global batch (summed over DP ranks, and over pipeline stages):
        tokens each expert processed (min/mean/max over layers and experts), drop rate, aux
        loss per micro-batch, as 0-dim device tensors (the step reads them with its other
        scalars). Every rank of a pipeline joins, with or without MoE layers."""
        device = mesh.device
        per_layer = list(self.tokens_per_expert.values())  # the same order on every dp rank
        tokens = torch.stack(per_layer).double() if per_layer \
            else torch.zeros(0, 1, dtype=torch.double, device=device)
        counts = self.counts.double()
        comm.all_reduce(tokens, mesh.dp_cp)
        comm.all_reduce(counts, mesh.dp_cp)
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
                "moe_aux_loss": counts[2] / (num_micro_batches * mesh.dp_cp.size)}
