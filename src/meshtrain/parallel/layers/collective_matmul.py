"""Collective matmuls: the sequence-parallel all-gather and reduce-scatter of a tensor-parallel
linear layer run as ring steps, each hidden behind the matmul of one chunk (`tp_overlap`).

Under sequence parallelism each of the t ranks of the TP axis holds s/t tokens `[b, s/t, h]`.
A column-parallel linear needs all s of them (all-gather, then one matmul); a row-parallel
linear makes partial sums for all s and keeps its s/t summed (one matmul, then reduce-scatter).
Both split along the sequence into t chunks, chunk j being rank j's tokens, so that the
communication of one chunk runs while another chunk's matmul computes (the decomposition of
Wang et al.'s collective matmul, behind PyTorch's async TP and Megatron-LM's TP overlap):

- `gather_matmul`: the chunks travel around the ring in t - 1 steps. While a step sends the
  chunk a rank holds to the next rank and receives the previous rank's, the rank multiplies
  the chunk it holds. Every rank ends with every chunk's product, and with the chunks.
- `matmul_reduce_scatter`: one running sum per chunk travels the ring. At each step a rank
  adds its partial product to the sum it received and passes it on; the partial product of
  the next step is computed while the sum is on its way. After t - 1 steps each rank holds its
  own chunk summed over every rank.

Each rank sends t - 1 chunks, as a ring all-gather or reduce-scatter does; each ring is counted
once as the collective it replaces (`comm.count_ring`). The products are computed chunk by
chunk (contiguous chunks, or row slices without a bias): on the CPU kernels the tests pin
(AVX2) these equal the rows of the one large matmul bit for bit. A ring's sums are added in
ring order (for chunk j: rank j + 1's part, then j + 2's, ..., j's last), which at t = 2 is
the only order two addends have and at t > 2 may round differently from the reduce-scatter
collective's own order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm


def sequence_chunk(x: torch.Tensor, axis: MeshAxis, j: int) -> torch.Tensor:
    """Chunk j of t = `axis.size` along the sequence (dim 1) of `x` `[b, s, ...]` (a view)."""
    if x.shape[1] % axis.size:
        raise ValueError(f"dimension 1 of size {x.shape[1]} is not divisible by the"
                         f" {axis.name} degree {axis.size}")
    size = x.shape[1] // axis.size
    return x[:, j * size:(j + 1) * size]


def gather_matmul(x: torch.Tensor, axis: MeshAxis, compute: Callable[[torch.Tensor], torch.Tensor]
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`compute(chunk)` of every rank's `x` `[b, s/t, ...]` over `axis`, and the chunks, both in
    axis-rank order (`torch.cat(chunks, dim=1)` is the all-gather of `x` along the sequence).
    The all-gather runs as t - 1 ring steps, each overlapped with `compute` of the chunk held."""
    t, r = axis.size, axis.rank
    comm.count_ring("all_gather", axis, x)
    held = x.contiguous()
    products: list[torch.Tensor] = [held] * t
    chunks: list[torch.Tensor] = [held] * t
    for k in range(t):
        j = (r - k) % t  # the rank whose chunk is held at step k
        step = None
        if k < t - 1:
            incoming = torch.empty_like(held)
            step = comm.ring_exchange([held], [incoming], axis)
        products[j], chunks[j] = compute(held), held
        if step is not None:
            step.wait()
            held = incoming
    return products, chunks


def matmul_reduce_scatter(partial: Callable[[int], torch.Tensor], axis: MeshAxis, *,
                          carry: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """This rank's chunk, summed over `axis`, of products every rank holds a part of:
    `partial(j)` is this rank's addend `[b, s/t, ...]` to chunk j (contiguous). The
    reduce-scatter runs as t - 1 ring steps, each overlapped with the next `partial`.

    `carry`: a `[b, s/t, ...]` tensor all-gathered along the same steps (a backward re-gathers
    its input so), returned as its chunks in axis-rank order; None when not given."""
    t, r = axis.size, axis.rank
    total = partial((r - 1) % t)  # step 0: the chunk of the previous rank, passed on next
    comm.count_ring("reduce_scatter", axis, total)
    chunks: list[torch.Tensor] | None = None
    if carry is not None:
        comm.count_ring("all_gather", axis, carry)
        held = carry.contiguous()
        chunks = [held] * t
    for k in range(1, t):
        incoming = torch.empty_like(total)
        sends, recvs = [total], [incoming]
        if chunks is not None:
            arriving = torch.empty_like(held)
            sends.append(held)
            recvs.append(arriving)
        step = comm.ring_exchange(sends, recvs, axis)
        addend = partial((r - 1 - k) % t)  # k = t - 1: this rank's own chunk
        step.wait()
        total = incoming.add_(addend)
        if chunks is not None:
            held = chunks[(r - k) % t] = arriving
    return total, chunks
