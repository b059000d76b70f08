"""What the grid schemes (2D/2.5D `summa.py`, 3D `cube.py`) share, as schemes (`GridScheme`) and
as layer factories (`GridFactory`).

Their hidden states are split over the batch and the hidden size inside the TP block, never
over the sequence, and each rank holds different elements. A scheme names its grid axes by
role: the axis splitting the hidden size (norms and positions), the axis splitting the
vocabulary of its logits, and the axes splitting the logits' batch (innermost first); the loss,
the gathered logits and the norms follow from them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.parallel.communication.regions import gather_batch
from meshtrain.parallel.layers.loss import vocab_parallel_cross_entropy
from meshtrain.parallel.layers.norms import RMSNorm, SplitLayerNorm, SplitRMSNorm
from meshtrain.parallel.layers.rng import TENSOR_PARALLEL
from meshtrain.parallel.schemes.factory import LayerFactory
from meshtrain.parallel.schemes.grid_layers import SplitPositionEmbedding, partial_gradients_by_axis
from meshtrain.parallel.schemes.scheme import Clock, TPScheme, Waits


class GridScheme(TPScheme):
    """A scheme whose TP block is a grid of side q: heads split q ways, hidden states split
    over batch and hidden size, nothing replicated outside the layers; sequence and context
    parallelism and experts are not supported (routing and the sequence splits assume whole
    tokens of the hidden size on a rank), nor `tp_overlap` (it overlaps sequence-parallel
    communication), a split backward, `compile` or `fp8` (1d layers only)."""

    supports = frozenset({"tp", "pp", "dropout", "half", "fp64", "zero", "zero_gradients",
                          "zero_parameters", "offload", "hybrid", "virtual_stages",
                          "two_weight_versions"})

    def input_width_parts(self, grid: dict[str, int]) -> int:
        """How many ways a weight's input features are split."""
        return self.head_parts(grid)

    def check_shapes(self, plan, model, grid: dict[str, int]) -> None:
        q, width = self.head_parts(grid), self.input_width_parts(grid)
        for what, size, need in (("hidden size", model.hidden_size, width),
                                 ("MLP width", model.ffn_size, width),
                                 ("number of heads", model.num_heads, q),
                                 ("number of key/value heads", model.kv_heads, q)):
            if size % need:
                raise SettingError(Code.GRID_SHAPE, (
                    f"the {what} ({size}) must be divisible by {need} for `tp_scheme`"
                    f" {self.name} with `tp` {plan.tp}: change the model or the tp"))
        parts = self.batch_parts(grid)
        if plan.micro_batch % parts:
            raise SettingError(Code.GRID_BATCH_SPLIT, (
                f"`micro_batch` {plan.micro_batch} must be divisible by {parts}: `tp_scheme`"
                f" {self.name} with grid {'x'.join(map(str, grid.values()))} splits each"
                f" micro-batch {parts} ways; raise `micro_batch`"))

    def hidden_parts(self, plan) -> int:
        return plan.tp

    def hidden_size_parts(self, grid: dict[str, int]) -> int:
        return math.prod(grid.values()) // self.batch_parts(grid)

    def layer_saved_bytes(self, plan, model, **shape) -> float:
        """The dense layer's / tp: nothing is replicated."""
        return model.activation_bytes(tp=1, sequence_parallel=plan.sequence_parallel,
                                      **shape) / plan.tp

    def layer_comm(self, plan, model, tokens: int, e: int, clock: Clock, *,
                   weights: Sequence[float], split: bool) -> Waits:
        """The layer's traffic (`layer_traffic`), none of it hidden."""
        return Waits(*clock.traffic(self.layer_traffic(model, plan.tp_grid, tokens, e)))

    def embedding_comm(self, plan, model, tokens: int, e: int,
                       clock: Clock) -> tuple[float, float]:
        """Each rank writes its block (the lookup's small communication is left out)."""
        return tokens * model.hidden_size * e / plan.tp, 0.0

    def output_comm(self, plan, model, tokens: int, e: int,
                    clock: Clock) -> tuple[float, Waits]:
        """The output layer's traffic (`output_traffic`; the loss statistics left out)."""
        traffic = self.output_traffic(plan.tp_grid, tokens, model.hidden_size,
                                      model.vocab_size, e)
        return tokens * model.hidden_size * e / plan.tp, Waits(*clock.traffic(traffic))


