"""2D (Optimus) and 2.5D (Tesseract) tensor parallelism as a `LayerFactory`.

The TP block is d grids of q x q ranks, coordinates (l, i, j) on (tp_depth, tp_row, tp_col);
tp = d q^2, and 2D is d = 1. Hidden states are `[b/(d q), s, h/q]` (batch chunk l q + i, hidden
chunk j): nothing is replicated inside a depth layer. Every linear layer is a SUMMA product on
its depth layer's grid (`summa_layers.py`) with the same layout in and out, so attention and the
MLP's activation are local (heads and MLP features chunk j). Weights are 1/q^2 of the dense
ones, replicated over depth: their gradients are summed over tp_depth after the data-parallel
reduction. Norms split the hidden size over tp_col (`split_norms.py`).

The loss runs on the logits' batch chunk with the vocabulary split over tp_col; the per-token
losses are all-gathered over the batch, so every rank returns the whole micro-batch's.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.models.blocks import RMSNorm
from meshtrain.parallel import comm
from meshtrain.parallel.attention import AttentionCore
from meshtrain.parallel.batch_split import gather_batch, partial_gradients_by_axis
from meshtrain.parallel.factory import LayerFactory
from meshtrain.parallel.loss import vocab_parallel_cross_entropy
from meshtrain.parallel.split_norms import SplitLayerNorm, SplitRMSNorm
from meshtrain.parallel.summa_layers import (
    COL,
    DEPTH,
    ROW,
    SummaLinear,
    SummaLinearGroup,
    SummaPositionEmbedding,
    SummaVocabEmbedding,
    SummaVocabHead,
    depth_axes,
)
from meshtrain.random import TENSOR_PARALLEL


class Summa2D(LayerFactory):
    """The 2D/2.5D scheme over the mesh's (tp_depth,) tp_row, tp_col grid; the plan gives the
    attention core's options and recomputation."""

    def __init__(self, plan, mesh: ParallelMesh):
        if mesh.tp_scheme not in ("2d", "2.5d"):
            raise ValueError(f"`tp_scheme` {plan.tp_scheme} needs a mesh with a q x q (x d) TP"
                             f" grid, this one is {mesh.tp_scheme}: build the mesh from the plan")
        self.mesh = mesh
        self.q, self.depth = mesh.tp_grid[ROW], mesh.tp_grid.get(DEPTH, 1)
        self.cp_mode = plan.cp_mode
        self.recompute, self.recompute_layers = plan.recompute, plan.recompute_layers

    def column(self, dense: nn.Linear, *, blocks: int = 1, heads: int | None = None) -> nn.Module:
        if heads is not None and heads % self.q:
            raise ValueError(f"`tp_scheme` {self.mesh.tp_scheme} splits attention heads"
                             f" q = {self.q} ways: {heads} heads are not divisible; change the"
                             " model or `tp`")
        return SummaLinear(dense, self.mesh, blocks=blocks)

    def column_group(self, **layers: nn.Module) -> nn.Module:
        return SummaLinearGroup(**layers)

    def row(self, dense: nn.Linear) -> nn.Module:
        return SummaLinear(dense, self.mesh)

    def vocab_embedding(self, dense: nn.Embedding) -> nn.Module:
        return SummaVocabEmbedding(dense, self.mesh)

    def vocab_head(self, dense: nn.Linear) -> nn.Module:
        return SummaVocabHead(dense, self.mesh)

    def position_embedding(self, dense: nn.Embedding) -> nn.Module:
        return SummaPositionEmbedding(dense, self.mesh)

    @property
    def head_parts(self) -> int:
        return self.q

    def norm(self, dense: nn.Module) -> nn.Module:
        options = dict(hidden_axis=COL, partial=(ROW, *depth_axes(self.mesh)))
        if isinstance(dense, nn.LayerNorm):
            return SplitLayerNorm(dense, self.mesh, **options)
        if isinstance(dense, RMSNorm):
            return SplitRMSNorm(dense, self.mesh, **options)
        raise ValueError(f"`tp_scheme` {self.mesh.tp_scheme} splits LayerNorm and RMSNorm, not"
                         f" {type(dense).__name__}: use `tp_scheme` 1d")

    def attention_core(self, *, dropout: float, eager: bool) -> nn.Module:
        return AttentionCore(dropout=dropout, eager=eager, cp_axis=self.mesh.cp,
                             cp_mode=self.cp_mode, recompute=self.recompute == "selective")

    def recompute_layer(self, index: int) -> bool:
        limit = self.recompute_layers
        return self.recompute == "full" and (limit is None or index < limit)

    def _batch_axes(self) -> list[MeshAxis]:
        """The axes splitting the batch, innermost first (tp_row, then tp_depth)."""
        return [self.mesh.axis(name) for name in (ROW, *depth_axes(self.mesh))]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int) -> torch.Tensor:
        """Per-token losses `[b, s]` of the whole micro-batch, equal on every rank; backward
        keeps this rank's chunk's gradient."""
        chunk = self.mesh.tp_coords().get(DEPTH, 0) * self.q + self.mesh.axis(ROW).rank
        mine = targets.chunk(self.depth * self.q)[chunk]
        losses = vocab_parallel_cross_entropy(logits, mine, mesh=self.mesh.axis(COL),
                                              ignore_index=ignore_index)
        for axis in self._batch_axes():
            losses = gather_batch(losses, axis)
        return losses

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        full = comm.all_gather(logits, self.mesh.axis(COL), dim=-1)  # [b/(dq), s, V_padded]
        for axis in self._batch_axes():
            full = comm.all_gather(full, axis, dim=0)
        return full

    def hidden_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions  # batch and hidden are split, never the sequence

    @property
    def hidden_stream(self) -> str:
        return TENSOR_PARALLEL  # each rank holds different tokens and features

    @property
    def splits_sequence(self) -> bool:
        return False

    def hidden_shape(self, batch: int, tokens: int, hidden: int) -> tuple[int, ...]:
        return (batch // (self.depth * self.q), tokens, hidden // self.q)

    def partial_gradients(self, model: nn.Module,
                          exclude: set[int]) -> list[tuple[MeshAxis, list[nn.Parameter]]]:
        """What the layers name in `partial_axes`: biases, norms and the position table over
        tp_row (and depth); under 2.5D every weight over tp_depth."""
        return partial_gradients_by_axis(model, self.mesh, exclude)
