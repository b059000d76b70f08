"""The layers of 3D tensor parallelism (Bian et al. 2021, arXiv 2105.14450) on a q x q x q grid
of axes (tp_input, tp_weight, tp_output) = (a, w, o); `cube.Cube3D` builds models from them.

Hidden states are split over all three axes: `[b/q^2, s, h/q]` holds batch chunk w q + a and
hidden chunk o. A linear layer has an input axis I and an output axis O (tp_input and tp_output
for the forward linear, swapped for the one after attention or the MLP); its `[out, in]` weight
holds out chunk I and in chunk (O, w): 1/q^3 of the matrix, nothing replicated. It all-gathers
its input over I (batch chunk w, features chunk O), its weight over tp_weight (in chunk O), and
reduce-scatters the partial product over O along the batch: the output holds batch chunk
(w, O) and features chunk I. Backward saves only the local shards and gathers them again, so
activations stay 1/q^3 of the dense layer's.

Each layer is built from the dense layer it replaces and records its splits in `shards`; the
parameters whose gradient is a partial sum (biases, positions) name the grid axes to sum it over
in `partial_axes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.communication.regions import reduce_scatter_batch
from meshtrain.parallel.layers.sharding import GridPosition, Shard
from meshtrain.parallel.layers.vocab import TiedAsHead, mask_padding, partial_lookup
from meshtrain.parallel.schemes.grid_layers import adopt_slices, check_split

INPUT, WEIGHT, OUTPUT = "tp_input", "tp_weight", "tp_output"


@dataclass(frozen=True)
class Roles:
    """The mesh axes a 3D linear gathers its input over, its weight over, and sums over."""

    input: MeshAxis
    weight: MeshAxis
    output: MeshAxis

    @classmethod
    def of(cls, mesh: ParallelMesh, input_axis: str, output_axis: str) -> Roles:
        return cls(mesh.axis(input_axis), mesh.axis(WEIGHT), mesh.axis(output_axis))


def _gathered(weights, axis: MeshAxis, dim: int) -> torch.Tensor:
    """The weights each all-gathered over `axis` along `dim`, stacked along the output."""
    whole = [comm.all_gather(w, axis, dim=dim) for w in weights]
    return whole[0] if len(whole) == 1 else torch.cat(whole)


class _CubeMatmul(torch.autograd.Function):
    """x W^T of one or more weights applied to the same input (joined along the output), with
    the communication of a 3D linear (module docstring). The weights' local shards are gathered
    over tp_weight along `weight_dim` (1: in features; 0: the vocabulary of the output layer).

    Per call, with B the micro-batch's tokens: forward moves (q-1)/q^3 (B in + B out + in out)
    elements per rank, backward twice the input and weight terms and once the output term."""

    @staticmethod
    def forward(ctx, x, roles: Roles, weight_dim: int, *weights):
        ctx.save_for_backward(x, *weights)
        ctx.roles, ctx.weight_dim = roles, weight_dim
        partial = F.linear(comm.all_gather(x, roles.input, dim=0),
                           _gathered(weights, roles.weight, weight_dim))
        return comm.reduce_scatter(partial, roles.output, dim=0)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        roles, dim = ctx.roles, ctx.weight_dim
        grad = comm.all_gather(grad, roles.output, dim=0)  # [b/q, s, out/q]
        x = comm.all_gather(x, roles.input, dim=0)  # [b/q, s, in/q]
        grad_x = None
        if ctx.needs_input_grad[0]:
            whole = _gathered(weights, roles.weight, dim)
            grad_x = comm.reduce_scatter(grad @ whole, roles.input, dim=0)
        grad_whole = grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        rows = [w.shape[0] * (roles.weight.size if dim == 0 else 1) for w in weights]
        grads = [comm.reduce_scatter(g, roles.weight, dim=dim) for g in grad_whole.split(rows)]
        return grad_x, None, None, *grads


def cube_matmul(x: torch.Tensor, roles: Roles, weights: list[torch.Tensor], *,
                weight_dim: int = 1) -> torch.Tensor:
    """The joined output of `weights` on the local input `x` (see `_CubeMatmul`)."""
    return _CubeMatmul.apply(x, roles, weight_dim, *weights)


class CubeLinear(nn.Module):
    """A linear layer on the 3D grid with input axis `input_axis` and output axis
    `output_axis` (module docstring). The weight holds out chunk I (of each of `blocks` equal
    blocks: q, k and v of a fused projection keep their heads together) and in chunk (O, w); the
    bias out chunk I, added after the reduce-scatter, so its gradient is partial over tp_weight
    and O."""

    def __init__(self, dense: nn.Linear, mesh: ParallelMesh, *, input_axis: str,
                 output_axis: str, blocks: int = 1):
        super().__init__()
        q = mesh.tp_grid[INPUT]
        out_f, in_f = dense.weight.shape
        check_split(mesh, "output features (per block)", out_f, blocks * q)
        check_split(mesh, "input features", in_f, q * q)
        self.mesh, self.roles = mesh, Roles.of(mesh, input_axis, output_axis)
        rows = Shard(0, out_f, out_f, blocks, axes=(input_axis,))
        self.shards = {"weight": (rows, Shard(1, in_f, in_f, axes=(output_axis, WEIGHT)))}
        self.partial_axes = {}
        if dense.bias is None:
            self.register_parameter("bias", None)
        else:
            self.shards["bias"] = rows
            self.partial_axes["bias"] = (WEIGHT, output_axis)
        adopt_slices(self, dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`[b/q^2 (w, I), s, in/q (O)]` -> `[b/q^2 (w, O), s, out/q (I)]`."""
        y = cube_matmul(x, self.roles, [self.weight])
        return y if self.bias is None else y + self.bias


