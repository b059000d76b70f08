"""Threads per process for the default single-process run, quiet and beside competing CPU-bound
processes: wall time of `meshtrain train --steps N` (startup included) for each thread count and
OpenMP wait policy, as ratios to the quiet time of the same setting.

    python benchmarks/bench_threads.py --steps 100 --repeats 2

The competing load is `--load K` busy Python processes (each one core's worth of work)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _spin() -> None:
    while True:
        pass


def _run(steps: int, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "meshtrain", "train", "--steps", str(steps),
                        "--eval-every", "0", "--out", f"{out}/run"], check=True, env=env,
                       capture_output=True)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--loads", default="0,1", help="competing processes, comma-separated")
    parser.add_argument("--settings", default="default,1,2,1:passive,2:passive",
                        help="THREADS[:passive] or default (meshtrain's own choice)")
    args = parser.parse_args()
    rows = {}
    for load in map(int, args.loads.split(",")):
        spinners = [mp.Process(target=_spin, daemon=True) for _ in range(load)]
        for p in spinners:
            p.start()
        for _ in range(args.repeats):  # settings alternate within a load
            for setting in args.settings.split(","):
                env = {k: v for k, v in os.environ.items()
                       if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
                threads, _, policy = setting.partition(":")
                if threads != "default":
                    env["OMP_NUM_THREADS"] = threads
                if policy:
                    env["OMP_WAIT_POLICY"] = policy.upper()
                rows.setdefault((setting, load), []).append(_run(args.steps, env))
        for p in spinners:
            p.terminate()
    loads = sorted({load for _, load in rows})
    print(f"meshtrain train --steps {args.steps}, wall seconds (median of {args.repeats});"
          f" {os.cpu_count()} cores")
    print("| setting | " + " | ".join(f"{n} competing" for n in loads) + " | ratio |")
    print("|---" * (len(loads) + 2) + "|")
    for setting in args.settings.split(","):
        times = [statistics.median(rows[(setting, n)]) for n in loads]
        ratio = times[-1] / times[0]
        print(f"| {setting} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
