"""The layers of 2D (Optimus, Xu et al. 2021, arXiv 2104.05343) and 2.5D (Tesseract, Wang et
al. 2021, arXiv 2105.14500) tensor parallelism; `summa.Summa2D` builds models from them.

The TP block is d grids of q x q ranks: coordinates (l, i, j) on the axes (tp_depth, tp_row,
tp_col); 2D is d = 1. Hidden states are `[b/(d q), s, h/q]`: batch chunk l q + i, hidden chunk
j. A linear layer's `[out, in]` weight holds out chunk j and in chunk i, the same on every depth
layer; Y = X W^T runs as SUMMA inside each depth layer on its share of the batch: q steps, step
k broadcasting X's column k along each grid row (over tp_col) and W's row k along each grid
column (over tp_row), each rank adding one block product. Backward broadcasts the same blocks
again and reduces the partial input and weight gradients to their owners, so nothing gathered
is saved. Per linear and micro-batch of B tokens a rank sends 3 (q-1)/q^2 (B in/d + in out)
elements (broadcast and reduce counted as (n-1)/n of the payload, as a pipelined ring moves
them); the weight gradients are then summed over depth once per step.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.communication.regions import reduce_scatter_batch
from meshtrain.parallel.layers.sharding import Shard
from meshtrain.parallel.layers.vocab import TiedAsHead, mask_padding, partial_lookup
from meshtrain.parallel.schemes.grid_layers import adopt_slices, check_split

ROW, COL, DEPTH = "tp_row", "tp_col", "tp_depth"


@dataclass(frozen=True)
class Grid:
    """This rank's q x q grid: `row` varies the row coordinate i (the ranks of one grid
    column), `col` the column coordinate j (the ranks of one grid row)."""

    row: MeshAxis
    col: MeshAxis

    @classmethod
    def of(cls, mesh: ParallelMesh) -> Grid:
        return cls(mesh.axis(ROW), mesh.axis(COL))

    @property
    def q(self) -> int:
        return self.row.size


def depth_axes(mesh: ParallelMesh) -> tuple[str, ...]:
    """The depth axis, where the grid has one (2.5D): what every weight is replicated over."""
    return (DEPTH,) if DEPTH in mesh.tp_grid else ()


def _shared(tensor: torch.Tensor, axis: MeshAxis, src: int) -> torch.Tensor:
    """Axis rank `src`'s `tensor` (all ranks of `axis` hold one of the same shape)."""
    buffer = tensor.contiguous() if axis.rank == src else torch.empty_like(tensor)
    comm.broadcast(buffer, axis, src_axis_rank=src)
    return buffer


def _reduced(part: torch.Tensor, axis: MeshAxis, dst: int) -> torch.Tensor | None:
    """`part` summed over `axis` into axis rank `dst` (None on the others)."""
    comm.reduce(part, axis, dst_axis_rank=dst)
    return part if axis.rank == dst else None


def _owned(parts: Iterable[torch.Tensor | None]) -> torch.Tensor | None:
    """The one of `parts` (steps reducing to one owner each, all run) this rank owns."""
    owned = None
    for part in parts:
        owned = part if part is not None else owned
    return owned


class _SummaMatmul(torch.autograd.Function):
    """x W^T by SUMMA (module docstring): x `[..., in/q]`, weight `[out/q, in/q]`."""

    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        ctx.save_for_backward(x, weight)
        ctx.grid = grid
        return functools.reduce(operator.add, (
            F.linear(_shared(x, grid.col, k), _shared(weight, grid.row, k))
            for k in range(grid.q)))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grid, grad_x, grad_weight = ctx.grid, None, None
        if ctx.needs_input_grad[0]:  # dX_ik = sum_j dY_ij W_kj
            grad_x = _owned(_reduced(grad @ _shared(weight, grid.row, k), grid.col, k)
                            for k in range(grid.q))
        flat_grad = grad.reshape(-1, grad.shape[-1])
        # dW_kj = sum_i dY_ij^T X_ik
        blocks = (_shared(x, grid.col, k).flatten(0, -2) for k in range(grid.q))
        grad_weight = _owned(_reduced(flat_grad.T @ block, grid.row, k)
                             for k, block in enumerate(blocks))
        return grad_x, grad_weight, None


