"""The planner's predicted step times against measured ones, on this machine at 4 ranks.

    python benchmarks/plan_vs_measured.py [--repeats 3] [--steps 8] [--hardware FILE.toml]
                                          [--json OUT] [--measured RUN.json ...] [--breakdown]

Calibrates this machine (`calibrate_machine(ranks=4)`; `--hardware` skips that), predicts one
small GPT's step time in 22 layouts covering tp, dp, pp under each schedule (zero-bubble ones
included), ZeRO 1/2/3 and CPU offload, cp, sp, both recomputations, several micro-batch sizes
and an MoE variant at ep 1/2/4, then trains each with `meshtrain train --nproc 4`. The host is
shared and noisy, so the layouts take turns: every repeat runs each layout once, starting one
further along the list each time, and a layout's time is the median over all its steps after
the warm-up ones; the load average is recorded before and after. Prints predicted (compute /
exposed communication / bubble) against measured, the relative errors, Spearman's rank
correlation and whether the planner's first choice is the fastest measured layout, against
the issue's goals. `--measured` predicts saved runs again instead of training (several: each
layout's median over them, the "median of three runs" of the issue). `--breakdown` instead
trains one layout per family at two depths and puts the measured floor (a step without its
layers) and per-layer slope beside the model's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshtrain.models import preset
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.calibrate import calibrate_machine
from meshtrain.planner.costs import Prediction, predict
from meshtrain.planner.hardware import Hardware, load_hardware

RANKS, SEQ_LEN, GLOBAL_BATCH, WARMUP_STEPS, LAYERS = 4, 128, 16, 2, 4
MODEL = dataclasses.replace(preset("tiny"), num_layers=LAYERS, hidden_size=128, num_heads=4,
                            vocab_size=512)
"""What `model_flags` build: the tiny preset keeps max_seq_len 256 (>= SEQ_LEN)."""
BREAKDOWN_LAYERS = (2, 6)
"""`--breakdown` trains each layout at these depths: floor and per-layer slope."""
LAYOUTS = (
    ParallelPlan(dp=4, micro_batch=4),
    ParallelPlan(dp=4, micro_batch=1),
    ParallelPlan(dp=4, micro_batch=2, zero=1),
    ParallelPlan(dp=4, micro_batch=4, zero=2),
    ParallelPlan(dp=4, micro_batch=4, zero=3),
    ParallelPlan(dp=4, micro_batch=4, recompute="selective"),
    ParallelPlan(dp=4, micro_batch=4, recompute="full"),
    ParallelPlan(tp=2, dp=2, micro_batch=4),
    ParallelPlan(tp=2, dp=2, micro_batch=8, sequence_parallel=True),
    ParallelPlan(dp=1, tp=4, micro_batch=8),
    ParallelPlan(cp=2, dp=2, micro_batch=4),
    ParallelPlan(pp=2, dp=2, micro_batch=2, pp_schedule="gpipe"),
    ParallelPlan(pp=2, dp=2, micro_batch=2, pp_schedule="1f1b"),
    ParallelPlan(pp=2, dp=2, micro_batch=2, virtual_stages=2, pp_schedule="interleaved"),
    ParallelPlan(dp=1, pp=4, micro_batch=2, pp_schedule="1f1b"),
    ParallelPlan(dp=1, tp=2, pp=2, micro_batch=2, pp_schedule="1f1b"),
    ParallelPlan(pp=2, dp=2, micro_batch=2, pp_schedule="zb-h1"),
    ParallelPlan(pp=2, dp=2, micro_batch=2, pp_schedule="zb-v"),
    ParallelPlan(dp=4, micro_batch=4, zero=1, offload_optimizer="cpu"),
)
MOE_EXPERTS = 4
MOE_MODEL = dataclasses.replace(MODEL, moe_experts=MOE_EXPERTS)
MOE_LAYOUTS = (
    ParallelPlan(dp=4, micro_batch=4),
    ParallelPlan(dp=4, ep=2, micro_batch=4),
    ParallelPlan(dp=4, ep=4, micro_batch=4),
)
"""Trained with MOE_MODEL (every MLP of `MOE_EXPERTS` experts, top-1)."""
CASES = tuple((lay, MODEL) for lay in LAYOUTS) + tuple((lay, MOE_MODEL) for lay in MOE_LAYOUTS)
"""Every measured layout with its model."""
BREAKDOWN_CASES = tuple((lay, MODEL) for lay in (
    ParallelPlan(dp=4, micro_batch=4),
    ParallelPlan(dp=4, micro_batch=1),
    ParallelPlan(dp=4, micro_batch=4, zero=1),
    ParallelPlan(dp=4, micro_batch=4, zero=2),
    ParallelPlan(dp=4, micro_batch=4, zero=3),
    ParallelPlan(dp=4, micro_batch=4, recompute="full"),
    ParallelPlan(tp=2, dp=2, micro_batch=4),
    ParallelPlan(tp=2, dp=2, micro_batch=4, sequence_parallel=True),
    ParallelPlan(cp=2, dp=2, micro_batch=4),
    ParallelPlan(pp=2, dp=2, micro_batch=2, pp_schedule="1f1b"),
    ParallelPlan(pp=2, dp=2, micro_batch=2, pp_schedule="zb-h1"),
)) + ((ParallelPlan(dp=4, ep=2, micro_batch=4), MOE_MODEL),)
"""One layout per family for `--breakdown`: its floor (what a step costs besides its layers)
and its per-layer slope, measured against the model's."""
GOALS = {"median |error| <= 15%": lambda s: s["median_error"] <= 0.15,
         "worst |error| <= 30%": lambda s: s["worst_error"] <= 0.30,
         "Spearman >= 0.9": lambda s: s["spearman"] >= 0.9,
         "first choice = the fastest measured": lambda s: s["first_choice_gap"] == 0.0}


