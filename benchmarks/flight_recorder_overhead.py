"""What the hang watchdog's flight recorder costs: per collective, and per training step.

    python benchmarks/flight_recorder_overhead.py            # tiny model, dp=2 and tp=2
    python benchmarks/flight_recorder_overhead.py --steps 40

1. The bookkeeping alone (`issue` + `done` of one entry, no communication), in this process.
2. A tiny training step on two gloo ranks (one thread each) with nothing armed, the ring
   alone, or the ring and its watchdog thread, in blocks of steps whose order rotates
   (A B C, B C A, ...) so that load from other work on the host hits all alike; median step
   time and collectives per step. Each layout gets two fresh ranks (a RankPool of
   tests/harness.py, the harness the tests run ranks with).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain.config.run_config import RunConfig
from meshtrain.mesh import MeshAxis
from meshtrain.operations.watchdog import HangWatchdog
from meshtrain.parallel.communication.flight_recorder import FlightRecorder
from meshtrain.parallel.runtime.process_groups import init_parallel
from meshtrain.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool  # noqa: E402  (the one rank-spawning harness, tests' and ours)

CALL_TIMEOUT = 3600.0  # far above a run of the default blocks; a hung collective fails sooner,
# at the process-group timeout of the ranks (tests/harness.py)
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


def _rank(layout: str, steps: int, blocks: int) -> tuple[dict[str, float], int]:
    """On each of the two ranks: median step milliseconds per setting, collectives per step."""
    rank = dist.get_rank()
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
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, per_step


def step_overhead(layout: str, steps: int, blocks: int) -> tuple[dict, int]:
    """Rank 0's medians and collectives per step, on two ranks started for this layout."""
    with RankPool(2) as pool:
        return pool.run(_rank, layout, steps, blocks, timeout=CALL_TIMEOUT)[0]


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