class CubeLinearGroup(nn.Module):
    """`CubeLinear` layers of one input computed as one: a single gather of the input, one
    matmul and one reduce-scatter of the joined outputs; returns each layer's output. Every
    layer keeps its parameters and splits under its own name."""

    def __init__(self, **layers: CubeLinear):
        super().__init__()
        roles = {layer.roles for layer in layers.values()}
        if len(roles) != 1:
            raise ValueError("CubeLinearGroup joins layers of the same input and output axes")
        for name, layer in layers.items():
            self.add_module(name, layer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layers = list(self.children())
        y = cube_matmul(x, layers[0].roles, [layer.weight for layer in layers])
        outputs = y.split([layer.weight.shape[0] for layer in layers], dim=-1)
        return tuple(out if layer.bias is None else out + layer.bias
                     for out, layer in zip(outputs, layers, strict=True))


class CubeVocabEmbedding(nn.Module):
    """The `[V, h]` token table with the vocabulary (zero-padded to a multiple of q^2) split
    over (tp_input, tp_weight) and the hidden size over tp_output: `[V/q^2 (a q + w), h/q
    (o)]`, 1/q^3 of the table. Every rank looks up its rows for the whole micro-batch and the
    partial embeddings are reduce-scattered along the batch, over tp_weight then tp_input, into
    the hidden layout. `logits(hidden)` uses it as the output layer."""

    def __init__(self, dense: nn.Module, mesh: ParallelMesh):
        super().__init__()
        q = mesh.tp_grid[INPUT]
        weight = dense.weight
        self.num_embeddings, self.embedding_dim = weight.shape
        check_split(mesh, "hidden size", self.embedding_dim, q)
        padded = -(-self.num_embeddings // (q * q)) * q * q
        self.mesh, self.roles = mesh, Roles.of(mesh, INPUT, OUTPUT)
        rows = Shard(0, self.num_embeddings, padded, axes=(INPUT, WEIGHT))
        self.shards = {"weight": (rows, Shard(1, self.embedding_dim, self.embedding_dim,
                                              axes=(OUTPUT,)))}
        adopt_slices(self, dense)
        self.num_local = padded // (q * q)
        self.vocab_start = rows.chunk(GridPosition.of(mesh))[0] * self.num_local

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids `[b, s]` (the whole micro-batch) -> `[b/q^2 (w, a), s, h/q (o)]`."""
        out = partial_lookup(ids, self.weight, self.vocab_start)  # [b, s, h/q], partial
        for axis in (self.roles.weight, self.roles.input):
            out = reduce_scatter_batch(out, axis)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states -> logits `[b/q^2 (w, o), s, V_padded/q (a)]` (the weight gathered
        over tp_weight along the vocabulary); padded vocabulary entries are -inf, so they take
        no probability and no gradient."""
        logits = cube_matmul(hidden, self.roles, [self.weight], weight_dim=0)
        return mask_padding(logits, self.num_embeddings,
                            self.roles.input.rank * logits.shape[-1])


class CubeVocabHead(TiedAsHead, CubeVocabEmbedding):
    """An untied output layer, from a dense `nn.Linear(h, V, bias=False)`, split as the token
    table is."""