def short(layout: ParallelPlan, model=MODEL) -> str:
    """The fields that differ from the defaults (dp and mb always): `dp=4,mb=2,zero=1`;
    `moe=4` for the MoE model."""
    default = dict(ParallelPlan(dp=1).spec_items())
    return ",".join([f"{key}={value}" for key, value in layout.spec_items()
                     if key in ("dp", "mb") or default.get(key) != value]
                    + ([f"moe={model.moe_experts}"] if model.moe_experts else []))


def model_flags(layers: int = LAYERS, moe_experts: int = 0) -> list[str]:
    return ["--model", "tiny", "--num-layers", str(layers), "--hidden-size",
            str(MODEL.hidden_size), "--num-heads", str(MODEL.num_heads), "--vocab-size",
            str(MODEL.vocab_size), "--seq-len", str(SEQ_LEN), "--global-batch",
            str(GLOBAL_BATCH), "--precision", "fp32", "--moe-experts", str(moe_experts)]


def train_flags(layout: ParallelPlan) -> list[str]:
    flags = ["--tp", layout.tp, "--pp", layout.pp, "--dp", layout.dp, "--cp", layout.cp,
             "--ep", layout.ep, "--zero", layout.zero, "--recompute", layout.recompute,
             "--micro-batch", layout.micro_batch, "--offload-optimizer",
             layout.offload_optimizer, "--pp-schedule", layout.pp_schedule,
             "--virtual-stages", layout.virtual_stages, "--cp-mode", layout.cp_mode]
    return [str(f) for f in flags] + (["--sequence-parallel"] if layout.sequence_parallel else [])


