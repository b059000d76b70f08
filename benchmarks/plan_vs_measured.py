"""The planner's predicted step times against measured ones, on this machine at 4 ranks.

    python benchmarks/plan_vs_measured.py [--repeats 3] [--steps 8] [--hardware FILE.toml]
                                          [--json OUT] [--measured PREVIOUS.json]

Calibrates this machine (`calibrate_machine(ranks=4)`; `--hardware` skips that), predicts one
small GPT's step time in 16 layouts covering tp, dp, pp under each schedule, ZeRO 1/2/3, cp, sp,
both recomputations and several micro-batch sizes, then trains each with `meshtrain train
--nproc 4`. The host is shared and noisy, so the layouts take turns: every repeat runs each
layout once, starting one further along the list each time, and a layout's time is the median
over all its steps after the warm-up ones. Prints predicted (compute / exposed communication /
bubble) against measured, the relative errors, Spearman's rank correlation and whether the
planner's first choice is within 10% of the fastest measured layout, against the issue's goals.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
)
BREAKDOWN_LAYOUTS = (
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
)
"""One layout per family for `--breakdown`: its floor (what a step costs besides its layers)
and its per-layer slope, measured against the model's."""
GOALS = {"median error <= 15%": lambda s: s["median_error"] <= 0.15,
         "Spearman >= 0.8": lambda s: s["spearman"] >= 0.8,
         "first choice within 10% of the fastest": lambda s: s["first_choice_gap"] <= 0.10}


def short(layout: ParallelPlan) -> str:
    """The fields that differ from the defaults (dp and mb always): `dp=4,mb=2,zero=1`."""
    default = dict(ParallelPlan(dp=1).spec_items())
    return ",".join(f"{key}={value}" for key, value in layout.spec_items()
                    if key in ("dp", "mb") or default.get(key) != value)


def model_flags(layers: int = LAYERS) -> list[str]:
    return ["--model", "tiny", "--num-layers", str(layers), "--hidden-size",
            str(MODEL.hidden_size), "--num-heads", str(MODEL.num_heads), "--vocab-size",
            str(MODEL.vocab_size), "--seq-len", str(SEQ_LEN), "--global-batch",
            str(GLOBAL_BATCH), "--precision", "fp32"]


def train_flags(layout: ParallelPlan) -> list[str]:
    flags = ["--tp", layout.tp, "--pp", layout.pp, "--dp", layout.dp, "--cp", layout.cp,
             "--zero", layout.zero, "--recompute", layout.recompute,
             "--micro-batch", layout.micro_batch,
             "--pp-schedule", layout.pp_schedule, "--virtual-stages", layout.virtual_stages]
    return [str(f) for f in flags] + (["--sequence-parallel"] if layout.sequence_parallel else [])


