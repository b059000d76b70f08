"""ZeRO's states in and out of checkpoints: full per-parameter values and Adam moments.

A checkpoint holds each parameter whole (this TP rank's part), so it loads at any sharding:
`export_states` gathers every bucket's master and moment shards over the sharding axis,
`load_states` cuts this rank's shard out of the full values. Both visit the buckets one at a
time through the states' store, so offloaded states are never all in memory.
"""

from __future__ import annotations

import torch

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.optim import ADAMW_MOMENTS, restored_step
from meshtrain.parallel.runtime.zero_bucket import Bucket
from meshtrain.parallel.runtime.zero_states import Pieces, StateStore

PerParam = dict[int, torch.Tensor]


@torch.no_grad()
def export_states(buckets: list[Bucket], pieces: dict[int, Pieces], store: StateStore,
                  axis: MeshAxis, optimizer: torch.optim.Optimizer, *,
                  stepped: bool) -> tuple[PerParam, dict[int, dict[str, torch.Tensor]] | None]:
    """Full fp32 value and Adam moments of every parameter, gathered over `axis` (transient;
    collective): ({id(p): value}, {id(p): {state: tensor}} or None before the first step).
    `stepped` must be the same on every rank (one that owns no piece has no optimizer state
    of its own)."""
    values: PerParam = {}
    states: dict[int, dict[str, torch.Tensor]] = {}
    for k, b in enumerate(buckets):
        with store.resident(k, b, pieces[id(b)], optimizer, dirty=False):
            full = _gather_full(b, b.master, axis)
            for p in b.params:
                values[id(p)] = b.param_view(full, p)
            for name in ADAMW_MOMENTS if stepped else ():
                shard = torch.zeros(b.shard_size, dtype=torch.float32, device=b.master.device)
                for piece, (_, a, n) in zip(pieces[id(b)], b.pieces, strict=True):
                    shard[a:a + n].copy_(optimizer.state[piece][name])
                full = _gather_full(b, shard, axis)
                for p in b.params:
                    states.setdefault(id(p), {})[name] = b.param_view(full, p)
    return values, states if stepped else None


def _gather_full(b: Bucket, shard: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    flat = torch.empty(b.padded, dtype=torch.float32, device=b.device)
    comm.all_gather_into(flat, shard.to(b.device, torch.float32), axis)
    if axis.size == 1:
        flat.copy_(shard)
    return flat


@torch.no_grad()
def load_states(buckets: list[Bucket], pieces: dict[int, Pieces], store: StateStore,
                optimizer: torch.optim.Optimizer, values: PerParam,
                states: dict[int, dict[str, torch.Tensor]] | None,
                step: torch.Tensor | None) -> None:
    """Take this rank's shard of full per-parameter values (and moments, with the step)."""
    for k, b in enumerate(buckets):
        with store.resident(k, b, pieces[id(b)], optimizer, dirty=True):
            _load_bucket(b, pieces[id(b)], optimizer, values, states, step)


def _load_bucket(b: Bucket, pieces: Pieces, optimizer: torch.optim.Optimizer, values: PerParam,
                 states: dict | None, step: torch.Tensor | None) -> None:
    full = _flat_of(b, values)
    b.master.copy_(full[b.lo:b.lo + b.shard_size])
    b.param_shard.copy_(full[b.lo:b.lo + b.shard_size])
    if b.resident:
        b.param_flat.data.copy_(full)
    if states is None or step is None:
        return
    moments = {name: _flat_of(b, {i: s[name] for i, s in states.items()})
               for name in ADAMW_MOMENTS}
    for piece, (_, a, n) in zip(pieces, b.pieces, strict=True):
        optimizer.state[piece] = {
            "step": restored_step(optimizer, piece, step),
            **{name: flat[b.lo + a:b.lo + a + n].to(piece.device).clone()
               for name, flat in moments.items()}}


def _flat_of(b: Bucket, per_param: PerParam) -> torch.Tensor:
    flat = torch.zeros(b.padded, dtype=torch.float32, device=b.device)
    for p in b.params:
        b.param_view(flat, p).copy_(per_param[id(p)])
    return flat