def measure_once(layout: ParallelPlan, steps: int, attempts: int = 2,
                 layers: int = LAYERS, model=MODEL) -> list[float]:
    """Step times (s) after the warm-up steps of one `meshtrain train --nproc 4` run. A failed
    run is tried again once: on this shared host a rank now and then fails to start (exit 6)."""
    for attempt in range(attempts):
        with tempfile.TemporaryDirectory(prefix="plan_vs_measured_") as out:
            cmd = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(RANKS),
                   *model_flags(layers, model.moe_experts), *train_flags(layout),
                   "--steps", str(steps),
                   "--eval-every", "0", "--log-every", "1", "--out", out]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode == 0:
                rows = [json.loads(line)
                        for line in Path(out, "metrics.jsonl").read_text().splitlines()]
                return [row["step_time_s"] for row in rows][WARMUP_STEPS:]
        print(f"  {short(layout)} failed (exit {done.returncode}, attempt {attempt + 1}):"
              f" {done.stderr.strip().splitlines()[-1:]}", flush=True)
    sys.exit(f"{short(layout)} failed {attempts} times:\n{done.stderr[-3000:]}")


def measure_all(repeats: int, steps: int) -> list[float]:
    """Median step time per case, the cases taking turns (each repeat starts one later)."""
    times: list[list[float]] = [[] for _ in CASES]
    for repeat in range(repeats):
        for k in range(len(CASES)):
            i = (repeat + k) % len(CASES)
            times[i] += measure_once(CASES[i][0], steps, model=CASES[i][1])
            print(f"  repeat {repeat + 1}/{repeats} {short(*CASES[i]):<40}"
                  f" {statistics.median(times[i]) * 1e3:7.1f} ms so far", flush=True)
    return [statistics.median(t) for t in times]


