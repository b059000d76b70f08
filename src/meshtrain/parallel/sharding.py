"""How a parameter is split over the tensor-parallel axis, and moving between its full (logical)
form and the slice a rank holds.

Checkpoints, gradient-norm clipping and tests read this metadata; layers record it in their
`shards` dict. A parameter with no `Shard` is replicated on every TP rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshtrain.mesh import MeshAxis
from meshtrain.parallel import comm


@dataclass(frozen=True)
class Shard:
    """How a parameter is split over the TP axis.

    The full tensor's `dim` is made of `num_blocks` equal blocks (q, k and v of a fused QKV
    weight), each split evenly into tp / `replicas` chunks; this rank holds its chunk of every
    block, concatenated. `replicas` consecutive TP ranks hold the same chunk (the key/value heads
    of grouped-query attention when tp exceeds their number). `full_size` is the logical
    (unpadded) extent of `dim`; `padded_size` the extent held over all ranks (the vocabulary is
    padded to a multiple of tp).
    """

    dim: int
    full_size: int
    padded_size: int
    num_blocks: int = 1
    replicas: int = 1

    def parts(self, tp: int) -> int:
        """Distinct chunks of each block over `tp` ranks."""
        return tp // self.replicas


def is_primary(shard: Shard | None, tp_rank: int) -> bool:
    """Whether this TP rank holds the copy that counts: checkpoints write it and the gradient
    norm counts it (a replicated tensor on TP rank 0, a shard on the first of its replicas)."""
    if shard is None:
        return tp_rank == 0
    return tp_rank % shard.replicas == 0


def shard_tensor(full: torch.Tensor, shard: Shard, axis: MeshAxis) -> torch.Tensor:
    """This rank's slice of the logical tensor `full` (zero-padding it first when needed)."""
    if shard.padded_size > shard.full_size:
        pad_shape = list(full.shape)
        pad_shape[shard.dim] = shard.padded_size - shard.full_size
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=shard.dim)
    blocks = full.chunk(shard.num_blocks, dim=shard.dim)
    parts, index = shard.parts(axis.size), axis.rank // shard.replicas
    return torch.cat([b.chunk(parts, dim=shard.dim)[index] for b in blocks],
                     dim=shard.dim).contiguous()


def unshard_tensor(local: torch.Tensor, shard: Shard, axis: MeshAxis) -> torch.Tensor:
    """Gather every rank's slice back into the logical tensor (a collective over `axis`)."""
    with torch.no_grad():
        gathered = comm.all_gather(local.detach().movedim(shard.dim, 0), axis, dim=0)
    per_rank = gathered.chunk(axis.size, dim=0)[::shard.replicas]
    blocks = [torch.cat([r.chunk(shard.num_blocks, dim=0)[b] for r in per_rank], dim=0)
              for b in range(shard.num_blocks)]
    full = torch.cat(blocks, dim=0).movedim(0, shard.dim)
    return full.narrow(shard.dim, 0, shard.full_size).contiguous()


def shard_pieces(shard: Shard, tp_rank: int, tp_size: int) -> list[tuple[int, int, int]]:
    """(local offset, global offset, length) along `shard.dim` of each contiguous piece this
    rank holds of the logical tensor; padding beyond `full_size` is left out."""
    block = shard.padded_size // shard.num_blocks
    chunk = block // shard.parts(tp_size)
    pieces = []
    for b in range(shard.num_blocks):
        start = b * block + (tp_rank // shard.replicas) * chunk
        length = min(chunk, shard.full_size - start)
        if length > 0:
            pieces.append((b * chunk, start, length))
    return pieces


def _sharded_modules(model: nn.Module):
    """(module name, module, its shards) for every module that describes how it is split."""
    for name, module in model.named_modules():
        shards = getattr(module, "shards", None)
        if isinstance(shards, dict):
            yield name, module, shards


def parameter_shards(model: nn.Module) -> dict[str, Shard | None]:
    """Every parameter's name and how it is split over TP (None: replicated)."""
    split = {f"{module_name}.{name}" if module_name else name: shard
             for module_name, _, shards in _sharded_modules(model)
             for name, shard in shards.items()}
    return {name: split.get(name) for name, _ in model.named_parameters()}


def tensor_parallel_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters split over TP (the rest are replicated across TP ranks)."""
    return {id(getattr(module, name)) for _, module, shards in _sharded_modules(model)
            for name in shards}


def primary_parameters(model: nn.Module, tp_rank: int) -> set[int]:
    """ids of the parameters whose copy on this TP rank counts (see `is_primary`)."""
    shards = parameter_shards(model)
    return {id(p) for name, p in model.named_parameters() if is_primary(shards[name], tp_rank)}


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
                tensor = unshard_tensor(tensor, shards[name], module.tp_axis)
            yield full_name, tensor.detach()
