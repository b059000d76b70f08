"""Latency of one small collective on this machine's gloo: why the test suite's time follows the
number of collectives its parallel cases make, and why a 4-rank case on 2 cores costs about 3x a
2-rank one. Each collective moves 8 floats; the time is the mean over 300 calls after 20.

    torchrun --standalone --nproc-per-node 2 benchmarks/gloo_latency.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/gloo_latency.py
"""

import time

import torch
import torch.distributed as dist


def _mean_ms(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def run() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, out = torch.zeros(8), torch.zeros(8 * world)

    def ping_pong():
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    for name, fn in [("all_reduce", lambda: dist.all_reduce(x)), ("barrier", dist.barrier),
                     ("all_gather", lambda: dist.all_gather_into_tensor(out, x)),
                     ("broadcast", lambda: dist.broadcast(x, 0)),
                     ("send+recv round trip (ranks 0, 1)", ping_pong)]:
        ms = _mean_ms(fn)
        if rank == 0:
            print(f"{world} ranks  {name:34s} {ms:.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    run()