def spearman(x: list[float], y: list[float]) -> float:
    """Pearson's correlation of the ranks (ties share their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i in order:
            tied = [j for j in order if v[j] == v[i]]
            r[i] = sum(order.index(j) for j in tied) / len(tied)
        return r
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def summarize(predicted: list[Prediction], measured: list[float]) -> dict[str, float]:
    errors = [abs(p.step_time_s / m - 1) for p, m in zip(predicted, measured, strict=True)]
    first = min(range(len(predicted)), key=lambda i: predicted[i].step_time_s)
    return {"median_error": statistics.median(errors), "worst_error": max(errors),
            "worst_layout": short(*CASES[errors.index(max(errors))]),
            "spearman": spearman([p.step_time_s for p in predicted], measured),
            "first_choice": short(*CASES[first]),
            "first_choice_gap": measured[first] / min(measured) - 1}


def print_table(predicted: list[Prediction], measured: list[float], s: dict) -> None:
    print(f"\n{'layout':<40} {'predicted ms (compute/comm/bubble)':>36} {'measured ms':>12}"
          f" {'error':>7}")
    for (lay, model), p, m in zip(CASES, predicted, measured, strict=True):
        parts = f"{p.step_time_s * 1e3:.1f} ({p.compute_s * 1e3:.1f}/" \
                f"{p.exposed_comm_s * 1e3:.1f}/{p.bubble_s * 1e3:.1f})"
        print(f"{short(lay, model):<40} {parts:>36} {m * 1e3:12.1f}"
              f" {p.step_time_s / m - 1:+7.0%}")
    print(f"\nmedian |error| {s['median_error']:.0%}, worst {s['worst_error']:.0%}"
          f" ({s['worst_layout']}); Spearman {s['spearman']:.2f}; first choice"
          f" {s['first_choice']}: {s['first_choice_gap']:.0%} slower than the fastest measured")
    for goal, met in GOALS.items():
        print(f"goal {goal}: {'met' if met(s) else 'not met'}")


def breakdown(hardware: Hardware, repeats: int, steps: int) -> None:
    """Train each of BREAKDOWN_CASES at each of BREAKDOWN_LAYERS' depths (taking turns) and
    print the measured floor and per-layer slope beside the model's, with the model's split."""
    low, high = BREAKDOWN_LAYERS
    runs = [(lay, model, depth) for lay, model in BREAKDOWN_CASES for depth in BREAKDOWN_LAYERS]
    times: list[list[float]] = [[] for _ in runs]
    for repeat in range(repeats):
        for k in range(len(runs)):
            i = (repeat + k) % len(runs)
            lay, model, depth = runs[i]
            times[i] += measure_once(lay, steps, layers=depth, model=model)
            print(f"  repeat {repeat + 1}/{repeats} {short(lay, model):<36} layers {depth}:"
                  f" {statistics.median(times[i]) * 1e3:7.1f} ms", flush=True)
    measured = {run: statistics.median(t) for run, t in zip(runs, times, strict=True)}
    print(f"\n{'layout':<36} {'floor ms meas/model':>20} {'slope ms/layer meas/model':>26}"
          f"   model floor split (compute/comm/bubble)")
    for lay, model in BREAKDOWN_CASES:
        pred = {d: predict(dataclasses.replace(model, num_layers=d), lay, hardware,
                           seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, precision="fp32")
                for d in BREAKDOWN_LAYERS}
        slope = (measured[lay, model, high] - measured[lay, model, low]) / (high - low)
        model_slope = (pred[high].step_time_s - pred[low].step_time_s) / (high - low)
        floor = measured[lay, model, low] - low * slope
        parts = [(getattr(pred[high], k) * low - getattr(pred[low], k) * high) / (low - high)
                 for k in ("compute_s", "exposed_comm_s", "bubble_s")]
        print(f"{short(lay, model):<36} {floor * 1e3:9.1f} /{sum(parts) * 1e3:7.1f}"
              f" {slope * 1e3:15.2f} /{model_slope * 1e3:7.2f}   "
              + "/".join(f"{x * 1e3:.1f}" for x in parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (2 are warm-up)")
    parser.add_argument("--hardware", help="a profile name or TOML file instead of calibrating")
    parser.add_argument("--json", type=Path, help="also write everything to this file")
    parser.add_argument("--breakdown", action="store_true",
                        help="measure each layout family's floor and per-layer slope instead")
    parser.add_argument("--measured", type=Path, nargs="+",
                        help="previous runs' --json: predict their measured times (each"
                             " layout's median over the runs) again, with --hardware or the"
                             " first run's profile, instead of training")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS or args.repeats < 1:
        parser.error(f"--steps must exceed {WARMUP_STEPS} and --repeats be positive")
    for layout, model in CASES:  # fail before the long part
        layout.validate(model, world_size=RANKS,
                                                  global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
    saved = [json.loads(path.read_text()) for path in args.measured or ()]
    load_before = os.getloadavg()  # before calibrating: its 4 ranks load the host too
    if args.hardware:
        hardware = load_hardware(args.hardware)
    elif saved:
        hardware = Hardware(**saved[0]["hardware"])
    else:
        print(f"calibrating this machine at {RANKS} ranks:")
        hardware = calibrate_machine(ranks=RANKS, report=lambda line: print("  " + line))
    print(hardware.to_toml())
    if args.breakdown:
        return breakdown(hardware, args.repeats, args.steps)
    predicted = [predict(model, lay, hardware, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                         precision="fp32") for lay, model in CASES]
    if saved:
        by_spec = [{row["layout"]: row["measured_step_time_s"] for row in run["rows"]}
                   for run in saved]
        measured = [statistics.median(run[short(*case)] for run in by_spec) for case in CASES]
        for i, j in itertools.combinations(range(len(saved)), 2):  # the noise's own ranking
            print(f"measured runs {args.measured[i]} and {args.measured[j]} rank the layouts with"
                  " Spearman " + format(spearman(*([run[short(*case)] for case in CASES]
                                                    for run in (by_spec[i], by_spec[j]))), ".2f"))
    else:
        print(f"measuring {len(CASES)} layouts x {args.repeats} repeats x {args.steps}"
              " steps:")
        measured = measure_all(args.repeats, args.steps)
        print(f"load average before {load_before}, after {os.getloadavg()}")
    summary = summarize(predicted, measured)
    print_table(predicted, measured, summary)
    if args.json:
        rows = [{"layout": short(*case), "measured_step_time_s": m,
                 **{k: getattr(p, k) for k in ("step_time_s", "compute_s", "exposed_comm_s",
                                               "bubble_s")}}
                for case, p, m in zip(CASES, predicted, measured, strict=True)]
        args.json.write_text(json.dumps({"hardware": dataclasses.asdict(hardware), "rows": rows,
                                         "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