def measure_once(layout: ParallelPlan, steps: int, attempts: int = 2,
                 layers: int = LAYERS) -> list[float]:
    """Step times (s) after the warm-up steps of one `meshtrain train --nproc 4` run. A failed
    run is tried again once: on this shared host a rank now and then fails to start (exit 6)."""
    for attempt in range(attempts):
        with tempfile.TemporaryDirectory(prefix="plan_vs_measured_") as out:
            cmd = [sys.executable, "-m", "meshtrain", "train", "--nproc", str(RANKS),
                   *model_flags(layers), *train_flags(layout), "--steps", str(steps),
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
    """Median step time per layout, the layouts taking turns (each repeat starts one later)."""
    times: list[list[float]] = [[] for _ in LAYOUTS]
    for repeat in range(repeats):
        for k in range(len(LAYOUTS)):
            i = (repeat + k) % len(LAYOUTS)
            times[i] += measure_once(LAYOUTS[i], steps)
            print(f"  repeat {repeat + 1}/{repeats} {short(LAYOUTS[i]):<40}"
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
            "worst_layout": short(LAYOUTS[errors.index(max(errors))]),
            "spearman": spearman([p.step_time_s for p in predicted], measured),
            "first_choice": short(LAYOUTS[first]),
            "first_choice_gap": measured[first] / min(measured) - 1}


def print_table(predicted: list[Prediction], measured: list[float], s: dict) -> None:
    print(f"\n{'layout':<40} {'predicted ms (compute/comm/bubble)':>36} {'measured ms':>12}"
          f" {'error':>7}")
    for lay, p, m in zip(LAYOUTS, predicted, measured, strict=True):
        parts = f"{p.step_time_s * 1e3:.1f} ({p.compute_s * 1e3:.1f}/" \
                f"{p.exposed_comm_s * 1e3:.1f}/{p.bubble_s * 1e3:.1f})"
        print(f"{short(lay):<40} {parts:>36} {m * 1e3:12.1f} {p.step_time_s / m - 1:+7.0%}")
    print(f"\nmedian |error| {s['median_error']:.0%}, worst {s['worst_error']:.0%}"
          f" ({s['worst_layout']}); Spearman {s['spearman']:.2f}; first choice"
          f" {s['first_choice']}: {s['first_choice_gap']:.0%} slower than the fastest measured")
    for goal, met in GOALS.items():
        print(f"goal {goal}: {'met' if met(s) else 'not met'}")


def breakdown(hardware: Hardware, repeats: int, steps: int) -> None:
    """Train each of BREAKDOWN_LAYOUTS at each of BREAKDOWN_LAYERS' depths (taking turns) and
    print the measured floor and per-layer slope beside the model's, with the model's split."""
    low, high = BREAKDOWN_LAYERS
    runs = [(lay, depth) for lay in BREAKDOWN_LAYOUTS for depth in BREAKDOWN_LAYERS]
    times: list[list[float]] = [[] for _ in runs]
    for repeat in range(repeats):
        for k in range(len(runs)):
            i = (repeat + k) % len(runs)
            times[i] += measure_once(runs[i][0], steps, layers=runs[i][1])
            print(f"  repeat {repeat + 1}/{repeats} {short(runs[i][0]):<36} layers"
                  f" {runs[i][1]}: {statistics.median(times[i]) * 1e3:7.1f} ms", flush=True)
    measured = {run: statistics.median(t) for run, t in zip(runs, times, strict=True)}
    print(f"\n{'layout':<36} {'floor ms meas/model':>20} {'slope ms/layer meas/model':>26}"
          f"   model floor split (compute/comm/bubble)")
    for lay in BREAKDOWN_LAYOUTS:
        model = {d: predict(dataclasses.replace(MODEL, num_layers=d), lay, hardware,
                            seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, precision="fp32")
                 for d in BREAKDOWN_LAYERS}
        slope = (measured[lay, high] - measured[lay, low]) / (high - low)
        model_slope = (model[high].step_time_s - model[low].step_time_s) / (high - low)
        floor = measured[lay, low] - low * slope
        parts = [(getattr(model[high], k) * low - getattr(model[low], k) * high) / (low - high)
                 for k in ("compute_s", "exposed_comm_s", "bubble_s")]
        print(f"{short(lay):<36} {floor * 1e3:9.1f} /{sum(parts) * 1e3:7.1f}"
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
    parser.add_argument("--measured", type=Path,
                        help="a previous run's --json: predict its measured times again (with"
                             " --hardware, or its own profile) instead of training")
    args = parser.parse_args()
    if args.steps <= WARMUP_STEPS or args.repeats < 1:
        parser.error(f"--steps must exceed {WARMUP_STEPS} and --repeats be positive")
    for layout in LAYOUTS:  # fail before the long part
        layout.validate(MODEL, world_size=RANKS,
                                                  global_batch=GLOBAL_BATCH, seq_len=SEQ_LEN)
    saved = json.loads(args.measured.read_text()) if args.measured else None
    if args.hardware:
        hardware = load_hardware(args.hardware)
    elif saved:
        hardware = Hardware(**saved["hardware"])
    else:
        print(f"calibrating this machine at {RANKS} ranks:")
        hardware = calibrate_machine(ranks=RANKS, report=lambda line: print("  " + line))
    print(hardware.to_toml())
    if args.breakdown:
        return breakdown(hardware, args.repeats, args.steps)
    predicted = [predict(MODEL, lay, hardware, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                         precision="fp32") for lay in LAYOUTS]
    if saved:
        by_spec = {row["layout"]: row["measured_step_time_s"] for row in saved["rows"]}
        measured = [by_spec[lay.spec()] for lay in LAYOUTS]
    else:
        print(f"measuring {len(LAYOUTS)} layouts x {args.repeats} repeats x {args.steps}"
              " steps:")
        measured = measure_all(args.repeats, args.steps)
    summary = summarize(predicted, measured)
    print_table(predicted, measured, summary)
    if args.json:
        rows = [{"layout": lay.spec(), "measured_step_time_s": m,
                 **{k: getattr(p, k) for k in ("step_time_s", "compute_s", "exposed_comm_s",
                                               "bubble_s")}}
                for lay, p, m in zip(LAYOUTS, predicted, measured, strict=True)]
        args.json.write_text(json.dumps({"hardware": dataclasses.asdict(hardware), "rows": rows,
                                         "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
