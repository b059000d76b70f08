"""What the hang watchdog's flight recorder costs: per collective, and per training step.

    python benchmarks/flight_recorder_overhead.py            # tiny model, dp=2 and tp=2
    python benchmarks/flight_recorder_overhead.py --steps 40

1. The bookkeeping alone (`issue` + `done` of one entry, no communication), in this process.
2. A tiny training step on two gloo ranks (one thread each) with nothing armed, the ring
   alone, or the ring and its watchdog thread, in blocks of steps whose order rotates
   (A B C, B C A, ...) so that load from other work on the host hits all alike; median step
   time and collectives per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshtrain.config.run_config import RunConfig
from meshtrain.mesh import MeshAxis
from meshtrain.operations.watchdog import HangWatchdog
from meshtrain.parallel.communication.flight_recorder import FlightRecorder
from meshtrain.parallel.runtime.process_groups import init_parallel
from meshtrain.training.trainer import Trainer

SETTINGS = ("off", "ring", "watchdog")  # nothing armed; the ring alone; ring and watchdog


def bookkeeping_ns(calls: int = 200_000) -> float:
    """Nanoseconds per recorded collective (median of 5 runs)."""
    recorder, axis, tensor = FlightRecorder(), MeshAxis("dp", 2, 0, (0, 1), None), torch.ones(8)
    runs = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(calls):
            recorder.done(recorder.issue("all_reduce", axis, tensor))
        runs.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(runs)


def _rank(rank: int, port: int, layout: str, steps: int, blocks: int, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    cfg = RunConfig()
    cfg.parallel.device = "cpu"
    cfg.plan = dataclasses.replace(cfg.plan, tp=2 if layout == "tp2" else 1, micro_batch=2)
    cfg.train.global_batch = 4 if layout == "dp2" else 2
    cfg.train.seq_len = 32
    mesh = init_parallel(**cfg.plan.resolved(2).degrees, device="cpu")
    trainer = Trainer.build(cfg, mesh)
    times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    per_step = 0
    with tempfile.TemporaryDirectory() as out:
        for block in range(len(SETTINGS) * blocks):
            setting = SETTINGS[(block + block // len(SETTINGS)) % len(SETTINGS)]  # rotate order
            watch = HangWatchdog(rank=rank, world_size=2, timeout=600, out=out)
            armed = {"off": None, "ring": watch.recorder, "watchdog": watch}[setting]
            if armed is not None:
                armed.__enter__()
            for step in range(steps):
                dist.barrier()
                start = time.perf_counter()
                trainer.train_step(block * steps + step)
                times[setting].append(time.perf_counter() - start)
            if armed is not None:
                per_step = sum(watch.recorder.seq.values()) // steps
                armed.__exit__(None, None, None)
    dist.destroy_process_group()
    if rank == 0:
        results.put((layout, {k: statistics.median(v) * 1e3 for k, v in times.items()},
                     per_step))


def step_overhead(layout: str, steps: int, blocks: int) -> tuple[dict, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, layout, steps, blocks, results))
             for r in range(2)]
    for p in procs:
        p.start()
    _, medians, per_step = results.get(timeout=600)
    for p in procs:
        p.join()
    return medians, per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks per setting")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"bookkeeping: {bookkeeping_ns():.0f} ns per collective")
    for layout in ("dp2", "tp2"):
        medians, per_step = step_overhead(layout, args.steps, args.blocks)
        shown = ", ".join(f"{name} {ms:.2f} ms ({ms / medians['off'] - 1:+.1%})"
                          for name, ms in medians.items())
        print(f"{layout}: {per_step} collectives per step; median step: {shown}; bookkeeping"
              f" share {per_step * bookkeeping_ns(20_000) / 1e6 / medians['off']:.3%}")


if __name__ == "__main__":
    main()
