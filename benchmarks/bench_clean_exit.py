"""Clean exits: run 4-rank jobs again and again and count the ones that end abnormally: a
non-zero or negative exit code (a rank or the launcher killed by a signal), gloo's "terminate
called without an active exception" abort at exit, or any stderr line a clean run does not print.
Python's faulthandler is on in every process, so an abort leaves its threads' stacks in stderr;
the first abnormal runs of each job are shown with their first unexpected line.

    python benchmarks/bench_clean_exit.py --runs 50

Two jobs, alternating: the guide's "Python API" example as a user might write it at tp 4 (the
mesh set up, `parallelize`, one optimizer step, no `destroy_parallel`) under torchrun, and a
4-rank MoE training through `meshtrain train --nproc 4`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap

API_SCRIPT = textwrap.dedent("""
    import meshtrain
    import torch
    from meshtrain import OptimizerSettings, ParallelPlan, parallelize, preset

    cfg = preset("llama-tiny")
    plan = ParallelPlan(tp=4, sequence_parallel=True, micro_batch=2)
    plan = plan.validate(cfg, world_size=4, global_batch=4, seq_len=32)
    mesh = meshtrain.init_parallel(**plan.degrees, device="cpu")
    run = parallelize(cfg, plan, mesh, seed=0, seq_len=32, steps=3,
                      optimizer=OptimizerSettings(lr=1e-3, weight_decay=0.0))
    tokens = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    batches = lambda step: [(t[:, :-1], t[:, 1:]) for t in tokens.split(plan.micro_batch)]
    run.sync.zero_grad()
    result = run.executor.forward_backward(0, batches, run.sync, loss_scale=1.0)
    run.sync.wait()
    run.executor.optimizer_step(lambda: run.sync.step(1e-3))
    print("loss", result.loss.item())  # no destroy_parallel: the process must still exit cleanly
""")
CLEAN_STDERR = ("meshtrain:", "train: step", "model states")  # what a clean run prints


def _abnormal(done: subprocess.CompletedProcess) -> str | None:
    """Why a finished job is abnormal (None: it is clean)."""
    noise = [line for line in done.stderr.splitlines()
             if line.strip() and not line.startswith(CLEAN_STDERR)]
    if done.returncode or noise:
        first = noise[0][:160] if noise else ""
        abort = ", abort" if "terminate called" in done.stderr else ""
        return f"exit {done.returncode}{abort}: {first!r}"
    return None


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
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    bad: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as folder:
        jobs = _jobs(folder)
        for run in range(args.runs):
            for name, command in jobs.items():
                extra = ["--out", os.path.join(folder, f"run{run}")] if "train" in command \
                    else []
                done = subprocess.run([*command, *extra], capture_output=True, text=True,
                                      env=env, timeout=600)
                why = _abnormal(done)
                if why:
                    bad.setdefault(name, []).append(f"run {run}: {why}")
    for name in jobs:
        print(f"{name}: {len(bad.get(name, []))} abnormal of {args.runs}"
              + "".join(f"\n  {line}" for line in bad.get(name, [])[:5]))


if __name__ == "__main__":
    main()
