"""meshtrain's GPT against bench_tp.py's plain `DenseGPT` with the same weights: one micro-batch's
forward and backward in one process on one thread (what one pipeline rank computes), by wall
clock in alternating rounds and by `torch.profiler`'s CPU time per op.

    python benchmarks/profile_model.py            # bench_pipeline.py's pp 2 model, V=6784
    python benchmarks/profile_model.py --rounds 3 --top 10

Used to tell whether a pipeline run's slower meshtrain actions come from the model itself
(docs/benchmarks.md, "Runs R7-R9").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bench_pipeline import SHAPES
from bench_tp import DenseGPT, dense_weights
from torch.profiler import ProfilerActivity, profile

import meshtrain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3, help="calls per round")
    parser.add_argument("--top", type=int, default=12, help="ops shown per profile")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = SHAPES[2][0]
    ours = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
    plain = DenseGPT(shape)
    plain.load_meshtrain_(dense_weights(shape))
    ids = torch.randint(0, shape.vocab, (1, shape.seq))
    targets = torch.randint(0, shape.vocab, (1, shape.seq))
    steps = {
        "meshtrain": lambda: ours.loss(ours(ids), targets).backward(),
        "DenseGPT": lambda: F.cross_entropy(plain(ids).flatten(0, 1),
                                            targets.flatten()).backward(),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                step()
            times[name].append((time.perf_counter() - start) / args.calls)
    print(f"model: {shape}, one micro-batch of 1 x {shape.seq}, 1 thread")
    for name, t in times.items():  # the first round warms up
        print(f"{name:<10} forward + backward: median {statistics.median(t[1:]) * 1e3:.1f} ms"
              f" over rounds {', '.join(f'{x * 1e3:.0f}' for x in t)}")
    for name, step in steps.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.calls):
                step()
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6
        print(f"\n{name}: CPU time {total:.3f} s over {args.calls} calls")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
