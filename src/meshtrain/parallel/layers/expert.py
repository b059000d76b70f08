"""Mixture-of-Experts MLP with expert parallelism.

Routing (`routing.py`) is computed by every rank of a TP group from the same replicated tokens.

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

Sequence parallelism (dropless only): each TP rank holds s/tp of the sequence. The layer
all-gathers the tokens over TP, routes and dispatches them as above (every TP rank alike) and
keeps its own part of the output; the router runs on the rank's own tokens and gathers its
logits, so its weight gradient is partial over TP like every other sequence-parallel weight's.
Per pass this adds one all-gather of the layer's T x h input (forward: the tokens; backward:
the output's gradient) to the experts' all-reduce of k x T x h rows: at top-2, 1/5 of the TP
bytes. Routing locally instead would trade that all-gather for uneven all-gathers and
reduce-scatters of the dispatched rows over TP, which gloo cannot run and which take a second
expert path; one gather keeps one path and even collectives.

Whole experts (etp 1, Megatron's MoE parallel folding): the experts are not split over TP and
the EP axis spans TP ranks too (`mesh.py`). Every TP rank still routes all its tokens alike,
but dispatches only its own s/tp positions of each sequence, so no token is computed twice:
without sp the replicated input is split over TP (its gradient all-gathered) and the combined
output all-gathered back (its gradient: the rank's own part); with sp the rank's own tokens are
dispatched as they are, not gathered (only the router's logits are, as above). The combine
weights leave the replicated routing through the same split, so every TP rank's router gets the
full gradient. No TP collective runs inside the experts.

Context parallelism (dropless only): each CP rank routes its own tokens; routing is per token,
so the choices are those of one process. The load-balancing loss's expert fractions are summed
over CP, so the CP ranks' losses average to the loss of the whole micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm, regions
from meshtrain.parallel.layers.grouped_matmul import add_per_group, expert_gemm, grouped_linear
from meshtrain.parallel.layers.linear_functions import DENSE
from meshtrain.parallel.layers.routing import Router, RoutingRule, route
from meshtrain.parallel.layers.tensor import ColumnParallelLinear, RowParallelLinear

SHARED_GATES = ("none", "sigmoid")
"""How a shared expert's output joins the routed one: added as it is (DeepSeek), or scaled by
sigmoid(Linear(h -> 1)(x)) per token (Qwen2-MoE's `shared_expert_gate`)."""

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
    index, so names do not depend on ep. `shared_expert` (an MLP like the dense one) sees every
    token and its output is added to the routed one, scaled per token by
    sigmoid(`shared_expert_gate`(x)) where there is a gate (replicated [1, h], like the router).

    Each forward adds its weighted routing losses to `aux.loss` and appends its statistics to
    `aux.routing` (see `contracts.AuxiliaryOutputs`).
    """

    def __init__(self, router: nn.Linear, experts: dict[int, nn.Module], *, num_experts: int,
                 rule: RoutingRule, aux_loss_coef: float, z_loss_coef: float,
                 mesh: ParallelMesh, layer: int = 0, seq_aux_loss_coef: float = 0.0,
                 bias_rate: float = 0.0, global_aux: bool = False, gemm: str = "auto",
                 shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Linear | None = None,
                 sequence_axis: MeshAxis | None = None):
        super().__init__()
        self.router = Router(router, bias_rate=bias_rate, global_fractions=global_aux,
                             aux_tokens=rule.aux_tokens)  # replicated, [E, h], fp32
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.experts = nn.ModuleDict({str(e): expert for e, expert in experts.items()})
        self.num_experts, self.rule, self.layer = num_experts, rule, layer
        self.top_k, self.capacity_factor = rule.top_k, rule.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.seq_aux_loss_coef = seq_aux_loss_coef
        self.ep_axis, self.cp_axis, self.sequence_axis = mesh.ep, mesh.cp, sequence_axis
        # etp 1: each tp rank dispatches its own s/tp positions of every sequence
        self.token_axis = mesh.tp if mesh.whole_experts else None
        self.num_local = num_experts // mesh.ep.size
        self.first_local = mesh.ep.rank * self.num_local
        self.gemm = gemm  # a `grouped_matmul.GEMMS` choice

    def forward(self, x: torch.Tensor, aux) -> torch.Tensor:
        shared = None if self.shared_expert is None else self._shared(x)
        logits = self.router(x)  # on this rank's own tokens (see the module doc)
        if self.sequence_axis is not None:  # [b, s/tp, .] -> [b, s, .]
            logits = regions.gather_sequence_alike(logits, self.sequence_axis)
            if self.token_axis is None:
                x = regions.gather_sequence_alike(x, self.sequence_axis)
        elif self.token_axis is not None:  # [b, s, h] alike on every tp rank -> its [b, s/tp, h]
            x = regions.split_sequence(x, self.token_axis)
        b, s = logits.shape[:2]
        routing = self._route(logits.reshape(b * s, -1), b)
        own = routing if self.token_axis is None else self._own_rows(routing, b, s)
        combined = self._combine(x.reshape(-1, x.shape[-1]), own, b * s * self.top_k)
        aux.loss = aux.loss + self.aux_loss_coef * routing.aux_loss
        if self.z_loss_coef:
            aux.loss = aux.loss + self.z_loss_coef * routing.z_loss
        if self.seq_aux_loss_coef:
            aux.loss = aux.loss + self.seq_aux_loss_coef * routing.seq_aux_loss
        bias = self.router.expert_bias
        aux.routing.append({
            "layer": self.layer, "tokens_per_expert": routing.tokens_per_expert.detach(),
            "counts": torch.stack([routing.tokens_per_expert, routing.choices_per_expert,
                                   routing.first_per_expert]),
            "kept": routing.kept.sum(), "assigned": routing.kept.numel(),
            "aux_loss": routing.aux_loss.detach(),
            "bias": None if bias is None else bias.detach().clone()})
        out = combined.view(x.shape)
        if self.token_axis is not None and self.sequence_axis is None:
            out = regions.gather_sequence_alike(out, self.token_axis)
        elif self.sequence_axis is not None and self.token_axis is None:
            out = regions.split_sequence(out, self.sequence_axis)
        return out if shared is None else out + shared

    def _combine(self, tokens: torch.Tensor, routing, stride: int) -> torch.Tensor:
        """Tokens `[T, h]` -> the weighted sum of their kept choices' expert outputs `[T, h]`
        (`routing` of these T tokens; `stride` exceeds every slot)."""
        dispatch = self._dispatch(routing.tokens_per_expert)
        kept = torch.nonzero_static(routing.kept, size=dispatch.num_kept)  # [N, 2], token-major
        experts = routing.experts[kept[:, 0], kept[:, 1]]
        slots = routing.slots[kept[:, 0], kept[:, 1]]
        # Send order: by expert, then by slot (the order the capacity rule placed them).
        order = torch.argsort(experts * stride + slots)
        token_idx, choice_idx = kept[order, 0], kept[order, 1]
        outputs = self._run_experts(tokens[token_idx], dispatch)  # [N, h] in send order
        weights = routing.weights[token_idx, choice_idx].unsqueeze(-1).to(outputs.dtype)
        return torch.zeros_like(tokens).index_add(0, token_idx, outputs * weights)

    def _own_rows(self, routing, b: int, s: int):
        """At etp 1, the routing of this tp rank's s/tp positions of each of the b sequences
        (the tokens it dispatches; its kept choices per expert recounted). The combine
        weights leave the routing every tp rank computed alike through `split_sequence`, so
        their gradient is all-gathered back into that computation's."""
        axis = self.token_axis
        part = s // axis.size

        def own(t: torch.Tensor) -> torch.Tensor:  # [b s, k] -> [b s/tp, k]
            return t.view(b, s, -1).narrow(1, axis.rank * part, part).reshape(b * part, -1)

        weights = regions.split_sequence(routing.weights.view(b, s, -1), axis)
        experts, kept = own(routing.experts), own(routing.kept)
        counts = torch.zeros_like(routing.tokens_per_expert).index_add_(
            0, experts.flatten(), kept.flatten().long())
        return dataclasses.replace(routing, experts=experts, kept=kept, slots=own(routing.slots),
                                   weights=weights.reshape(b * part, -1),
                                   tokens_per_expert=counts)

    def _route(self, logits: torch.Tensor, sequences: int):
        """This micro-batch's routing (`routing.route`) by the router's fp32 logits `[T, E]`,
        choice bias and global fractions (the balancing loss's own fractions summed over cp)."""
        return route(logits, self.rule, bias=self.router.expert_bias,
                     fractions=self.router.load_fractions, token_axis=self.cp_axis,
                     sequences=sequences if self.seq_aux_loss_coef else 0)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's output for the layer's input `x` as it comes (sequence-split
        under sp: the shared expert is an MLP of the model, sequence-parallel like the dense
        one), scaled per token by sigmoid(`shared_expert_gate`(x)) where there is a gate."""
        out = self.shared_expert(x)
        if self.shared_expert_gate is None:
            return out
        return out * torch.sigmoid(self.shared_expert_gate(x))

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
        out = self._expert_outputs(rows[perm], dispatch.sizes)[torch.argsort(perm)]  # received
        # order again
        if ep.size > 1:
            out = regions.all_to_all_differentiable(out, ep, send_splits=dispatch.recv_splits,
                                                 recv_splits=dispatch.send_splits)
        return out

    def _expert_outputs(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Rows sorted by local expert (`sizes` of each) -> their experts' outputs."""
        experts = [self.experts[str(self.first_local + i)] for i in range(self.num_local)]
        backend = expert_gemm(self.gemm, rows.device)
        if backend == "loop" or not all(map(_stackable, experts)):
            chunks = rows.split(sizes)
            return torch.cat([e(chunk) for e, chunk in zip(experts, chunks, strict=True)])
        return grouped_mlp(experts, rows, sizes, backend)


def _stackable(expert: nn.Module) -> bool:
    """An MLP of Megatron's dense linears, each a plain matmul around f and g."""
    fc, proj = getattr(expert, "fc", None), getattr(expert, "proj", None)
    return (type(fc) is ColumnParallelLinear and type(proj) is RowParallelLinear
            and fc.replicas == 1 and not fc.gather_output and proj.input_is_parallel
            and not (fc.sequence_parallel or proj.sequence_parallel)
            and all(p.gemm is DENSE and p.weight_grads is None for p in (fc, proj)))


def grouped_mlp(experts: list[nn.Module], rows: torch.Tensor, sizes: list[int],
                backend: str) -> torch.Tensor:
    """The experts' MLPs over their `sizes` consecutive rows, each projection of all of them
    one `grouped_linear` of their stacked weights: the same operations as each expert's own
    forward (f, fc with its bias, the activation, proj, g, proj's bias)."""
    fc, proj = [e.fc for e in experts], [e.proj for e in experts]
    axis = fc[0].tp_axis
    if axis.size > 1:
        rows = regions.copy_to_tensor_parallel_region(rows, axis)
    hidden = grouped_linear(rows, _stacked(fc, "weight"), _stacked(fc, "bias"), sizes, backend)
    out = grouped_linear(experts[0].activation(hidden), _stacked(proj, "weight"), None, sizes,
                         backend)
    if axis.size > 1:
        out = regions.reduce_from_tensor_parallel_region(out, axis)
    bias = _stacked(proj, "bias")
    return out if bias is None else add_per_group(out, bias, sizes)


def _stacked(layers: list[nn.Module], name: str) -> torch.Tensor | None:
    tensors = [getattr(layer, name) for layer in layers]
    return None if tensors[0] is None else torch.stack(tensors)
