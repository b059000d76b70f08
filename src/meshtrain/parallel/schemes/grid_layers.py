"""What the grid schemes' (2D, 2.5D, 3D) layers share: they are built from the dense layer they
replace by slicing its parameters, say which gradients are partial sums over which grid axes,
and split a learned position table along the hidden size. (Their hidden states are split over
the batch: `regions.reduce_scatter_batch` and `gather_batch` move them.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.layers.sharding import Shard, shard_tensor


def check_split(mesh: ParallelMesh, what: str, size: int, parts: int) -> None:
    """Refuse a dimension the scheme cannot split `parts` ways."""
    if size % parts:
        raise SettingError(Code.GRID_SHAPE,
                           f"`tp_scheme` {mesh.tp_scheme} splits the {what} {parts} ways: {size}"
                           " is not divisible; change the model size or `tp`")


def adopt_slices(module: nn.Module, dense: nn.Module) -> None:
    """Give `module` this rank's slice of each of `dense`'s parameters it has a split for
    (`module.shards`, relative to `module.mesh`)."""
    for name, spec in module.shards.items():
        full = getattr(dense, name).detach()
        module.register_parameter(name, nn.Parameter(shard_tensor(full, spec, module.mesh)))


def partial_gradients_by_axis(model: nn.Module, mesh, exclude: set[int]
                              ) -> list[tuple[MeshAxis, list[nn.Parameter]]]:
    """The parameters each layer names in its `partial_axes` (name -> grid axes its gradient
    is summed over), grouped by axis, in the order the axes first appear."""
    groups: dict[str, list[nn.Parameter]] = {}
    for module in model.modules():
        for name, axes in getattr(module, "partial_axes", {}).items():
            param = getattr(module, name)
            if id(param) not in exclude:
                for axis in axes:
                    groups.setdefault(axis, []).append(param)
    return [(mesh.axis(axis), params) for axis, params in groups.items()]


class SplitPositionEmbedding(nn.Module):
    """A learned position table `[S, h]` holding this rank's chunk of the hidden size (over
    `hidden_axis`): positions -> `[s, h/q]`, added to every batch chunk, so its gradient is
    partial over the `partial` axes."""

    def __init__(self, dense: nn.Embedding, mesh: ParallelMesh, *, hidden_axis: str,
                 partial: tuple[str, ...]):
        super().__init__()
        hidden = dense.weight.shape[1]
        check_split(mesh, "hidden size", hidden, mesh.tp_grid[hidden_axis])
        self.mesh = mesh
        self.shards = {"weight": Shard(1, hidden, hidden, axes=(hidden_axis,))}
        self.partial_axes = {"weight": partial}
        adopt_slices(self, dense)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions, self.weight)
