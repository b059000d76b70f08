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

from torch import nn

from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.schemes.grid_factory import GridFactory
from meshtrain.parallel.schemes.summa_layers import (
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


class Summa2D(GridFactory):
    """The 2D/2.5D scheme over the mesh's (tp_depth,) tp_row, tp_col grid."""

    hidden_axis, vocab_axis = COL, COL

    def __init__(self, plan, mesh: ParallelMesh):
        if mesh.tp_scheme not in ("2d", "2.5d"):
            raise ValueError(f"`tp_scheme` {plan.tp_scheme} needs a mesh with a q x q (x d) TP"
                             f" grid, this one is {mesh.tp_scheme}: build the mesh from the plan")
        super().__init__(plan, mesh, q=mesh.tp_grid[ROW])
        self.batch_parts = mesh.tp_grid.get(DEPTH, 1) * self.q
        # the batch chunk is l q + i: tp_row inside tp_depth
        self.logits_batch_axes = self.replicated_axes = (ROW, *depth_axes(mesh))

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
