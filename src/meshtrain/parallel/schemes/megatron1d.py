"""Megatron-LM's 1D tensor parallelism (seed 000) as a scheme: the tp ranks in a line, heads
and the MLP width split tp ways, weights split by rows (column-parallel) or columns
(row-parallel), hidden states replicated over tp unless sequence parallelism splits them. Its
layers are `layers/tensor.py`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm, regions
from meshtrain.parallel.layers.loss import vocab_parallel_cross_entropy
from meshtrain.parallel.layers.norms import HeadNorm
from meshtrain.parallel.layers.rng import REPLICATED, TENSOR_PARALLEL
from meshtrain.parallel.layers.sharding import tensor_parallel_parameters
from meshtrain.parallel.layers.tensor import (
    ColumnParallelGroup,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from meshtrain.parallel.schemes.factory import LayerFactory
from meshtrain.parallel.schemes.scheme import Clock, TPScheme, Traffic, Waits


class Megatron1D(LayerFactory):
    """Megatron-LM's 1D tensor parallelism over the `tp` axis, with the plan's sequence
    parallelism, context-parallel attention and recomputation.

    Hidden states are replicated over TP (`[b, s, h]`) or, with sequence parallelism, split
    along the sequence (`[b, s/tp, h]`); column-parallel layers split heads and the MLP width,
    row-parallel layers sum them back (seed 000). Norms stay whole. With `tp_overlap` the
    sequence-parallel linears (the output layer too) overlap their all-gather and
    reduce-scatter with chunks of their matmuls.
    """

    def __init__(self, plan, mesh: ParallelMesh):
        super().__init__(plan, mesh)
        self.sequence_parallel = plan.sequence_parallel and mesh.tp.size > 1
        self.tp_overlap = plan.tp_overlap and self.sequence_parallel
        self._linear_home: ParallelMesh | MeshAxis = mesh  # what linears split over

    def column(self, dense: nn.Linear, *, blocks: int = 1, heads: int | None = None) -> nn.Module:
        # heads fewer than the TP ranks: each is held whole by tp / heads consecutive ranks
        replicas = max(1, self.mesh.tp.size // heads) if heads else 1
        return ColumnParallelLinear.from_dense(dense, mesh=self._linear_home, output_blocks=blocks,
                                               sequence_parallel=self.sequence_parallel,
                                               replicas=replicas, tp_overlap=self.tp_overlap)

    def column_group(self, **layers: nn.Module) -> nn.Module:
        return ColumnParallelGroup(**layers)

    def row(self, dense: nn.Linear) -> nn.Module:
        return RowParallelLinear.from_dense(dense, mesh=self._linear_home, input_is_parallel=True,
                                            sequence_parallel=self.sequence_parallel,
                                            tp_overlap=self.tp_overlap)

    def vocab_embedding(self, dense: nn.Embedding) -> nn.Module:
        return VocabParallelEmbedding.from_dense(dense, mesh=self.mesh,
                                                 sequence_parallel=self.sequence_parallel,
                                                 tp_overlap=self.tp_overlap)

    def vocab_head(self, dense: nn.Linear) -> nn.Module:
        return VocabParallelHead.from_dense(dense, mesh=self.mesh,
                                            sequence_parallel=self.sequence_parallel,
                                            tp_overlap=self.tp_overlap)

    def norm(self, dense: nn.Module) -> nn.Module:
        return dense

    def replicated(self, dense: nn.Module) -> nn.Module:
        return dense  # (under sp its gradient is summed over tp by `partial_gradients`)

    def into_heads(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return regions.gather_from_sequence_parallel_region(x, self.mesh.tp)
        return regions.copy_to_tensor_parallel_region(x, self.mesh.tp)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, mesh=self.mesh,
                                            ignore_index=ignore_index)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return comm.all_gather(logits, self.mesh.tp, dim=-1)

    def hidden_positions(self, positions: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return positions
        return positions.chunk(self.mesh.tp.size, dim=-1)[self.mesh.tp.rank]

    @property
    def hidden_stream(self) -> str:
        # under sequence parallelism each TP rank holds different tokens
        return TENSOR_PARALLEL if self.sequence_parallel else REPLICATED

    @property
    def splits_sequence(self) -> bool:
        return self.sequence_parallel or self.mesh.cp.size > 1

    @property
    def sequence_axis(self) -> MeshAxis | None:
        return self.mesh.tp if self.sequence_parallel else None

    @contextlib.contextmanager
    def expert_layers(self):
        split = self.sequence_parallel, self.tp_overlap, self._linear_home
        self.sequence_parallel = self.tp_overlap = False
        if self.mesh.whole_experts:
            self._linear_home = self.mesh.axis("etp")
        try:
            yield
        finally:
            self.sequence_parallel, self.tp_overlap, self._linear_home = split

    def hidden_shape(self, batch: int, tokens: int, hidden: int) -> tuple[int, ...]:
        return (batch, tokens // (self.mesh.tp.size if self.sequence_parallel else 1), hidden)

    def partial_gradients(self, model: nn.Module,
                          exclude: set[int]) -> list[tuple[MeshAxis, list[nn.Parameter]]]:
        """Replicated key/value projections: summed over the ranks sharing them; head norms
        (each rank normalises its own heads): summed over TP. Under sequence parallelism every
        parameter applied to s/tp tokens (norms, row-parallel biases, positions) as well,
        head norms among them: summed over TP."""
        groups: dict[int, list[nn.Parameter]] = {}
        heads = []
        for module in model.modules():
            if isinstance(module, ColumnParallelLinear) and module.replicas > 1:
                groups.setdefault(module.replicas, []).extend(module.parameters(recurse=False))
            if isinstance(module, HeadNorm) and id(module.weight) not in exclude:
                heads.append(module.weight)
        partial = [(self.mesh.tp_block(r), params) for r, params in sorted(groups.items())]
        if self.sequence_parallel:
            sharded = tensor_parallel_parameters(model)
            partial.append((self.mesh.tp, [p for p in model.parameters()
                                           if id(p) not in sharded and id(p) not in exclude]))
        elif heads and self.mesh.tp.size > 1:
            partial.append((self.mesh.tp, heads))
        return partial


def megatron_layer(tokens: int, hidden: int, t: int, e: int) -> Traffic:
    """Per layer (not per linear): two all-reduces of the layer's [B, h] activation each way,
    8 (t-1)/t B h e in all."""
    moved = 2 * 2 * (t - 1) / t * tokens * hidden * e
    return Traffic(moved, moved, 2 * 2 * (t - 1), 2 * 2 * (t - 1))


class MegatronScheme(TPScheme):
    name = "1d"
    supports = frozenset({
        "tp", "pp", "tp_overlap", "sequence_parallel", "cp", "cp_all2all", "cp_hybrid",
        "cp_a2a", "ep", "etp", "moe",
        "moe_seq_aux", "moe_capacity", "mla", "dropout", "compile", "fp8", "half", "fp64", "zero",
        "zero_gradients", "zero_parameters", "offload", "hybrid", "virtual_stages",
        "split_backward", "two_weight_versions"})
    axes = ("tp",)

    def grid(self, tp: int, depth: int | None = None) -> dict[str, int]:
        return {"tp": tp}

    def head_parts(self, grid: dict[str, int]) -> int:
        return grid["tp"]

    def factory(self, plan, mesh: ParallelMesh) -> LayerFactory:
        return Megatron1D(plan, mesh)

    def layer_traffic(self, model, grid: dict[str, int], tokens: int, e: int) -> Traffic:
        return megatron_layer(tokens, model.hidden_size, grid["tp"], e)

    def hidden_parts(self, plan) -> int:
        return plan.tp if plan.sequence_parallel else 1  # SP splits the sequence

    def hidden_size_parts(self, grid: dict[str, int]) -> int:
        return 1

    def layer_saved_bytes(self, plan, model, **shape) -> float:
        return model.activation_bytes(tp=plan.tp, sequence_parallel=plan.sequence_parallel,
                                      **shape)

    def layer_comm(self, plan, model, tokens: int, e: int, clock: Clock, *,
                   weights: Sequence[float], split: bool) -> Waits:
        """Two all-reduces a layer each way (SP: an all-gather and a reduce-scatter each);
        backward's all-reduces of the QKV and first MLP inputs run behind those matmuls' weight
        gradients, unless `split` defers them (the all-reduce is then waited for at once); SP's
        backward gathers the QKV and first MLP inputs again for their weight gradients, under
        `split` at the `W`."""
        n = tokens * model.hidden_size * e
        if plan.sequence_parallel:
            gather, scatter = clock.all_gather(n), clock.reduce_scatter(n)
            if plan.tp_overlap:
                return _overlapped(clock, gather, scatter, weights, split)
            return Waits(2 * (gather + scatter), 2 * (2 * gather + scatter),
                         2 * gather if split else 0.0)
        one = clock.all_reduce(n)
        if split:
            return Waits(2 * one, 2 * one)
        return Waits(2 * one, clock.behind(one, weights[0]) + clock.behind(one, weights[2]))

    def embedding_comm(self, plan, model, tokens: int, e: int,
                       clock: Clock) -> tuple[float, float]:
        """The vocab-parallel lookup writes the whole activation; its partial sums are
        reduced (SP: scattered)."""
        n = tokens * model.hidden_size * e
        return n, clock.reduce_scatter(n) if plan.sequence_parallel else clock.all_reduce(n)

    def output_comm(self, plan, model, tokens: int, e: int,
                    clock: Clock) -> tuple[float, Waits]:
        """Three small all-reduces of per-token statistics, and f's backward all-reduce of
        the whole input (SP: its all-gather, both ways)."""
        n = tokens * model.hidden_size * e
        stats = 3 * clock.all_reduce(tokens * 4)
        gather = clock.all_gather(n) if plan.sequence_parallel else clock.all_reduce(n)
        return n, Waits(stats + (gather if plan.sequence_parallel else 0.0), gather)


def _overlapped(clock: Clock, gather: float, scatter: float, weights: Sequence[float],
                split: bool) -> Waits:
    """`tp_overlap` (`collective_matmul.py`): each linear's all-gather or reduce-scatter runs as
    ring steps behind its chunked matmul, forward and backward (a column-parallel backward's
    reduce-scatter carries the input's re-gather on the same steps, unless a split backward
    leaves that to the `W`, unoverlapped)."""
    qkv, proj, fc1, fc2 = weights
    forward = sum(clock.ring_behind(comm, matmul) for comm, matmul in (
        (gather, qkv), (scatter, proj), (gather, fc1), (scatter, fc2)))
    column = scatter if split else scatter + gather
    weight = 2 * gather if split else 0.0
    backward = sum(clock.ring_behind(column, m) for m in (qkv, fc1)) \
        + sum(clock.ring_behind(gather, m) for m in (proj, fc2)) + weight
    return Waits(forward, backward, weight)


MEGATRON_1D = MegatronScheme()
