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
per-expert counts, which the host reads once per layer forward (the only device read inside a
step besides the step's scalars); results come back by the reverse all-to-all. Gradients flow
back through the same two all-to-alls in reverse.

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
from meshtrain.parallel.communication import comm, regions
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
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def route(logits: torch.Tensor, *, top_k: int, capacity_factor: float) -> Routing:
    """Top-k routing with deterministic capacity dropping; `logits` `[T, E]`."""
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
    aux_loss = num_experts * (top1_fraction * probs.mean(dim=0)).sum()
    z_loss = torch.logsumexp(logits, dim=-1).pow(2).mean()
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    tokens_per_expert.index_add_(0, experts.flatten(), kept.flatten().long())  # no masked select
    return Routing(experts, weights, slots, kept, aux_loss, z_loss, tokens_per_expert)


@dataclass
class _Dispatch:
    """One MoE layer's sizes, read from the device once: kept (token, choice) rows, rows sent to
    and received from each EP rank, rows per local expert; `per_source` [ep, local] stays on
    the device (received rows per source rank and local expert)."""

    num_kept: int
    send_splits: list[int]
    recv_splits: list[int]
    sizes: list[int]
    per_source: torch.Tensor


class MoE(nn.Module):
    """Routed experts in place of a dense MLP. `experts` holds only this EP rank's experts (each
    an MLP of the model's family, tensor-parallel like the dense one), keyed by global expert
    index, so names do not depend on ep.

    Each forward adds its weighted routing losses to `aux.loss` and appends its statistics to
    `aux.routing` (see `contracts.AuxiliaryOutputs`).
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
        dispatch = self._dispatch(routing.tokens_per_expert)
        kept = torch.nonzero_static(routing.kept, size=dispatch.num_kept)  # [N, 2], token-major
        experts = routing.experts[kept[:, 0], kept[:, 1]]
        slots = routing.slots[kept[:, 0], kept[:, 1]]
        # Send order: by expert, then by slot (the order the capacity rule placed them).
        order = torch.argsort(experts * (b * s * self.top_k) + slots)
        token_idx, choice_idx = kept[order, 0], kept[order, 1]
        outputs = self._run_experts(tokens[token_idx], dispatch)  # [N, h] in send order
        weights = routing.weights[token_idx, choice_idx].unsqueeze(-1).to(outputs.dtype)
        combined = torch.zeros_like(tokens).index_add(0, token_idx, outputs * weights)
        aux.routing.append({"tokens_per_expert": routing.tokens_per_expert.detach(),
                            "kept": routing.kept.sum(), "assigned": routing.kept.numel(),
                            "aux_loss": routing.aux_loss.detach()})
        return combined.view(b, s, h)

    def _dispatch(self, counts: torch.Tensor) -> _Dispatch:
        """The sizes of this layer's all-to-alls and expert batches from the kept choices per
        expert `counts` [E]: the layer's one read of the device (an all-to-all of variable
        splits takes its sizes on the host)."""
        ep, local = self.ep_axis, self.num_local
        received = counts if ep.size == 1 else comm.all_to_all(
            counts, ep, send_splits=[local] * ep.size, recv_splits=[local] * ep.size)
        host = torch.cat([counts, received]).tolist()
        sent, got = host[:self.num_experts], host[self.num_experts:]

        def per_rank(values: list[int]) -> list[int]:
            return [sum(values[i:i + local]) for i in range(0, len(values), local)]

        return _Dispatch(num_kept=sum(sent), send_splits=per_rank(sent),
                         recv_splits=per_rank(got),
                         sizes=[sum(got[e::local]) for e in range(local)],
                         per_source=received.view(-1, local))

    def _run_experts(self, rows: torch.Tensor, dispatch: _Dispatch) -> torch.Tensor:
        """Rows sorted by expert -> expert outputs in the same order (through EP when ep > 1)."""
        ep = self.ep_axis
        if ep.size > 1:
            rows = regions.all_to_all_differentiable(rows, ep, send_splits=dispatch.send_splits,
                                                  recv_splits=dispatch.recv_splits)
        # Received rows are grouped by source, then by local expert: a stable sort on each
        # row's local expert regroups them by expert, sources in order.
        sources = dispatch.per_source.shape[0]
        labels = torch.arange(self.num_local, device=rows.device).repeat(sources)
        owner = torch.repeat_interleave(labels, dispatch.per_source.flatten(),
                                        output_size=rows.shape[0])
        perm = torch.argsort(owner, stable=True)
        outs = [self.experts[str(self.first_local + local)](chunk)
                for local, chunk in enumerate(rows[perm].split(dispatch.sizes))]
        out = torch.cat(outs)[torch.argsort(perm)]  # back to the received order
        if ep.size > 1:
            out = regions.all_to_all_differentiable(out, ep, send_splits=dispatch.recv_splits,
                                                 recv_splits=dispatch.send_splits)
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