class GridFactory(LayerFactory):
    """A scheme on a TP grid of side `q`. Subclasses set `hidden_axis`, `vocab_axis`,
    `logits_batch_axes` (innermost first) and `replicated_axes` (the grid axes a hidden-size
    slice is repeated on: what norm and position gradients are summed over), and say how many
    ways the hidden states' batch is split (`batch_parts`)."""

    hidden_axis: str
    vocab_axis: str
    logits_batch_axes: tuple[str, ...]
    replicated_axes: tuple[str, ...]
    batch_parts: int

    def __init__(self, plan, mesh: ParallelMesh, *, q: int):
        super().__init__(plan, mesh)
        self.q = q

    @property
    def head_parts(self) -> int:
        return self.q

    def norm(self, dense: nn.Module) -> nn.Module:
        options = dict(hidden_axis=self.hidden_axis, partial=self.replicated_axes)
        if isinstance(dense, nn.LayerNorm):
            return SplitLayerNorm(dense, self.mesh, **options)
        if isinstance(dense, RMSNorm):
            return SplitRMSNorm(dense, self.mesh, **options)
        raise SettingError(Code.MODEL_UNSUPPORTED, (
            f"`tp_scheme` {self.mesh.tp_scheme} splits LayerNorm and RMSNorm, not"
            f" {type(dense).__name__}: use `tp_scheme` 1d"))

    def position_embedding(self, dense: nn.Embedding) -> nn.Module:
        return SplitPositionEmbedding(dense, self.mesh, hidden_axis=self.hidden_axis,
                                      partial=self.replicated_axes)

    def _batch_axes(self) -> list[MeshAxis]:
        return [self.mesh.axis(name) for name in self.logits_batch_axes]

    def _logits_batch_chunk(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of the whole micro-batch as its logits hold it."""
        index, parts = 0, 1
        for axis in reversed(self._batch_axes()):  # outermost first
            index, parts = index * axis.size + axis.rank, parts * axis.size
        return x.chunk(parts)[index]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int) -> torch.Tensor:
        """Per-token losses `[b, s]` of the whole micro-batch, equal on every rank: the
        vocab-parallel cross-entropy of this rank's batch chunk, its per-token losses gathered
        (backward keeps this rank's chunk's gradient)."""
        losses = vocab_parallel_cross_entropy(logits, self._logits_batch_chunk(targets),
                                              mesh=self.mesh.axis(self.vocab_axis),
                                              ignore_index=ignore_index)
        for axis in self._batch_axes():
            losses = gather_batch(losses, axis)
        return losses

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        full = comm.all_gather(logits, self.mesh.axis(self.vocab_axis), dim=-1)
        for axis in self._batch_axes():
            full = comm.all_gather(full, axis, dim=0)
        return full  # [b, s, V_padded]

    def hidden_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions  # batch and hidden are split, never the sequence

    @property
    def hidden_stream(self) -> str:
        return TENSOR_PARALLEL  # each rank holds different tokens and features

    @property
    def splits_sequence(self) -> bool:
        return False

    @property
    def splits_batch(self) -> bool:
        return True

    def hidden_shape(self, batch: int, tokens: int, hidden: int) -> tuple[int, ...]:
        return (batch // self.batch_parts, tokens, hidden // self.q)

    def partial_gradients(self, model: nn.Module,
                          exclude: set[int]) -> list[tuple[MeshAxis, list[nn.Parameter]]]:
        """What the layers name in their `partial_axes`, grouped by axis."""
        return partial_gradients_by_axis(model, self.mesh, exclude)
