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

import torch
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.models.blocks import RMSNorm
from meshtrain.parallel import comm
from meshtrain.parallel.attention import AttentionCore
from meshtrain.parallel.batch_split import gather_batch, partial_gradients_by_axis
from meshtrain.parallel.cube_layers import (
    INPUT,
    OUTPUT,
    WEIGHT,
    CubeLinear,
    CubeLinearGroup,
    CubePositionEmbedding,
    CubeVocabEmbedding,
    CubeVocabHead,
)
from meshtrain.parallel.factory import LayerFactory
from meshtrain.parallel.loss import vocab_parallel_cross_entropy
from meshtrain.parallel.split_norms import SplitLayerNorm, SplitRMSNorm
from meshtrain.random import TENSOR_PARALLEL


class Cube3D(LayerFactory):
    """The 3D scheme over the mesh's (tp_input, tp_weight, tp_output) grid; the plan gives the
    attention core's options and recomputation."""

    def __init__(self, plan, mesh: ParallelMesh):
        if mesh.tp_scheme != "3d":
            raise ValueError(f"`tp_scheme` 3d needs a mesh with a q x q x q TP grid, this one is"
                             f" {mesh.tp_scheme}: build the mesh with `tp_scheme` 3d")
        self.mesh = mesh
        self.q = mesh.tp_grid[INPUT]
        self.cp_mode = plan.cp_mode
        self.recompute, self.recompute_layers = plan.recompute, plan.recompute_layers

    def column(self, dense: nn.Linear, *, blocks: int = 1, heads: int | None = None) -> nn.Module:
        if heads is not None and heads % self.q:
            raise ValueError(f"`tp_scheme` 3d splits attention heads q = {self.q} ways: {heads}"
                             " heads are not divisible; change the model or `tp`")
        return CubeLinear(dense, self.mesh, input_axis=INPUT, output_axis=OUTPUT, blocks=blocks)

    def column_group(self, **layers: nn.Module) -> nn.Module:
        return CubeLinearGroup(**layers)

    def row(self, dense: nn.Linear) -> nn.Module:
        return CubeLinear(dense, self.mesh, input_axis=OUTPUT, output_axis=INPUT)

    def vocab_embedding(self, dense: nn.Embedding) -> nn.Module:
        return CubeVocabEmbedding(dense, self.mesh)

    def vocab_head(self, dense: nn.Linear) -> nn.Module:
        return CubeVocabHead(dense, self.mesh)

    def position_embedding(self, dense: nn.Embedding) -> nn.Module:
        return CubePositionEmbedding(dense, self.mesh)

    @property
    def head_parts(self) -> int:
        return self.q

    def norm(self, dense: nn.Module) -> nn.Module:
        options = dict(hidden_axis=OUTPUT, partial=(INPUT, WEIGHT))
        if isinstance(dense, nn.LayerNorm):
            return SplitLayerNorm(dense, self.mesh, **options)
        if isinstance(dense, RMSNorm):
            return SplitRMSNorm(dense, self.mesh, **options)
        raise ValueError(f"`tp_scheme` 3d splits LayerNorm and RMSNorm, not"
                         f" {type(dense).__name__}: use `tp_scheme` 1d")

    def attention_core(self, *, dropout: float, eager: bool) -> nn.Module:
        return AttentionCore(dropout=dropout, eager=eager, cp_axis=self.mesh.cp,
                             cp_mode=self.cp_mode, recompute=self.recompute == "selective")

    def recompute_layer(self, index: int) -> bool:
        limit = self.recompute_layers
        return self.recompute == "full" and (limit is None or index < limit)

    def _batch_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk (w, o) of the whole micro-batch: the logits' batch chunk."""
        w, o = self.mesh.axis(WEIGHT).rank, self.mesh.axis(OUTPUT).rank
        return x.chunk(self.q * self.q)[w * self.q + o]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int) -> torch.Tensor:
        """Per-token losses `[b, s]` of the whole micro-batch, equal on every rank; backward
        keeps this rank's chunk's gradient."""
        mine = vocab_parallel_cross_entropy(logits, self._batch_chunk(targets),
                                            mesh=self.mesh.axis(INPUT), ignore_index=ignore_index)
        return gather_batch(gather_batch(mine, self.mesh.axis(OUTPUT)), self.mesh.axis(WEIGHT))

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        full = comm.all_gather(logits, self.mesh.axis(INPUT), dim=-1)  # [b/q^2, s, V_padded]
        full = comm.all_gather(full, self.mesh.axis(OUTPUT), dim=0)
        return comm.all_gather(full, self.mesh.axis(WEIGHT), dim=0)

    def hidden_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions  # batch and hidden are split, never the sequence

    @property
    def hidden_stream(self) -> str:
        return TENSOR_PARALLEL  # each rank holds different tokens and features

    @property
    def splits_sequence(self) -> bool:
        return False

    def hidden_shape(self, batch: int, tokens: int, hidden: int) -> tuple[int, ...]:
        return (batch // (self.q * self.q), tokens, hidden // self.q)

    def partial_gradients(self, model: nn.Module,
                          exclude: set[int]) -> list[tuple[MeshAxis, list[nn.Parameter]]]:
        """What the layers name in `partial_axes`: the linears' biases (over tp_weight and
        their output axis), the norms and the position table (over tp_input and tp_weight)."""
        return partial_gradients_by_axis(model, self.mesh, exclude)
