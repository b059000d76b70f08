"""Ring attention with and without skipping the mask's empty sub-blocks, in one run.

Each cp rank holds chunks r and 2cp-1-r of the sequence; a ring step pairs two query chunks with
two key chunks, and under the causal mask some of those four pairs are wholly masked.
`ring_sub_blocks` computes only the others ("sub-blocks"); "whole blocks" puts back what ring
attention did before, every block whole (the same numbers: the skipped scores are all masked).
Both run one attention forward + backward on the same ranks, alternating (A B A B ...), at
sequence 4096 by default; the median of the rounds is printed per cp with the ratio, and the
counted score elements per rank (the FLOPs that scale with them) from `ring_sub_blocks` itself.
Then the same under a document mask (packed documents of random lengths, DOC_MEAN tokens on
average): a pair of chunks no document spans is skipped too, so ranks may differ; the counts
print every rank's share. The ranks are a RankPool of tests/harness.py, one thread each.

    python benchmarks/bench_ring_attention.py                 # cp 2 and 4, s 4096
    python benchmarks/bench_ring_attention.py --quick         # s 512, 2 rounds: a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from meshtrain.parallel.layers import context_parallel
from meshtrain.parallel.layers.context_parallel import (
    context_parallel_positions,
    ring_attention,
    ring_sub_blocks,
)
from meshtrain.parallel.layers.masks import CAUSAL, AttentionMask

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool, worker_mesh  # noqa: E402  (the one rank-spawning harness)

HEADS, HEAD_DIM = 4, 32
DOC_MEAN = 256
"""Mean packed document length of the document-mask case (an exponential draw, seed 0)."""


def packed_documents(seq_len: int) -> torch.Tensor:
    """`[1, s]` document ids of documents of exponentially distributed length."""
    g = torch.Generator().manual_seed(0)
    starts = torch.rand(seq_len, generator=g) < 1.0 / DOC_MEAN
    starts[0] = False
    return torch.cumsum(starts.int(), dim=0)[None]


def _whole_blocks(q_pos, k_pos, mask, pieces=2):
    """Ring attention before sub-blocks: every block whole unless the mask hides all of it."""
    n = len(q_pos)
    return [(slice(0, n), slice(0, n))] if mask.visible_span(q_pos, k_pos) else []


def _time_step(seq_len: int, cp: int, rounds: int, mask: AttentionMask) -> dict[str, list[float]]:
    mesh = worker_mesh(cp=cp)
    torch.manual_seed(mesh.cp.rank)
    n = seq_len // cp
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))
    times: dict[str, list[float]] = {"whole blocks": [], "sub-blocks": []}
    for _ in range(rounds + 1):  # the first round warms up
        for name, plan in (("whole blocks", _whole_blocks), ("sub-blocks", ring_sub_blocks)):
            context_parallel.ring_sub_blocks = plan
            torch.distributed.barrier()
            start = time.perf_counter()
            fresh = AttentionMask(mask.window, mask.documents)  # the ring caches its plan in it
            ring_attention(q, k, v, mesh.cp, seq_len, fresh).sum().backward()
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - start)
    context_parallel.ring_sub_blocks = ring_sub_blocks
    return {name: values[1:] for name, values in times.items()}


def counted_elements(seq_len: int, cp: int, plan, mask: AttentionMask) -> list[int]:
    """Score elements each rank computes over the ring's steps."""
    positions = [context_parallel_positions(seq_len, cp, r) for r in range(cp)]
    counts = []
    for rank in range(cp):
        total = 0
        for step in range(cp):
            k_pos = positions[(rank - step) % cp]
            for rows, cols in plan(positions[rank], k_pos, mask):
                total += len(positions[rank][rows]) * len(k_pos[cols])
        counts.append(total)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seq_len, rounds = (512, 2) if args.quick else (args.seq_len, args.rounds)
    print(f"ring attention forward + backward, s {seq_len}, {HEADS} heads x {HEAD_DIM},"
          f" median of {rounds} alternating rounds")
    masks = {"causal": CAUSAL, f"documents (mean {DOC_MEAN})":
             AttentionMask(documents=packed_documents(seq_len))}
    for cp in (int(c) for c in args.cp.split(",")):
        for name, mask in masks.items():
            with RankPool(cp) as pool:
                times = pool.run(_time_step, seq_len, cp, rounds, mask, timeout=3600.0)[0]
            whole, sub = (statistics.median(times[kind])
                          for kind in ("whole blocks", "sub-blocks"))
            every = seq_len * seq_len // cp  # per rank: cp blocks of (s / cp)^2, all whole
            after = counted_elements(seq_len, cp, ring_sub_blocks, mask)
            print(f"cp {cp}, {name}: whole blocks {whole * 1e3:.1f} ms, sub-blocks"
                  f" {sub * 1e3:.1f} ms ({sub / whole:.2f}x); score elements per rank"
                  f" {sum(after) / cp:,.0f} of {every:,} ({sum(after) / cp / every:.3f}), ranks"
                  f" {', '.join(f'{a / every:.3f}' for a in after)} (max/min"
                  f" {max(after) / min(after):.2f})")


if __name__ == "__main__":
    main()
