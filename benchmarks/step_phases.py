"""Where bench_tp's training step goes: forward, backward, the wait for gradient reduction, AdamW.

    python benchmarks/step_phases.py single dp2 tp2 single

bench_tp.py times whole steps and compares them; this splits meshtrain's contenders (the single
process with 2 threads, dp=2 and tp=2 with one thread per rank) into phases, median over 4 steps
after 2 warmup steps, to show what a 2-rank layout spends beyond the single process. List
`single` twice to see the host's noise. Each 2-rank layout runs on two fresh ranks (a RankPool
of tests/harness.py, the harness the tests run ranks with).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import bench_tp
import torch
import torch.distributed as dist
from harness import RankPool  # the tests' rank-spawning harness (bench_tp puts it on sys.path)

import meshtrain
from meshtrain.parallel.runtime.data_parallel import GradientReducer

PHASES = ("forward", "backward", "wait", "adamw", "step")
LAYOUTS = ("single", "dp2", "tp2")


def time_phases(model, ids, targets, reducer: GradientReducer | None = None,
                steps: int = 6, warmup: int = 2) -> dict[str, float]:
    """Median milliseconds of each phase; `reducer`: data parallelism (its wait also averages
    the loss, as bench_tp's contender does)."""
    opt = torch.optim.AdamW(model.parameters(), lr=bench_tp.LR)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for step in range(steps):
        if reducer is not None:
            reducer.zero_grad()
            reducer.sync = True
        else:
            opt.zero_grad(set_to_none=True)
        if dist.is_initialized():
            dist.barrier()
        marks = [time.perf_counter()]
        loss = model.loss(model(ids), targets)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        if reducer is not None:
            reducer.wait()
            dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        marks.append(time.perf_counter())
        opt.step()
        marks.append(time.perf_counter())
        if step >= warmup:
            spans = [b - a for a, b in itertools.pairwise(marks)] + [marks[-1] - marks[0]]
            for phase, span in zip(PHASES, spans, strict=True):
                times[phase].append(span * 1e3)
    return {phase: statistics.median(values) for phase, values in times.items()}


def _rank(layout: str) -> dict[str, float]:
    """On each of the two ranks: its phases of `layout` (dp2 or tp2)."""
    rank = dist.get_rank()
    ids, targets = bench_tp.make_batch(bench_tp.FULL)
    mesh = meshtrain.init_parallel(**{layout[:2]: 2}, device="cpu")
    model = meshtrain.build_model(bench_tp.FULL.config(), mesh, seed=0)
    if layout == "dp2":
        reducer = GradientReducer(list(model.parameters()), mesh.dp_cp)
        return time_phases(model, ids.chunk(2)[rank], targets.chunk(2)[rank], reducer)
    return time_phases(model, ids, targets)


def measure(layout: str) -> dict[str, float]:
    if layout == "single":
        torch.set_num_threads(2)
        ids, targets = bench_tp.make_batch(bench_tp.FULL)
        model = meshtrain.build_model(bench_tp.FULL.config(), meshtrain.ParallelMesh.local(),
                                      seed=0)
        return time_phases(model, ids, targets)
    with RankPool(2) as pool:  # rank 0's phases
        return pool.run(_rank, layout, timeout=bench_tp.CALL_TIMEOUT)[0]


def main(layouts: list[str]) -> None:
    if not layouts or set(layouts) - set(LAYOUTS):
        sys.exit(f"usage: step_phases.py LAYOUT... with LAYOUT one of {', '.join(LAYOUTS)}")
    print(f"{bench_tp.FULL}; milliseconds, median of 4 steps")
    print(f"{'layout':8}" + "".join(f"{phase:>10}" for phase in PHASES))
    for layout in layouts:
        phases = measure(layout)
        print(f"{layout:8}" + "".join(f"{phases[phase]:10.1f}" for phase in PHASES))


if __name__ == "__main__":
    main(sys.argv[1:])
