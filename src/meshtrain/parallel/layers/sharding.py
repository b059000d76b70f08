"""How a parameter is split over the tensor-parallel block, and moving between its full (logical)
form and the slice a rank holds.

Checkpoints, gradient-norm clipping and tests read this metadata; layers record it in their
`shards` dict. A parameter with no `Shard` is replicated on every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm


@dataclass(frozen=True)
class Shard:
    """How a parameter is split along one dimension over the TP block.

    The full tensor's `dim` is made of `num_blocks` equal blocks (q, k and v of a fused QKV
    weight), each split evenly into chunks; this rank holds its chunk of every block,
    concatenated. The chunk is numbered by this rank's coordinates on the TP grid `axes` (major
    first; 1D: the `tp` axis). `replicas` (1D only) consecutive TP ranks hold the same chunk
    (the key/value heads of grouped-query attention when tp exceeds their number).
    `full_size` is the logical (unpadded) extent of `dim`; `padded_size` the extent held over
    all ranks (the vocabulary is padded to a multiple of tp). A parameter split along several
    dimensions (2D/3D schemes) has a tuple of Shards, one per dimension; on grid axes none of
    them names, it is replicated.
    """

    dim: int
    full_size: int
    padded_size: int
    num_blocks: int = 1
    replicas: int = 1
    axes: tuple[str, ...] = ("tp",)

    def chunk(self, where: GridPosition) -> tuple[int, int]:
        """(this rank's chunk index, number of chunks) of each block."""
        index, parts = 0, 1
        for name in self.axes:
            index, parts = index * where.sizes[name] + where.coords[name], parts * where.sizes[name]
        return index // self.replicas, parts // self.replicas

    def parts(self, where: GridPosition) -> int:
        return self.chunk(where)[1]


ShardSpec = Shard | tuple[Shard, ...]


def splits(spec: ShardSpec | None) -> tuple[Shard, ...]:
    """The per-dimension splits of a parameter (none: replicated)."""
    if spec is None:
        return ()
    return spec if isinstance(spec, tuple) else (spec,)


@dataclass(frozen=True)
class GridPosition:
    """Where a rank sits in its TP block: the grid's axis sizes and this rank's coordinates."""

    sizes: dict[str, int]
    coords: dict[str, int]

    @classmethod
    def of(cls, where: ParallelMesh | MeshAxis, tp_rank: int | None = None) -> GridPosition:
        """From a mesh (any scheme) or, for 1D layers, the TP axis itself."""
        if isinstance(where, MeshAxis):
            return cls({"tp": where.size}, {"tp": where.rank if tp_rank is None else tp_rank})
        return cls(where.tp_grid, where.tp_coords(tp_rank))


def is_primary(spec: ShardSpec | None, where: GridPosition) -> bool:
    """Whether this TP rank holds the copy that counts: checkpoints write it and the gradient
    norm counts it (on every grid axis no split names: coordinate 0; a 1D shard: the first of
    its replicas)."""
    named = {name for split in splits(spec) for name in split.axes}
    replicas = max((split.replicas for split in splits(spec)), default=1)
    for name, coord in where.coords.items():
        if coord % replicas if name in named else coord:
            return False
    return True


def dim_pieces(split: Shard, where: GridPosition) -> list[tuple[int, int, int]]:
    """(local offset, padded global offset, length) along `split.dim` of each block's chunk."""
    index, parts = split.chunk(where)
    block = split.padded_size // split.num_blocks
    chunk = block // parts
    return [(b * chunk, b * block + index * chunk, chunk) for b in range(split.num_blocks)]


def _padded(full: torch.Tensor, split: Shard) -> torch.Tensor:
    if split.padded_size == split.full_size:
        return full
    pad_shape = list(full.shape)
    pad_shape[split.dim] = split.padded_size - split.full_size
    return torch.cat([full, full.new_zeros(pad_shape)], dim=split.dim)


def shard_tensor(full: torch.Tensor, spec: ShardSpec,
                 where: ParallelMesh | MeshAxis) -> torch.Tensor:
    """This rank's slice of the logical tensor `full` (zero-padding it first when needed)."""
    position = GridPosition.of(where)
    for split in splits(spec):
        full = torch.cat([_padded(full, split).narrow(split.dim, start, length)
                          for _, start, length in dim_pieces(split, position)], dim=split.dim)
    return full.contiguous()


def unshard_tensor(local: torch.Tensor, spec: ShardSpec,
                   where: ParallelMesh | MeshAxis) -> torch.Tensor:
    """Gather every rank's slice back into the logical tensor (a collective over the TP block:
    `where` is the mesh, or the TP axis of a 1D layer)."""
    axis = where if isinstance(where, MeshAxis) else where.tp
    with torch.no_grad():
        gathered = comm.all_gather(local.detach().unsqueeze(0), axis, dim=0)
    shape = list(local.shape)
    for split in splits(spec):
        shape[split.dim] = split.padded_size
    full = local.new_zeros(shape)
    for tp_rank, piece in enumerate(gathered):
        position = GridPosition.of(where, tp_rank)
        if is_primary(spec, position):
            _place(full, piece, spec, position)
    for split in splits(spec):
        full = full.narrow(split.dim, 0, split.full_size)
    return full.contiguous()


def gather_split(local: torch.Tensor, split: Shard, mesh: ParallelMesh) -> torch.Tensor:
    """Undo one split of a tensor (one block, no replicas): all-gather along its dimension over
    its grid axes, the minor axis first, so the chunks come back in order. A collective over
    those axes only: what remains is split by the tensor's other splits alone."""
    if split.num_blocks != 1 or split.replicas != 1:
        raise ValueError("gather_split undoes a split of one block without replicas")
    with torch.no_grad():
        for name in reversed(split.axes):
            local = comm.all_gather(local.detach(), mesh.axis(name), dim=split.dim)
    return local.narrow(split.dim, 0, split.full_size)


def _place(full: torch.Tensor, local: torch.Tensor, spec: ShardSpec,
           position: GridPosition) -> None:
    """Copy `local`'s pieces into their places in the padded `full` (every split dimension)."""
    boxes = [((), ())]
    for split in splits(spec):
        boxes = [(src + ((split.dim, lo, n),), dst + ((split.dim, go, n),))
                 for src, dst in boxes for lo, go, n in dim_pieces(split, position)]
    for src, dst in boxes:
        target, source = full, local
        for (dim, go, n), (_, lo, _) in zip(dst, src, strict=True):
            target, source = target.narrow(dim, go, n), source.narrow(dim, lo, n)
        target.copy_(source)


def shard_pieces(split: Shard, where: GridPosition) -> list[tuple[int, int, int]]:
    """(local offset, global offset, length) along `split.dim` of each contiguous piece this
    rank holds of the logical tensor; padding beyond `full_size` is left out."""
    pieces = []
    for local, start, length in dim_pieces(split, where):
        length = min(length, split.full_size - start)
        if length > 0:
            pieces.append((local, start, length))
    return pieces


def tensor_parallel_home(module: nn.Module) -> ParallelMesh | MeshAxis:
    """What a sharded module's `shards` are relative to: its mesh (grid schemes) or its TP
    axis (1D layers, which may be built from an axis alone)."""
    return getattr(module, "tp_axis", None) or module.mesh


def _sharded_modules(model: nn.Module):
    """(module name, module, its shards) for every module that describes how it is split."""
    for name, module in model.named_modules():
        shards = getattr(module, "shards", None)
        if isinstance(shards, dict):
            yield name, module, shards


def parameter_shards(model: nn.Module) -> dict[str, ShardSpec | None]:
    """Every parameter's name and how it is split over TP (None: replicated)."""
    split = {f"{module_name}.{name}" if module_name else name: shard
             for module_name, _, shards in _sharded_modules(model)
             for name, shard in shards.items()}
    return {name: split.get(name) for name, _ in model.named_parameters()}


def tensor_parallel_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters split over TP (the rest are replicated across TP ranks)."""
    return {id(getattr(module, name)) for _, module, shards in _sharded_modules(model)
            for name in shards}


def primary_parameters(model: nn.Module, mesh: ParallelMesh) -> set[int]:
    """ids of the parameters whose copy on this TP rank counts (see `is_primary`)."""
    shards, position = parameter_shards(model), GridPosition.of(mesh)
    return {id(p) for name, p in model.named_parameters() if is_primary(shards[name], position)}


def named_full_tensors(model: nn.Module, *, grads: bool = False):
    """Yield `(name, full tensor)` for every parameter (or its gradient), TP shards gathered.

    A collective over TP for every sharded parameter: call it on all TP ranks together.
    """
    for module_name, module in model.named_modules():
        shards = getattr(module, "shards", None) or {}
        for name, param in module.named_parameters(recurse=False):
            tensor = param.grad if grads else param
            if tensor is None:
                continue
            full_name = f"{module_name}.{name}" if module_name else name
            if name in shards:
                tensor = unshard_tensor(tensor, shards[name], tensor_parallel_home(module))
            yield full_name, tensor.detach()
