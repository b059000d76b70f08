"""The planner's predicted peak memory per rank against the measured peak, on this machine at 4
ranks (issue 32 item 6).

    python benchmarks/plan_memory_vs_measured.py [--json OUT] [--measured PREVIOUS.json]

Trains each layout of `plan_vs_measured.CASES` (the same small GPT, fp32; its MoE variant for
the expert-parallel layouts) and of `MEMORY_ONLY` for 3 steps with
`meshtrain train --nproc 4 --peak-memory`, which measures the second step's peak on every rank
(on CPU the high-water mark of live tensor storages: `memory.measure_peak`), and prints the
planner's busiest rank (params/grads/optim/activ/buffers) against the largest measured peak
(parameters + other storages live at the step's start + what the step allocated, at the
peak), the relative error per layout and whether every layout is within 10%. `--measured`
predicts a previous run's measurements again instead of training (after a change to the
memory model).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from plan_vs_measured import (
    CASES,
    GLOBAL_BATCH,
    MODEL,
    RANKS,
    SEQ_LEN,
    model_flags,
    short,
    train_flags,
)

from meshtrain.models.family import TransformerConfig
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.costs import predict
from meshtrain.planner.hardware import CPU_PROFILE, load_hardware
from meshtrain.planner.memory_model import MemoryBreakdown

MEMORY_ONLY = tuple((layout, MODEL) for layout in (
    ParallelPlan(tp=2, pp=2, dp=1, micro_batch=2, pp_schedule="interleaved", virtual_stages=2),
    ParallelPlan(pp=2, dp=2, micro_batch=2, pp_schedule="2bw"),
    ParallelPlan(tp=2, dp=2, micro_batch=4, sequence_parallel=True, zero=1),
    ParallelPlan(tp=2, dp=2, micro_batch=4, recompute="full"),
    ParallelPlan(dp=2, cp=2, micro_batch=4, cp_mode="all2all"),
    ParallelPlan(dp=4, micro_batch=1, zero=3),
    ParallelPlan(pp=2, dp=2, micro_batch=1, pp_schedule="gpipe"),
    ParallelPlan(tp=4, dp=1, micro_batch=4, sequence_parallel=True),
    ParallelPlan(pp=4, dp=1, micro_batch=1, pp_schedule="zb-h1"),
    ParallelPlan(pp=2, dp=2, micro_batch=1, zero=1, pp_schedule="zb-v", recompute="selective")))
"""Layouts checked for memory only (beside the timed `CASES`): other schedules, micro-batch
sizes, Ulysses, and combinations of the families."""
GOAL = 0.10
MIB = 2**20
KINDS = ("parameters", "gradients", "optimizer_states", "activations", "buffers")


def measure(layout: ParallelPlan, model: TransformerConfig, attempts: int = 2) -> list[dict]:
    """Each rank's `peak` from memory.json of a 3-step run (a failed start is tried again)."""
    for attempt in range(attempts):
        with tempfile.TemporaryDirectory(prefix="plan_memory_") as out:
            cmd = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(RANKS),
                   *model_flags(moe_experts=model.moe_experts), *train_flags(layout),
                   "--steps", "3", "--eval-every", "0",
                   "--peak-memory", "--out", out]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode == 0:
                return [rank["peak"] for rank in
                        json.loads(Path(out, "memory.json").read_text())["ranks"]]
        print(f"  {short(layout, model)} failed (exit {done.returncode}, attempt"
              f" {attempt + 1})", flush=True)
    sys.exit(f"{short(layout, model)} failed {attempts} times:\n{done.stderr[-3000:]}")


def predicted(layout: ParallelPlan, model: TransformerConfig) -> MemoryBreakdown:
    """Memory does not depend on the hardware: any profile gives the same breakdown."""
    return predict(model, layout, load_hardware(CPU_PROFILE), seq_len=SEQ_LEN,
                   global_batch=GLOBAL_BATCH, precision="fp32").memory


def print_table(rows: list[tuple[str, MemoryBreakdown, list[dict]]]) -> bool:
    print(f"\n{'layout':<40} {'predicted MiB (params/grads/optim/activ/buffers)':>50}"
          f" {'measured MiB (params/held/allocated)':>38} {'error':>7}")
    errors = []
    for name, memory, ranks in rows:
        peak = max(ranks, key=lambda r: r["peak"])
        split = "/".join(f"{getattr(memory, k) / MIB:.1f}" for k in KINDS)
        at = peak["at_peak"]
        measured = "/".join(f"{at.get(k, 0) / MIB:.1f}"
                            for k in ("parameters", "held", "allocated"))
        error = memory.total / peak["peak"] - 1
        errors.append(abs(error))
        ours, theirs = f"{memory.total / MIB:.1f} ({split})", \
            f"{peak['peak'] / MIB:.1f} ({measured})"
        print(f"{name:<40} {ours:>50} {theirs:>38} {error:+7.1%}")
    met = max(errors) <= GOAL
    print(f"\nworst |error| {max(errors):.1%}; every layout within {GOAL:.0%}:"
          f" {'met' if met else 'not met'}")
    return met


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write every rank's peak to this file")
    parser.add_argument("--measured", type=Path,
                        help="a previous run's --json: predict its measurements again")
    args = parser.parse_args()
    if args.measured:
        saved = {row["layout"]: row["ranks"] for row in
                 json.loads(args.measured.read_text())["rows"]}
        measured = [saved[short(*case)] for case in CASES + MEMORY_ONLY if short(*case) in saved]
        cases = [case for case in CASES + MEMORY_ONLY if short(*case) in saved]
    else:
        measured, cases = [], CASES + MEMORY_ONLY
        for layout, model in cases:
            measured.append(measure(layout, model))
            print(f"  {short(layout, model):<40}"
                  f" {max(r['peak'] for r in measured[-1]) / MIB:7.1f} MiB", flush=True)
    rows = [(short(layout, model), predicted(layout, model), ranks)
            for (layout, model), ranks in zip(cases, measured, strict=True)]
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": [
            {"layout": name, "ranks": ranks} for name, _, ranks in rows]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
