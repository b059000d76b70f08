"""Context parallelism: every rank holds a slice of every sequence.

Which tokens a rank holds is its `TokenLayout` (`layers/cp_balance.py`): head-tail by default,
or balanced by the work of a micro-batch's documents, which the mask carries (`mask.layout`).

Two attention schemes over the cp axis:
- ring: K/V blocks travel around the ring; each rank attends its queries to every block and merges
  the partial results with an online softmax (log-sum-exp). Backward runs the ring again, the
  K/V gradients travelling with their blocks and a last step returning them to their owners.
  Written by hand because no public SDPA returns the log-sum-exp.
- all2all (Ulysses): an all-to-all turns "my tokens, all my heads" into "all tokens, 1/cp of my
  heads", attention runs on whole sequences, and the reverse all-to-all turns it back.
- hybrid (Megatron-Core's a2a+p2p): all-to-all over cp_a2a ranks inside (a node), then the ring
  over the cp / cp_a2a groups outside: the all-to-all's head limit applies to cp_a2a only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm, regions
from meshtrain.parallel.layers.cp_balance import TokenLayout, head_tail
from meshtrain.parallel.layers.eager import eager_under_compile
from meshtrain.parallel.layers.masks import CAUSAL, AttentionMask
from meshtrain.precision import wide_dtype


def context_parallel_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (into the full sequence) of the tokens rank `rank` holds, in its order."""
    return torch.arange(seq_len) if cp == 1 else head_tail(seq_len, cp).ranks[rank]


def mask_layout(mask: AttentionMask, seq_len: int, cp: int) -> TokenLayout:
    """The layout the tokens were assigned by: the mask's (a balanced micro-batch) or
    head-tail."""
    return mask.layout if mask.layout is not None else head_tail(seq_len, cp)


def _block_scores(q, k, q_pos, k_pos, scale, mask: AttentionMask):
    """Scaled scores `[b, a, rows, cols]` with the keys `mask` hides from each query at -inf."""
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores.masked_fill(~mask.allowed(q_pos, k_pos), float("-inf"))


def ring_sub_blocks(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: AttentionMask,
                    pieces: int = 2) -> list[tuple[slice, slice]]:
    """The (query rows, key columns) of one ring step worth computing. Both sides hold `pieces`
    runs of contiguous positions (head-tail: two chunks); a query run needs the key runs the
    mask leaves visible to it (under the causal mask, for head-tail: both on its own step for
    the late chunk, one chunk or none otherwise); neighbouring query runs needing the same keys
    are computed together, and neighbouring key runs in one block. The skipped scores are all
    masked, so the result is what the whole block gives, for about half the work at large cp."""
    size = len(q_pos) // pieces
    cut = [slice(i * size, (i + 1) * size) for i in range(pieces)]
    needs = [tuple(j for j, keys in enumerate(cut) if mask.visible_span(q_pos[q], k_pos[keys]))
             for q in cut]
    blocks, start = [], 0
    for end in range(1, pieces + 1):
        if end < pieces and needs[end] == needs[start]:
            continue
        rows = slice(start * size, end * size)
        blocks += [(rows, slice(lo * size, hi * size)) for lo, hi in _runs(needs[start])]
        start = end
    return blocks


