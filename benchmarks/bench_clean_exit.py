"""Clean exits: run 4-rank jobs again and again and count the ones that end abnormally (a
non-zero code, or gloo's "terminate called without an active exception" abort at exit).

    python benchmarks/bench_clean_exit.py --runs 50

Two jobs, alternating: the guide's API example as a user might write it (the mesh set up, a
forward and backward at tp 4, no `destroy_parallel`) under torchrun, and a 4-rank MoE training
through `meshtrain train --nproc 4`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

API_SCRIPT = textwrap.dedent("""
    import torch
    import meshtrain
    mesh = meshtrain.init_parallel(tp=4, device="cpu")
    model = meshtrain.build_model(meshtrain.preset("tiny"), mesh, seed=0)
    ids = torch.randint(0, 256, (2, 16))
    model.loss(model(ids), ids).backward()
    print("done")  # no destroy_parallel: the process must still exit cleanly
""")


def _jobs(folder: str) -> dict[str, list[str]]:
    script = os.path.join(folder, "api_example.py")
    with open(script, "w") as f:
        f.write(API_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "4"]
    train = [sys.executable, "-m", "meshtrain", "train", "--nproc", "4", "--tp", "2",
             "--moe-experts", "4", "--ep", "2", "--steps", "3", "--eval-every", "0",
             "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2", "--device", "cpu"]
    return {"api example (torchrun, no destroy)": [*torchrun, script],
            "meshtrain train --nproc 4 (MoE)": train}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each job")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    bad: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as folder:
        jobs = _jobs(folder)
        for run in range(args.runs):
            for name, command in jobs.items():
                extra = ["--out", os.path.join(folder, f"run{run}")] if "train" in command \
                    else []
                done = subprocess.run([*command, *extra], capture_output=True, text=True,
                                      env=env, timeout=600)
                aborted = "terminate called" in done.stderr
                if done.returncode or aborted:
                    bad.setdefault(name, []).append(
                        f"run {run}: exit {done.returncode}{', abort' if aborted else ''}")
    for name in jobs:
        print(f"{name}: {len(bad.get(name, []))} abnormal of {args.runs}"
              + (f" ({'; '.join(bad[name][:5])})" if name in bad else ""))


if __name__ == "__main__":
    main()
