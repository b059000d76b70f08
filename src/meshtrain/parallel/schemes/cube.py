"""3D tensor parallelism (Bian et al. 2021, arXiv 2105.14450) as a `LayerFactory`.

The TP block is a q x q x q grid of axes (tp_input, tp_weight, tp_output) = (a, w, o); tp =
q^3. Every weight is split over all three axes (1/q^3 of it on a rank, none replicated), and so
are the hidden states between layers: `[b/q^2, s, h/q]`, batch chunk w q + a, hidden chunk o.
The linear layers (`cube_layers.py`) alternate between two roles: the forward linear (QKV, the
first MLP projection) reads the hidden layout and leaves batch chunk (w, o) with features
chunk a, which holds whole heads, so attention and the activation are local; the swapped linear
(attention output, second MLP projection) brings it back. Norms split the hidden size over
tp_output (`split_norms.py`). Per linear and micro-batch of B tokens, a rank sends
(q-1)/q^3 (3 B in + 2 B out + 3 in out) elements: every term falls as q grows.

The loss runs on the logits' batch chunk with the vocabulary split over tp_input; the per-token
losses are all-gathered over the batch, so every rank returns the whole micro-batch's.
"""

from __future__ import annotations

from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.schemes.cube_layers import (
    INPUT,
    OUTPUT,
    WEIGHT,
    CubeLinear,
    CubeLinearGroup,
    CubeVocabEmbedding,
    CubeVocabHead,
)
from meshtrain.parallel.schemes.grid import GridFactory, GridScheme
from meshtrain.parallel.schemes.scheme import Traffic, layer_linears


class Cube3D(GridFactory):
    """The 3D scheme over the mesh's (tp_input, tp_weight, tp_output) grid."""

    hidden_axis, vocab_axis = OUTPUT, INPUT
    logits_batch_axes = (OUTPUT, WEIGHT)  # the logits hold batch chunk w q + o
    replicated_axes = (INPUT, WEIGHT)

    def __init__(self, plan, mesh: ParallelMesh):
        if mesh.tp_scheme != "3d":
            raise SettingError(Code.MESH_SCHEME, (
                f"`tp_scheme` 3d needs a mesh with a q x q x q TP grid, this one is"
                f" {mesh.tp_scheme}: build the mesh with `tp_scheme` 3d"))
        super().__init__(plan, mesh, q=mesh.tp_grid[INPUT])
        self.batch_parts = self.q * self.q

    def column(self, dense: nn.Linear, *, blocks: int = 1, heads: int | None = None) -> nn.Module:
        if heads is not None and heads % self.q:
            raise SettingError(Code.GRID_SHAPE, (
                f"`tp_scheme` 3d splits attention heads q = {self.q} ways: {heads}"
                " heads are not divisible; change the model or `tp`"))
        return CubeLinear(dense, self.mesh, input_axis=INPUT, output_axis=OUTPUT, blocks=blocks)

    def column_group(self, **layers: nn.Module) -> nn.Module:
        return CubeLinearGroup(**layers)

    def row(self, dense: nn.Linear) -> nn.Module:
        return CubeLinear(dense, self.mesh, input_axis=OUTPUT, output_axis=INPUT)

    def vocab_embedding(self, dense: nn.Embedding) -> nn.Module:
        return CubeVocabEmbedding(dense, self.mesh)

    def vocab_head(self, dense: nn.Linear) -> nn.Module:
        return CubeVocabHead(dense, self.mesh)



def cube_linear(tokens: int, h_in: int, h_out: int, q: int, e: int) -> Traffic:
    """Gather input and weight, reduce-scatter the output; backward gathers input, weight and
    output gradient, and reduce-scatters the input and weight gradients:
    (q-1)/q^3 (B h_in + h_in h_out + B h_out) e forward,
    (q-1)/q^3 (2 B h_in + B h_out + 2 h_in h_out) e backward."""
    share = (q - 1) / q**3 * e
    forward = share * (tokens * h_in + h_in * h_out + tokens * h_out)
    backward = share * (2 * tokens * h_in + tokens * h_out + 2 * h_in * h_out)
    return Traffic(forward, backward, 3 * (q - 1), 5 * (q - 1))


class CubeScheme(GridScheme):
    """3d: a q x q x q grid (tp = q^3); weights split q^3 ways, their input features q^2."""

    name = "3d"
    axes = (INPUT, WEIGHT, OUTPUT)

    def grid(self, tp: int, depth: int | None = None) -> dict[str, int]:
        return dict.fromkeys(self.axes, self.side(tp, 3))

    def head_parts(self, grid: dict[str, int]) -> int:
        return grid[INPUT]

    def batch_parts(self, grid: dict[str, int]) -> int:
        return grid[WEIGHT] * grid[OUTPUT]

    def input_width_parts(self, grid: dict[str, int]) -> int:
        return grid[INPUT] ** 2

    def factory(self, plan, mesh: ParallelMesh) -> Cube3D:
        return Cube3D(plan, mesh)

    def layer_traffic(self, model, grid: dict[str, int], tokens: int, e: int) -> Traffic:
        total = Traffic()
        for h_in, h_out in layer_linears(model):
            total += cube_linear(tokens, h_in, h_out, grid[INPUT], e)
        return total

    def output_traffic(self, grid: dict[str, int], tokens: int, hidden: int, vocab: int,
                       e: int) -> Traffic:
        return cube_linear(tokens, hidden, vocab, grid[INPUT], e)


CUBE_3D = CubeScheme()
