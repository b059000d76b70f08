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

Traffic per linear h_in -> h_out and micro-batch of B tokens, element size e: forward broadcasts
the q input blocks along rows and the q weight blocks along columns, (q-1)/q^2 (B h_in / d +
h_in h_out) e per rank; backward broadcasts both again and reduces the input and weight
gradients: twice that. Per optimizer step, 2.5d all-reduces the weight gradients over depth,
2 (d-1)/d x the rank's weights (dense / q^2) x the gradient element size. Left out: the norms'
statistics all-reduces (B / batch split floats over one grid axis: latency, a few bytes).
"""

from __future__ import annotations

from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.schemes.grid import GridFactory, GridScheme
from meshtrain.parallel.schemes.scheme import Traffic, integer_root, layer_linears
from meshtrain.parallel.schemes.summa_layers import (
    COL,
    DEPTH,
    ROW,
    SummaLinear,
    SummaLinearGroup,
    SummaVocabEmbedding,
    SummaVocabHead,
    depth_axes,
)


class Summa2D(GridFactory):
    """The 2D/2.5D scheme over the mesh's (tp_depth,) tp_row, tp_col grid."""

    hidden_axis, vocab_axis = COL, COL

    def __init__(self, plan, mesh: ParallelMesh):
        if mesh.tp_scheme not in ("2d", "2.5d"):
            raise SettingError(Code.MESH_SCHEME, (
                f"`tp_scheme` {plan.tp_scheme} needs a mesh with a q x q (x d) TP"
                f" grid, this one is {mesh.tp_scheme}: build the mesh from the plan"))
        super().__init__(plan, mesh, q=mesh.tp_grid[ROW])
        self.batch_parts = mesh.tp_grid.get(DEPTH, 1) * self.q
        # the batch chunk is l q + i: tp_row inside tp_depth
        self.logits_batch_axes = self.replicated_axes = (ROW, *depth_axes(mesh))

    def column(self, dense: nn.Linear, *, blocks: int = 1, heads: int | None = None) -> nn.Module:
        if heads is not None and heads % self.q:
            raise SettingError(Code.GRID_SHAPE, (
                f"`tp_scheme` {self.mesh.tp_scheme} splits attention heads"
                f" q = {self.q} ways: {heads} heads are not divisible; change the"
                " model or `tp`"))
        return SummaLinear(dense, self.mesh, blocks=blocks)

    def column_group(self, **layers: nn.Module) -> nn.Module:
        return SummaLinearGroup(**layers)

    def row(self, dense: nn.Linear) -> nn.Module:
        return SummaLinear(dense, self.mesh)

    def vocab_embedding(self, dense: nn.Embedding) -> nn.Module:
        return SummaVocabEmbedding(dense, self.mesh)

    def vocab_head(self, dense: nn.Linear) -> nn.Module:
        return SummaVocabHead(dense, self.mesh)



def summa_linear(tokens: int, h_in: int, h_out: int, q: int, d: int, e: int) -> Traffic:
    """2d (d = 1) and 2.5d: q broadcasts of input and weight blocks forward; backward broadcasts
    them again and reduces the input and weight gradients."""
    forward = (q - 1) / q**2 * (tokens * h_in / d + h_in * h_out) * e
    return Traffic(forward, 2 * forward, 2 * q * (q - 1), 4 * q * (q - 1))


def summa_logits(tokens: int, hidden: int, vocab: int, q: int, d: int, e: int) -> Traffic:
    """The output layer (`summa_layers._SummaLogits`): q broadcasts of table blocks and q
    reduces of logit blocks forward; backward broadcasts the logits' gradient and the table
    blocks and reduces the table gradient: (q-1)/q^2 (2 B V/d + 3 V h) e in all."""
    share = (q - 1) / q**2 * e
    forward = share * (vocab * hidden + tokens * vocab / d)
    backward = share * (tokens * vocab / d + 2 * vocab * hidden)
    return Traffic(forward, backward, 2 * q * (q - 1), 3 * q * (q - 1))


def depth_gradient_bytes(rank_weights: float, d: int, grad_bytes: int) -> float:
    """2.5d, once per optimizer step: the weight gradients (the dense weights / q^2 each rank
    holds) all-reduced over the d depth layers, which saw different tokens."""
    return 2 * (d - 1) / d * rank_weights * grad_bytes


class SummaScheme(GridScheme):
    """2d: a q x q grid (tp = q^2, Optimus)."""

    name = "2d"
    axes = (ROW, COL)

    def grid(self, tp: int, depth: int | None = None) -> dict[str, int]:
        q = self.side(tp, 2)
        return {ROW: q, COL: q}

    def head_parts(self, grid: dict[str, int]) -> int:
        return grid[COL]

    def batch_parts(self, grid: dict[str, int]) -> int:
        return grid.get(DEPTH, 1) * grid[ROW]

    def weight_parts(self, grid: dict[str, int]) -> int:
        return grid[ROW] * grid[COL]  # replicated over depth

    def factory(self, plan, mesh: ParallelMesh) -> Summa2D:
        return Summa2D(plan, mesh)

    def layer_traffic(self, model, grid: dict[str, int], tokens: int, e: int) -> Traffic:
        total = Traffic()
        for h_in, h_out in layer_linears(model):
            total += summa_linear(tokens, h_in, h_out, grid[COL], grid.get(DEPTH, 1), e)
        return total

    def output_traffic(self, grid: dict[str, int], tokens: int, hidden: int, vocab: int,
                       e: int) -> Traffic:
        return summa_logits(tokens, hidden, vocab, grid[COL], grid.get(DEPTH, 1), e)

    def step_traffic(self, grid: dict[str, int], rank_weights: float, grad_bytes: int
                     ) -> Traffic:
        d = grid.get(DEPTH, 1)
        moved = depth_gradient_bytes(rank_weights, d, grad_bytes)
        return Traffic(backward_bytes=moved, backward_steps=2 * (d - 1))


class TesseractScheme(SummaScheme):
    """2.5d: d grids of q x q (tp = d q^2, Tesseract); the depth defaults to the largest d
    leaving q >= 2."""

    name = "2.5d"
    axes = (DEPTH, ROW, COL)
    takes_depth = True

    def grid(self, tp: int, depth: int | None = None) -> dict[str, int]:
        for d in [depth] if depth is not None else range(tp, 0, -1):
            if d >= 1 and tp % d == 0 and (q := integer_root(tp // d, 2)) is not None \
                    and q >= 2:
                return {DEPTH: d, ROW: q, COL: q}
        if depth is not None:
            raise SettingError(Code.GRID_DEPTH, (
                
                f"`tp_depth` {depth} must divide `tp` {tp} into d x q x q with q >= 2: choose a"
                " depth d with tp / d a square >= 4"))
        raise SettingError(Code.GRID_TP, (
            
            f"`tp_scheme` {self.name} arranges tp as d x q x q with q >= 2: `tp` {tp} is not"
            " one (use 4, 8, 9, 12, 16, ...)"))

    def depth_choices(self, tp: int, *, fixed: bool) -> list[int | None]:
        """Every depth d >= 2 (d = 1 is 2d) tp forms, or d = 1 too when 2.5d is asked for by
        name (none forming: the default, for validation to refuse)."""
        depths = [d for d in range(1 if fixed else 2, tp + 1) if self.forms(tp, d)]
        return depths or ([None] if fixed else [])


SUMMA_2D = SummaScheme()
TESSERACT_2P5D = TesseractScheme()
