"""The planner against published Megatron-style runs: the validation table, or the fit of the
hardware profiles' efficiency parameters that produced the built-in values.

    PYTHONPATH=src python benchmarks/plan_vs_published.py        # the table (plan validate's)
    PYTHONPATH=src python benchmarks/plan_vs_published.py --fit  # fit each profile's values
    PYTHONPATH=src python benchmarks/plan_vs_published.py --fit --profile h100-80g  # one

The fit is per hardware profile, never per row: coordinate descent over coarse grids of
physically plausible values, minimising the sum of squared log errors (predicted / published
TFLOP/s) over the profile's rows. Each round first lets the search pick every row's layout under
the current values (as `plan` would), then tries each parameter's grid with those layouts fixed;
it stops when a round changes nothing. Parameters not fitted keep their defaults: overlap 1 (GPU
copies and compute run on separate engines), no per-layer host overhead, the small-matmul falloff.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.hardware import BUILT_IN, Hardware
from meshtrain.planner.published import (
    best_prediction,
    format_report,
    load_rows,
    predict_layout,
    published_tflops,
    tflops_in_convention,
    validate,
    validation_report,
)

GRIDS = {
    "matmul_efficiency": [round(0.5 + 0.025 * i, 3) for i in range(17)],
    "memory_efficiency": [round(0.3 + 0.1 * i, 1) for i in range(7)],
    "network_efficiency": [round(0.5 + 0.05 * i, 2) for i in range(11)],
    "collective_latency_s": [2e-6, 5e-6, 1e-5, 2e-5, 4e-5],
}
"""Large matmuls reach 50-90% of peak; elementwise kernels 30-90% of HBM bandwidth; collectives
50-100% of the link; one ring step 2-40 us (NVLink hop to InfiniBand hop)."""
MAX_ROUNDS = 4


def log_errors(rows: list[dict], layouts: list[ParallelPlan], hardware: Hardware) -> list[float]:
    """log(predicted / published) of each row at a fixed layout."""
    errors = []
    for row, layout in zip(rows, layouts, strict=True):
        step = predict_layout(row, layout, hardware).step_time_s
        errors.append(math.log(tflops_in_convention(row, step) / published_tflops(row, hardware)))
    return errors


def loss(rows: list[dict], layouts: list[ParallelPlan], hardware: Hardware) -> float:
    return sum(e * e for e in log_errors(rows, layouts, hardware))


def fit_profile(hardware: Hardware, rows: list[dict]) -> Hardware:
    """Coordinate descent over GRIDS; layouts re-searched at the start of each round."""
    for rnd in range(MAX_ROUNDS):
        layouts = [best_prediction(row, hardware).layout for row in rows]
        before = hardware
        for name, grid in GRIDS.items():
            trials = {value: loss(rows, layouts, dataclasses.replace(hardware, **{name: value}))
                      for value in grid}
            best = min(trials, key=trials.get)
            if trials[best] < loss(rows, layouts, hardware) - 1e-12:
                hardware = dataclasses.replace(hardware, **{name: best})
            print(f"  round {rnd}: {name} = {getattr(hardware, name):g}"
                  f" (loss {min(trials.values()):.4f})", flush=True)
        if hardware == before:
            break
    return hardware


def fit(only: str | None = None) -> dict[str, Hardware]:
    rows = load_rows()
    fitted = {}
    for name in sorted({row["hardware"] for row in rows} & ({only} if only else set(BUILT_IN))):
        own = [row for row in rows if row["hardware"] == name]
        print(f"{name}: {len(own)} rows", flush=True)
        fitted[name] = fit_profile(BUILT_IN[name], own)
    return fitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true",
                        help="fit the efficiency parameters per profile and print them")
    parser.add_argument("--profile", default=None, metavar="NAME",
                        help="with --fit, fit only this profile (the others keep theirs)")
    args = parser.parse_args()
    if not args.fit:
        print(validation_report())
        return
    fitted = fit(args.profile)
    print("\nFitted values (BUILT_IN in src/meshtrain/planner/hardware.py):")
    for name, hw in fitted.items():
        values = ", ".join(f"{p}={getattr(hw, p):g}" for p in GRIDS)
        print(f"  {name}: {values}")
    print()
    print(format_report(validate(fitted)))


if __name__ == "__main__":
    main()