def _runs(indices: tuple[int, ...]) -> list[tuple[int, int]]:
    """Sorted indices -> their runs of consecutive values as [lo, hi) pairs."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _ring_positions(seq_len: int, axis: MeshAxis, mask: AttentionMask, device):
    """Every step's sub-blocks (planned on the host, without a device sync, once per mask:
    forward and backward of every layer sharing it) and every rank's positions on the device
    (to mask scores)."""
    layout = mask_layout(mask, seq_len, axis.size)
    key = ("ring", axis.rank, axis.size, seq_len)
    if key not in mask._host:
        mine = layout.ranks[axis.rank]
        mask._host[key] = [ring_sub_blocks(mine, layout.ranks[(axis.rank - step) % axis.size],
                                           mask, layout.pieces) for step in range(axis.size)]
    return mask._host[key], [p.to(device) for p in layout.ranks]


def _merge_block(q, k, v, q_pos, k_pos, scale, mask, out, lse):
    """The running output and log-sum-exp of these queries after attending keys `k`."""
    scores = _block_scores(q, k, q_pos, k_pos, scale, mask)
    block_max = scores.amax(dim=-1)
    block_max = torch.where(torch.isinf(block_max), 0.0, block_max)
    probs = torch.exp(scores - block_max.unsqueeze(-1))  # unnormalised
    block_lse = block_max + torch.log(probs.sum(dim=-1))
    new_lse = torch.logaddexp(lse, block_lse)
    safe = torch.where(torch.isinf(new_lse), 0.0, new_lse)
    out = out * torch.exp(lse - safe).unsqueeze(-1) \
        + (probs @ v) * torch.exp(block_max - safe).unsqueeze(-1)
    return out, new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis: MeshAxis, seq_len: int, mask: AttentionMask):
        # q, k, v: [b, a, n, d] for this rank's n tokens. The running output and log-sum-exp
        # are kept in fp32 whatever the input dtype (16-bit would lose digits at every step).
        ctx.dtype = q.dtype
        wide = wide_dtype(q.dtype)
        q, k, v = q.to(wide), k.to(wide), v.to(wide)
        scale = 1.0 / math.sqrt(q.shape[-1])
        planned, positions = _ring_positions(seq_len, axis, mask, q.device)
        q_pos = positions[axis.rank]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        # k and v side by side: their widths differ in multi-head latent attention
        kv, widths = torch.cat([k, v], dim=-1), [k.shape[-1], v.shape[-1]]
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        for step in range(axis.size):
            source = (axis.rank - step) % axis.size
            k_pos = positions[source]
            k_blk, v_blk = kv.split(widths, dim=-1)
            for rows, cols in planned[step]:
                out[:, :, rows], lse[:, :, rows] = _merge_block(
                    q[:, :, rows], k_blk[:, :, cols], v_blk[:, :, cols], q_pos[rows],
                    k_pos[cols], scale, mask, out[:, :, rows], lse[:, :, rows])
            if step < axis.size - 1:
                kv = comm.ring_shift(kv, axis)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.axis, ctx.seq_len, ctx.mask = axis, seq_len, mask
        return out.to(ctx.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grad_out = grad_out.to(q.dtype)
        axis, mask = ctx.axis, ctx.mask
        scale = 1.0 / math.sqrt(q.shape[-1])
        planned, positions = _ring_positions(ctx.seq_len, axis, mask, q.device)
        q_pos = positions[axis.rank]
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # [b, a, n, 1]
        grad_q = torch.zeros_like(q)
        kv, widths = torch.cat([k, v], dim=-1), [k.shape[-1], v.shape[-1]]
        grad_kv = torch.zeros_like(kv)
        for step in range(axis.size):
            source = (axis.rank - step) % axis.size
            k_pos = positions[source]
            k_blk, v_blk = kv.split(widths, dim=-1)
            grad_k, grad_v = grad_kv.split(widths, dim=-1)  # views: the sums land in grad_kv
            for rows, cols in planned[step]:
                probs = torch.exp(_block_scores(q[:, :, rows], k_blk[:, :, cols], q_pos[rows],
                                                k_pos[cols], scale, mask)
                                  - lse[:, :, rows].unsqueeze(-1))
                grad_v[:, :, cols] += probs.transpose(-2, -1) @ grad_out[:, :, rows]
                grad_scores = probs * (grad_out[:, :, rows] @ v_blk[:, :, cols].transpose(-2, -1)
                                       - delta[:, :, rows])
                grad_q[:, :, rows] += (grad_scores @ k_blk[:, :, cols]) * scale
                grad_k[:, :, cols] += (grad_scores.transpose(-2, -1) @ q[:, :, rows]) * scale
            if step < axis.size - 1:
                kv = comm.ring_shift(kv, axis)
            # the gradient travels with its block; the last shift brings it home
            grad_kv = comm.ring_shift(grad_kv, axis)
        grad_k, grad_v = (g.to(ctx.dtype) for g in grad_kv.split(widths, dim=-1))
        return grad_q.to(ctx.dtype), grad_k, grad_v, None, None, None


@eager_under_compile
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: MeshAxis,
                   seq_len: int, mask: AttentionMask = CAUSAL) -> torch.Tensor:
    """Attention of this rank's queries over the whole (cp-split) sequence under `mask`; blocks
    the mask hides whole (outside a window) are not computed. On every device, a GPU too, a
    computed sub-block masks its dense scores with a dense bool `mask.allowed` of the same rows
    and columns (a chunk pair's (s/2cp)^2, at most (s/cp)^2), never a block mask: the ring's
    hand-written kernel holds those scores whole anyway. It stays eager inside compiled
    blocks (`compile`): its point-to-point steps break any graph into small pieces, and
    inductor's AVX2 code for those pieces gave NaNs (torch 2.13, ATEN_CPU_CAPABILITY=avx2)."""
    return _RingAttention.apply(q, k, v, axis, seq_len, mask)


def _heads_to_sequence(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """`[b, a, n, d]` (my tokens, all heads) -> `[b, a/cp, cp*n, d]` (all ranks' tokens)."""
    b, a, n, d = x.shape
    blocks = x.view(b, axis.size, a // axis.size, n, d).transpose(0, 1).contiguous()
    splits = [1] * axis.size
    received = regions.all_to_all_differentiable(blocks.view(axis.size, -1), axis,
                                              send_splits=splits, recv_splits=splits)
    received = received.view(axis.size, b, a // axis.size, n, d)  # [source, b, a/cp, n, d]
    return received.permute(1, 2, 0, 3, 4).reshape(b, a // axis.size, axis.size * n, d)


def _sequence_to_heads(x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """The inverse of `_heads_to_sequence`."""
    b, a_part, total, d = x.shape
    n = total // axis.size
    blocks = x.view(b, a_part, axis.size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    splits = [1] * axis.size
    received = regions.all_to_all_differentiable(blocks.view(axis.size, -1), axis,
                                              send_splits=splits, recv_splits=splits)
    received = received.view(axis.size, b, a_part, n, d)  # [head group, b, a/cp, n, d]
    return received.transpose(0, 1).reshape(b, axis.size * a_part, n, d)


def _exchanged(q, k, v, axis: MeshAxis, gathered: torch.Tensor, held: torch.Tensor,
               attend: Callable) -> torch.Tensor:
    """`attend` between the two all-to-alls over `axis`: the gathered tokens (sequence
    positions `gathered`, in the order the ranks send them) are put in the order `held` (the
    same positions) for `attend`, and its output back in the gathered order."""
    slot = torch.empty(int(gathered.max()) + 1, dtype=torch.long)
    slot[gathered] = torch.arange(len(gathered))
    to_held = slot[held].to(q.device)
    slot[held] = torch.arange(len(held))
    to_gathered = slot[gathered].to(q.device)
    q, k, v = (_heads_to_sequence(t, axis)[:, :, to_held] for t in (q, k, v))
    return _sequence_to_heads(attend(q, k, v)[:, :, to_gathered], axis)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: MeshAxis,
                      seq_len: int, attend: Callable, mask: AttentionMask = CAUSAL
                      ) -> torch.Tensor:
    """Attention by all-to-all: `attend(q, k, v)` (masked as it knows) sees whole sequences in
    position order for 1/cp of this rank's heads (the tokens assigned by `mask`'s layout)."""
    gathered = torch.cat(mask_layout(mask, seq_len, axis.size).ranks)
    return _exchanged(q, k, v, axis, gathered, torch.arange(seq_len), attend)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inner: MeshAxis,
                     outer: MeshAxis, seq_len: int, mask: AttentionMask) -> torch.Tensor:
    """All-to-all over `inner` (cp_a2a), then the ring over `outer` (cp_ring): cp rank
    outer.rank x inner.size + inner.rank, for 1/inner.size of this rank's heads. Head-tail:
    the first chunks of an inner group's ranks are consecutive, and so are their second chunks,
    so what the group gathers is in position order the head-tail share of ring rank outer.rank
    at cp = outer.size, and the ring runs on it as on its own ranks. A balanced layout: each
    ring rank holds its inner group's tokens as they come, `pieces` x inner.size runs."""
    first = outer.rank * inner.size
    if mask.layout is None:
        gathered = torch.cat(head_tail(seq_len, inner.size * outer.size)
                             .ranks[first:first + inner.size])
        held, ring_mask = head_tail(seq_len, outer.size).ranks[outer.rank], mask
    else:
        ring_mask = _ring_level(mask, inner.size)
        gathered = held = ring_mask.layout.ranks[outer.rank]
    return _exchanged(q, k, v, inner, gathered, held,
                      lambda q, k, v: ring_attention(q, k, v, outer, seq_len, ring_mask))


def _ring_level(mask: AttentionMask, group: int) -> AttentionMask:
    """`mask` with its layout seen by the ring of hybrid cp: each inner group of `group` ranks
    as one rank holding their tokens in rank order (kept with the mask, planned once)."""
    key = ("hybrid", group)
    if key not in mask._host:
        ranks, pieces = mask.layout.ranks, mask.layout.pieces
        merged = tuple(torch.cat(ranks[g:g + group]) for g in range(0, len(ranks), group))
        mask._host[key] = dataclasses.replace(mask, layout=TokenLayout(merged, pieces * group))
    return mask._host[key]