class _SummaLogits(torch.autograd.Function):
    """Logits x E^T of hidden states `[..., h/q]` (batch chunk i, hidden chunk j) and a
    vocabulary table `[V/q (i), h/q (j)]` -> `[..., V/q]` with vocabulary chunk j: step k
    broadcasts the table's row k down each grid column and reduces the partial logits of
    vocabulary chunk k to grid column k. Backward: step k broadcasts the logits' gradient of
    column k along the row and the table's row k again (the input gradient needs no
    reduction) and reduces the table gradient to row k. Per micro-batch of B tokens a rank
    sends (q-1)/q^2 (2 B V/d + 3 V h) elements."""

    @staticmethod
    def forward(ctx, x, weight, grid: Grid):
        ctx.save_for_backward(x, weight)
        ctx.grid = grid
        return _owned(_reduced(F.linear(x, _shared(weight, grid.row, k)), grid.col, k)
                      for k in range(grid.q))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grid = ctx.grid
        grad_x, grad_weight = torch.zeros_like(x), None
        flat_x = x.reshape(-1, x.shape[-1])
        for k in range(grid.q):
            grad_k = _shared(grad, grid.col, k)  # d logits of vocabulary chunk k
            grad_x += grad_k @ _shared(weight, grid.row, k)
            part = _reduced(grad_k.reshape(-1, grad_k.shape[-1]).T @ flat_x, grid.row, k)
            grad_weight = part if part is not None else grad_weight
        return grad_x, grad_weight, None


class SummaLinear(nn.Module):
    """A linear layer on the grid: `[b/(dq), s, in/q]` -> `[b/(dq), s, out/q]`. The weight
    holds out chunk j (of each of `blocks` equal blocks: q, k and v of a fused projection keep
    their heads together) and in chunk i; the bias out chunk j, added after the product, so
    its gradient is partial over tp_row and depth; the weight's over depth."""

    def __init__(self, dense: nn.Linear, mesh: ParallelMesh, *, blocks: int = 1):
        super().__init__()
        q = mesh.tp_grid[ROW]
        out_f, in_f = dense.weight.shape
        check_split(mesh, "output features (per block)", out_f, blocks * q)
        check_split(mesh, "input features", in_f, q)
        self.mesh, self.grid = mesh, Grid.of(mesh)
        self.in_features, self.out_features = in_f, out_f
        cols = Shard(0, out_f, out_f, blocks, axes=(COL,))
        self.shards = {"weight": (cols, Shard(1, in_f, in_f, axes=(ROW,)))}
        self.partial_axes = {"weight": depth_axes(mesh)}
        if dense.bias is None:
            self.register_parameter("bias", None)
        else:
            self.shards["bias"] = cols
            self.partial_axes["bias"] = (ROW, *depth_axes(mesh))
        adopt_slices(self, dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _SummaMatmul.apply(x, self.weight, self.grid)
        return y if self.bias is None else y + self.bias


class SummaLinearGroup(nn.Module):
    """`SummaLinear` layers of one input; returns each layer's output (one SUMMA each), every
    layer keeping its parameters and splits under its own name."""

    def __init__(self, **layers: SummaLinear):
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(layer(x) for layer in self.children())


class SummaVocabEmbedding(nn.Module):
    """The `[V, h]` token table with the vocabulary (zero-padded to a multiple of q) split over
    tp_row and the hidden size over tp_col, the same on every depth layer. Each rank looks up
    its vocabulary rows for its depth layer's share of the micro-batch and the partial
    embeddings are reduce-scattered along the batch over tp_row into the hidden layout.
    `logits(hidden)` uses it as the output layer (`_SummaLogits`)."""

    def __init__(self, dense: nn.Module, mesh: ParallelMesh):
        super().__init__()
        grid = Grid.of(mesh)
        self.num_embeddings, self.embedding_dim = dense.weight.shape
        check_split(mesh, "hidden size", self.embedding_dim, grid.q)
        padded = -(-self.num_embeddings // grid.q) * grid.q
        self.mesh, self.grid, self.num_local = mesh, grid, padded // grid.q
        self.shards = {"weight": (Shard(0, self.num_embeddings, padded, axes=(ROW,)),
                                  Shard(1, self.embedding_dim, self.embedding_dim,
                                        axes=(COL,)))}
        self.partial_axes = {"weight": depth_axes(mesh)}
        adopt_slices(self, dense)
        self.depth = mesh.axis(DEPTH) if DEPTH in mesh.tp_grid else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[b, s]` (the whole micro-batch) -> `[b/(dq), s, h/q]`."""
        if self.depth is not None:
            ids = ids.chunk(self.depth.size)[self.depth.rank]
        out = partial_lookup(ids, self.weight, self.grid.row.rank * self.num_local)
        # [b/d, s, h/q], partial over i
        return reduce_scatter_batch(out, self.grid.row)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states -> logits `[b/(dq), s, V_padded/q]` (vocabulary chunk j); padded
        vocabulary entries are -inf, so they take no probability and no gradient."""
        logits = _SummaLogits.apply(hidden, self.weight, self.grid)
        return mask_padding(logits, self.num_embeddings, self.grid.col.rank * self.num_local)


class SummaVocabHead(TiedAsHead, SummaVocabEmbedding):
    """An untied output layer, from a dense `nn.Linear(h, V, bias=False)`, split as the token
    table is."""
