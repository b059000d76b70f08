"""Fit a hardware profile to real training runs: the planner anchored to what meshtrain did.

A run directory holds what it ran (`config.toml`, the settings resolved) and how long each step
took (`metrics.jsonl`'s `step_time_s`). Each run is predicted with a starting profile, then two
factors are fitted to minimise the squared log error of the predicted median step times:

- `compute`: multiplies every compute rate (the matmul, memory and attention efficiencies) and
  divides the per-layer host overhead;
- `network`: multiplies the collectives' bandwidth (`network_efficiency`) and divides their
  latency; fitted only when the runs communicate differently (one run fits `compute` alone,
  communication then keeps the starting profile's price).

The overlap, the peaks and the memory of the starting profile are kept: the fitted profile
still names the device's peak, so MFU stays comparable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from meshtrain.config import run_config as config_mod
from meshtrain.errors import Code, SettingError
from meshtrain.planner.costs import predict
from meshtrain.planner.hardware import Hardware

WARMUP_STEPS = 2
"""Steps of a run not timed: the first builds caches (and compiles), the second settles."""
FACTOR_RANGE = (1 / 16, 16.0)
"""The fit looks for each factor in this range: outside it the runs and the profile describe
different machines."""


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """One run's layout and workload and its median step time after the warm-up."""

    path: Path
    ranks: int
    """The run's world size."""
    predict: Callable[[Hardware], float]
    """Predicted step time (s) of this run on a profile."""
    step_time_s: float


def read_run(path: str | Path) -> MeasuredRun:
    """The run in directory `path` (its config.toml and metrics.jsonl), an MoE run priced at
    its own measured expert imbalance (`measured_imbalance`)."""
    path = Path(path)
    config, metrics = path / "config.toml", path / "metrics.jsonl"
    if not config.is_file() or not metrics.is_file():
        raise SettingError(Code.FROM_RUN,
                           f"`from_run` {path} is not a run directory (no config.toml and"
                           " metrics.jsonl): give the `out` of a finished `meshtrain train`")
    cfg = config_mod.build_config(config_mod.load_toml(config), {})
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if isinstance(row, dict) and isinstance(row.get("step_time_s"), int | float):
            rows.append(row)
    times = [float(row["step_time_s"]) for row in rows]
    if len(times) <= WARMUP_STEPS:
        raise SettingError(Code.FROM_RUN,
                           f"`from_run` {path} has {len(times)} timed step(s): train at least"
                           f" {WARMUP_STEPS + 1} steps (the first {WARMUP_STEPS} are warm-up)")
    model = cfg.model_config(cfg.model.vocab_size)
    t, imbalance = cfg.train, measured_imbalance(rows[WARMUP_STEPS:])

    def predicted(hardware: Hardware) -> float:  # scaled to the run's ranks, as `plan` scales it
        return predict(model, cfg.plan, hardware.for_ranks(cfg.plan.world_size),
                       seq_len=t.seq_len, global_batch=t.global_batch,
                       precision=cfg.plan.precision, moe_imbalance=imbalance).step_time_s
    return MeasuredRun(path, cfg.plan.world_size, predicted,
                       statistics.median(times[WARMUP_STEPS:]))


def measured_imbalance(rows: list[dict]) -> float:
    """The median over `rows` (metrics.jsonl's) of max/mean tokens per expert; 1 where the
    run has no MoE layers."""
    ratios = [row["moe_tokens_per_expert_max"] / row["moe_tokens_per_expert_mean"]
              for row in rows if row.get("moe_tokens_per_expert_mean")]
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


def scaled(hardware: Hardware, compute: float, network: float) -> Hardware:
    """`hardware` with its compute rates x `compute` and its collectives x `network`."""
    h = hardware
    return dataclasses.replace(
        h, matmul_efficiency=h.matmul_efficiency * compute,
        memory_efficiency=h.memory_efficiency * compute,
        attention_efficiency=h.attention_efficiency * compute,
        layer_overhead_s=h.layer_overhead_s / compute,
        network_efficiency=h.network_efficiency * network,
        collective_latency_s=h.collective_latency_s / network)


def fit_runs(hardware: Hardware, runs: list[MeasuredRun],
             report: Callable[[str], None] | None = None) -> Hardware:
    """The profile whose predictions of `runs` err least (same name: the same machine)."""
    say = report or (lambda line: None)

    def loss(compute: float, network: float) -> float:
        h = scaled(hardware, compute, network)
        return sum(math.log(run.predict(h) / run.step_time_s) ** 2 for run in runs)

    network = 1.0
    if len({round(run.predict(scaled(hardware, 1e6, 1.0)) / run.predict(hardware), 3)
            for run in runs}) > 1:  # their communication shares differ: both can be told apart
        network = _golden(lambda n: loss(_golden(lambda c: loss(c, n)), n))
    compute = _golden(lambda c: loss(c, network))
    fitted = scaled(hardware, compute, network)
    for run in runs:
        before, after = run.predict(hardware), run.predict(fitted)
        say(f"{run.path}: measured {run.step_time_s * 1e3:.1f} ms, predicted"
            f" {before * 1e3:.1f} ms ({before / run.step_time_s - 1:+.0%}) -> {after * 1e3:.1f}"
            f" ms ({after / run.step_time_s - 1:+.0%})")
    say(f"fit: compute x{compute:.3g}, network x{network:.3g}")
    return fitted


def _golden(f: Callable[[float], float], tolerance: float = 1e-3) -> float:
    """The factor in FACTOR_RANGE minimising `f`, searched in log space (golden section)."""
    lo, hi = (math.log(x) for x in FACTOR_RANGE)
    ratio = (math.sqrt(5) - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = f(math.exp(a)), f(math.exp(b))
    while hi - lo > tolerance:
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = f(math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = f(math.exp(b))
    return math.exp((lo + hi) / 2)
