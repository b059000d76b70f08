"""Peak memory of each rank of a pp 2 1F1B step at few and many micro-batches (issue 54 item 1):
sends waited as the schedule proves them taken (`schedules/releases.py`, meshtrain's runtime)
against every send waited at the step's end (the runtime before; `run_schedule` without
`releases`).

Micro-batch 1 of [1, 512, 1024] fp32: 2 MiB per boundary tensor. Each stage is one elementwise
layer (x * w, tanh), so the step is cheap and what it keeps is its 1F1B in-flight inputs and the
boundary tensors. Every (mode, m) runs in two fresh processes (gloo), one step, and reports per
rank:
- `live`: the high-water mark of live tensor storages over the step (`memory.measure_peak`, what
  `train --peak-memory` measures on CPU: every tensor the step holds, counted once per storage);
- `rss`: the process's resident high-water mark (`resource.getrusage` ru_maxrss), which also
  counts the allocator's and the runtime's own memory. The ranks run with glibc's
  `MALLOC_MMAP_THRESHOLD_` fixed at 1 MiB: every 2 MiB block is its own mapping, returned to
  the system when freed (glibc otherwise raises the threshold after the first such free and
  keeps later blocks in per-thread heaps, gloo's threads' included, which it rarely trims, so
  the high-water mark would follow the heaps' fragmentation rather than what the step holds);
- `held`: the most boundary tensors the runtime held at once (`ScheduleRun.peak_boundary_tensors`).

    python benchmarks/bench_pipeline_memory.py            # m = 8 and 64
    python benchmarks/bench_pipeline_memory.py --m 8 16 64
"""

from __future__ import annotations

import argparse
import os
import resource
import socket

import torch
import torch.multiprocessing as mp

import meshtrain
from meshtrain.memory import measure_peak
from meshtrain.parallel.runtime.pipeline import run_schedule
from meshtrain.parallel.schedules.flush import one_f_one_b
from meshtrain.parallel.schedules.releases import send_releases

SHAPE = (1, 512, 1024)  # [micro, s, h]: 2 MiB in fp32
MIB = 2**20


class _Inputs:
    """Micro-batch i's input, made when the runtime asks for it (not all up front, which would
    grow with m)."""

    def __init__(self, m: int):
        self.m = m

    def __len__(self) -> int:
        return self.m

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)),)


def _rank(rank: int, port: int, m: int, released: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    mesh = meshtrain.init_parallel(pp=2, device="cpu")
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.rand(SHAPE[-1]))
    lists = one_f_one_b(2, m)
    with measure_peak(baseline={"weight": [weight]}) as peak:
        run = run_schedule(lists[rank], stage=lambda x, chunk, batch: (torch.tanh(x * weight),
                                                                       0.0),
                           loss_fn=lambda y, batch: y.square().mean(), micro_batches=_Inputs(m),
                           mesh=mesh, activation_shape=SHAPE, dtype=torch.float32,
                           releases=send_releases(lists)[rank] if released else None)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out.put((rank, peak.peak / MIB, rss / MIB, run.peak_boundary_tensors))
    torch.distributed.destroy_process_group()


def measure(m: int, released: bool) -> list[tuple]:
    """One step in two fresh processes: per rank (live MiB, rss MiB, held)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, m, released, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = {}
    for _ in procs:
        rank, *values = out.get(timeout=600)
        results[rank] = values
    for proc in procs:
        proc.join()
    return [results[r] for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[8, 64])
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MIB)  # the spawned ranks inherit it
    boundary = torch.Size(SHAPE).numel() * 4 / MIB
    print(f"pp 2 1F1B, micro-batch 1, boundary tensor {list(SHAPE)} fp32 = {boundary:.0f} MiB")
    print(f"{'waits':<10}{'m':>4}  " + "  ".join(
        f"rank {r}: {'live':>7} {'rss':>7} {'held':>4}" for r in range(2)))
    rows = {}
    for released in (False, True):
        for m in args.m:
            rows[released, m] = measure(m, released)
            print(f"{'released' if released else 'step end':<10}{m:>4}  " + "  ".join(
                f"        {live:7.1f} {rss:7.1f} {held:4d}"
                for live, rss, held in rows[released, m]))
    lo, hi = min(args.m), max(args.m)
    for released in (False, True):
        growth = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(rows[released, lo],
                                                             rows[released, hi], strict=True)]
        print(f"{'released' if released else 'step end'}: m {lo} -> {hi} adds " + ", ".join(
            f"rank {r} live {d_live:+.1f} MiB ({d_live / boundary:+.1f} boundary tensors),"
            f" rss {d_rss:+.1f} MiB" for r, (d_live, d_rss) in enumerate(growth)))


if __name__ == "__main__":
    main()
