"""Mixture-of-Experts MLP with expert parallelism.

Routing (every rank of a TP group computes the same routing from the same replicated tokens):
a replicated linear router, softmax in fp32, top-k (Switch for k=1: the weight is the top
probability; GShard for k=2: the two weights renormalised to sum to 1; no random routing).
Expert capacity C = ceil(c * T * k / E) with T the tokens of this micro-batch on this rank. Token
dropping is deterministic: every token's first choice is placed before any second choice, and
within one choice tokens are placed in position order; a choice past its expert's capacity is
dropped (its token still passes through the residual connection).

Expert parallelism: the E experts are spread over the EP axis (E/ep consecutive experts per
rank). Kept (token, choice) rows are sorted by expert and sent to the experts' ranks with one
all-to-all of variable split sizes (no capacity padding), preceded by a tiny all-to-all of the
per-expert counts; results come back by the reverse all-to-all. Gradients flow back through the
same two all-to-alls in reverse.

Experts and TP: each expert is an MLP split over TP exactly like the dense one (column-parallel
fc, row-parallel proj), so each TP rank holds 1/tp of every local expert. The router and the
dispatch are replicated across TP; each expert's f/g operators sum its input gradient and its
output over TP, so the combine step sees full expert outputs and the router gets exact gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.mesh import ParallelMesh
from meshtrain.parallel import comm


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
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def route(logits: torch.Tensor, *, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing with deterministic capacity dropping; `logits` `[T, E]`."""
    num_tokens, num_experts = logits.shape
    logits = logits.float()
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
    aux_loss = num_experts * (top1_fraction * probs.mean(dim=0)).sum()
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    tokens_per_expert.index_add_(0, experts[kept], torch.ones_like(experts[kept]))
    return Routing(experts, weights, slots, kept, aux_loss, z_loss, tokens_per_expert)


class MoE(nn.Module):
    """Routed experts in place of a dense MLP. `experts` holds only this EP rank's experts (each
    an MLP of the model's family, tensor-parallel like the dense one), keyed by global expert
    index, so names do not depend on ep.

    Each forward adds its weighted routing losses to `aux.loss` and appends its statistics to
    `aux.routing` (see `models.family.AuxiliaryOutputs`).
    """

    def __init__(self, router: nn.Linear, experts: dict[int, nn.Module], *, num_experts: int,
                 top_k: int, capacity_factor: float, aux_loss_coef: float, z_loss_coef: float,
                 mesh: ParallelMesh):
        super().__init__()
        self.router = router  # replicated, [E, h]
        self.experts = nn.ModuleDict({str(e): expert for e, expert in experts.items()})
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.ep_axis = mesh.ep
        self.num_local = num_experts // mesh.ep.size
        self.first_local = mesh.ep.rank * self.num_local

    def forward(self, x: torch.Tensor, aux) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        routing = route(self.router(tokens), top_k=self.top_k,
                        capacity_factor=self.capacity_factor)
        aux.loss = aux.loss + self.aux_loss_coef * routing.aux_loss
        if self.z_loss_coef:
            aux.loss = aux.loss + self.z_loss_coef * routing.z_loss
        kept = routing.kept.nonzero()  # [N, 2]: (token, choice), token-major
        experts = routing.experts[kept[:, 0], kept[:, 1]]
        slots = routing.slots[kept[:, 0], kept[:, 1]]
        # Send order: by expert, then by slot (the order the capacity rule placed them).
        order = torch.argsort(experts * (b * s * self.top_k) + slots)
        token_idx, choice_idx, experts = kept[order, 0], kept[order, 1], experts[order]
        outputs = self._run_experts(tokens[token_idx], experts)  # [N, h] in send order
        weights = routing.weights[token_idx, choice_idx].unsqueeze(-1).to(outputs.dtype)
        combined = torch.zeros_like(tokens).index_add(0, token_idx, outputs * weights)
        aux.routing.append({"tokens_per_expert": routing.tokens_per_expert.detach(),
                            "kept": routing.kept.sum(), "assigned": routing.kept.numel(),
                            "aux_loss": routing.aux_loss.detach()})
        return combined.view(b, s, h)

    def _run_experts(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert -> expert outputs in the same order (through EP when ep > 1)."""
        counts = torch.bincount(experts, minlength=self.num_experts)  # [E], send order
        ep = self.ep_axis
        if ep.size > 1:
            recv_counts = comm.all_to_all(counts, ep, send_splits=[self.num_local] * ep.size,
                                          recv_splits=[self.num_local] * ep.size)
            send_splits = counts.view(ep.size, self.num_local).sum(dim=1).tolist()
            recv_splits = recv_counts.view(ep.size, self.num_local).sum(dim=1).tolist()
            rows = comm.all_to_all_differentiable(rows, ep, send_splits=send_splits,
                                                  recv_splits=recv_splits)
            per_source = recv_counts.view(ep.size, self.num_local)  # [source, local expert]
        else:
            per_source = counts.view(1, self.num_experts)
        # Received rows are grouped by source, then by local expert: regroup by expert.
        starts = torch.cumsum(per_source.flatten(), 0) - per_source.flatten()
        starts = starts.view_as(per_source)
        perm, sizes = [], []
        for local in range(self.num_local):
            for src in range(per_source.shape[0]):
                n = int(per_source[src, local])
                perm.append(torch.arange(n, device=rows.device) + starts[src, local])
            sizes.append(int(per_source[:, local].sum()))
        perm = torch.cat(perm)
        grouped = rows[perm]
        outs = [self.experts[str(self.first_local + local)](chunk)
                for local, chunk in enumerate(grouped.split(sizes))]
        out = torch.cat(outs)[torch.argsort(perm)]  # back to the received order
        if ep.size > 1:
            out = comm.all_to_all_differentiable(out, ep, send_splits=recv_splits,
                                                 recv_splits=send_splits)
        return out


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
        loss per micro-batch. Every rank of a pipeline joins, with or without MoE layers."""
        device = mesh.device
        per_layer = list(self.tokens_per_expert.values())  # the same order on every dp rank
        tokens = torch.stack(per_layer).double() if per_layer \
            else torch.zeros(0, 1, dtype=torch.double, device=device)
        counts = self.counts.double()
        comm.all_reduce(tokens, mesh.dp_cp)
        comm.all_reduce(counts, mesh.dp_cp)
        spread = torch.stack([tokens.sum(), torch.tensor(float(tokens.numel()),
                                                          dtype=torch.double, device=device)])
        low = tokens.min().float() if tokens.numel() else torch.tensor(math.inf, device=device)
        high = tokens.max().float() if tokens.numel() else torch.tensor(-math.inf,
                                                                          device=device)
        sum_, min_, max_ = (torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MIN,
                            torch.distributed.ReduceOp.MAX)
        for tensor, op in ((counts, sum_), (spread, sum_), (low, min_), (high, max_)):
            comm.all_reduce(tensor, mesh.pp, op=op)
        aux = counts[2].item() / (num_micro_batches * mesh.dp_cp.size)
        return {"moe_tokens_per_expert_min": low.item(),
                "moe_tokens_per_expert_mean": (spread[0] / spread[1]).item(),
                "moe_tokens_per_expert_max": high.item(),
                "moe_drop_rate": (counts[0] / counts[1]).item(), "moe_aux_loss": aux}
