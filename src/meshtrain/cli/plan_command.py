"""`meshtrain plan`: rank a model's layouts on N devices and give the command that trains each;
`plan calibrate` measures this machine into a hardware file; `plan validate` compares the cost
model with published runs.

Library messages name settings in backticks; this module prints them through `cli.as_flags`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from meshtrain.cli.auto_layout import default_hardware, machine_name, short_spec
from meshtrain.cli.flags import as_flags
from meshtrain.cli.units import count_text, memory_unit
from meshtrain.config import run_config as config_mod
from meshtrain.config import settings
from meshtrain.data.corpus import write_atomic
from meshtrain.errors import Code, SettingError
from meshtrain.machine_fit import available_host_bytes
from meshtrain.models import TransformerConfig, preset
from meshtrain.operations.failures import writing
from meshtrain.parallel.runtime.plan import SPEC_FIELDS, ParallelPlan, parse_spec
from meshtrain.planner.costs import Prediction, predict
from meshtrain.planner.hardware import (
    BUILT_IN,
    UNFITTED,
    Hardware,
    calibrated_path,
    load_hardware,
)
from meshtrain.planner.search import OVER_BUDGET, SearchResult, check_gpus, search
from meshtrain.planner.workload import ELEMENT_BYTES, MOE_IMBALANCE

EXAMPLES = 3
"""Rejected layouts shown per reason with --explain."""


@dataclasses.dataclass(frozen=True)
class Request:
    """What to plan: the model (and the flags that made it), devices, batch, precision."""

    model: TransformerConfig
    model_flags: list[str]
    hardware: Hardware
    hardware_given: bool  # False: this machine's profile, which the header names as such
    gpus: int
    seq_len: int
    global_batch: int
    precision: str
    moe_imbalance: float | None = None  # None: the default assumption, `MOE_IMBALANCE`


def cmd_plan(args: argparse.Namespace) -> int:
    if args.plan_command == "calibrate":
        return _calibrate(args)
    if args.plan_command == "validate":
        from meshtrain.planner.published import validation_report

        print(validation_report())
        return 0
    request = _request(args)
    started = time.perf_counter()
    result = search(request.model, request.hardware, gpus=request.gpus,
                    seq_len=request.seq_len, global_batch=request.global_batch,
                    precision=request.precision, fixed=_fixed(args),
                    cost=functools.partial(predict, moe_imbalance=request.moe_imbalance
                                           or MOE_IMBALANCE))
    seconds = time.perf_counter() - started
    if not result.ranked:
        if args.explain and not args.json:
            print("\n".join(explain(result, request)))
        _none_fits(result, request)
    shown = result.ranked[:args.top]
    if args.json:
        print(json.dumps(to_json(request, result, shown, explain=args.explain)))
    else:
        print("\n".join(table(request, result, shown, seconds)))
        if args.explain:
            print("\n".join(["", *explain(result, request)]))
    for warning in result.warnings:
        print(f"meshtrain: warning: {as_flags(warning)}", file=sys.stderr)
    return 0


def _none_fits(result: SearchResult, request: Request) -> None:
    """Raise why no layout fits, naming the hardware planned for and how to choose another."""
    hw = request.hardware
    try:
        result.best()
    except ValueError as why:
        mine = "" if request.hardware_given else ", this machine's profile"
        code = why.code if isinstance(why, SettingError) else Code.NO_LAYOUT_FITS
        raise SettingError(code, f"{why}; planned for {request.gpus} x {hw.name} ({hw.hbm_gib:g}"
                           f" GiB each{mine}): choose the devices you will train on with"
                           f" `hardware` ({', '.join(BUILT_IN)} or a calibrated FILE.toml) or plan"
                           " more `gpus`") from None


def _request(args: argparse.Namespace) -> Request:
    if args.gpus is None:
        raise SettingError(Code.SETTING_MISSING,
                           "`gpus` is required: the number of devices to plan for")
    check_gpus(args.gpus)  # before this machine's profile is scaled to them
    for name in ("top", "seq_len", "global_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SettingError(Code.RANGE,
                               f"`{name}` must be positive, got {getattr(args, name)}")
    fields = {f.name: f for f in dataclasses.fields(settings.ModelSettings)}
    given = {name: config_mod.coerce_setting(key, fields[name], value)
             for key, value in vars(args).items() if key.startswith("model.")
             for name in [key.split(".", 1)[1]]}
    cfg = config_mod.RunConfig(model=settings.ModelSettings(**given))
    base = preset(cfg.model.model or config_mod.DEFAULT_PRESET)
    seq_len = args.seq_len if args.seq_len is not None else \
        cfg.model.max_seq_len or base.max_seq_len
    cfg.train.seq_len, cfg.train.global_batch = seq_len, args.global_batch
    model = cfg.model_config(cfg.model.vocab_size or base.vocab_size)
    if seq_len > model.max_seq_len:
        raise SettingError(Code.SEQ_LEN_MAX,
                           f"`seq_len` {seq_len} exceeds `max_seq_len` {model.max_seq_len}:"
                           " raise `max_seq_len` or shorten `seq_len`")
    hardware = load_hardware(args.hardware) if args.hardware is not None else \
        default_hardware("auto", args.gpus)
    precision = args.precision if args.precision is not None else hardware.default_precision
    if precision == "fp8":  # bf16 parameters, float8 matmuls (`_fixed`)
        precision = "bf16"
    if precision not in ELEMENT_BYTES:
        raise SettingError(Code.CHOICE,
                           f"`precision` must be one of {', '.join(ELEMENT_BYTES)} or fp8, got"
                           f" {precision!r}")
    return Request(model, _model_flags(given, model), hardware, bool(args.hardware), args.gpus,
                   seq_len, args.global_batch, precision, _moe_imbalance(args, model))


def _fixed(args: argparse.Namespace) -> dict[str, object]:
    """The `--layout` spec's fields; `--precision fp8` is bf16 with `fp8` tensorwise unless the
    spec names a recipe (the planner prices float8 matmuls through the layout's `fp8`)."""
    fixed = parse_spec(args.layout)
    if args.precision == "fp8":
        fixed.setdefault("fp8", "tensorwise")
    return fixed


def _moe_imbalance(args: argparse.Namespace, model: TransformerConfig) -> float | None:
    value = getattr(args, "moe_imbalance", None)
    if value is not None and not model.moe_experts:
        raise SettingError(Code.MODEL_UNSUPPORTED, "`moe_imbalance` prices MoE layers, and the"
                                                   " model has none: drop it")
    if value is not None and not 1 <= value < math.inf:
        raise SettingError(Code.RANGE, f"`moe_imbalance` is a max/mean expert load, a finite"
                                       f" number >= 1, got {value}")
    return value


def _model_flags(given: dict[str, object], model: TransformerConfig) -> list[str]:
    """The model flags as given, plus the planned vocabulary (train's default is the data's)."""
    fields = {f.name: f for f in dataclasses.fields(settings.ModelSettings)}
    flags = []
    for name, value in {**given, "vocab_size": model.vocab_size}.items():
        flag = fields[name].metadata.get("flag", "--" + name.replace("_", "-"))
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        flags += [flag] if value is True else [flag, text]
    return flags


def train_command(request: Request, prediction: Prediction) -> str:
    """The command that trains this layout: `meshtrain train --nproc N` within one node, else
    torchrun on every node (the ranks a node holds: the largest divisor of the devices that
    fits in one); for a layout only priced (`zero_impl` deepspeed), why there is none."""
    lay, hw = prediction.layout, request.hardware
    try:
        lay.check_trainable()
    except SettingError as e:
        return f"(no command: {as_flags(str(e))})"
    flags = [*request.model_flags, "--seq-len", str(request.seq_len), "--global-batch",
             str(request.global_batch), "--precision", lay.precision]
    for key, text in lay.spec_items(ParallelPlan(precision=lay.precision)):
        name = SPEC_FIELDS[key].name
        flag, value = "--" + name.replace("_", "-"), getattr(lay, name)
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags += [flag, text]
    args = " ".join(shlex.quote(f) for f in flags)
    if request.gpus <= hw.gpus_per_node:
        return f"meshtrain train --nproc {request.gpus} {args}"
    per_node = max(d for d in range(1, hw.gpus_per_node + 1) if request.gpus % d == 0)
    return (f"torchrun --nnodes {request.gpus // per_node} --nproc-per-node {per_node}"
            f" --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m meshtrain train {args}")


COLUMNS = ("#", "step s", "compute", "comm", "bubble", "TFLOP/s", "MFU", "GiB", "params",
           "grads", "optim", "activ", "buffers")


def table(request: Request, result: SearchResult, shown: list[Prediction],
          seconds: float) -> list[str]:
    """The header, then per layout one row of numbers and its command; a space at least
    before each cell (a small model's seconds, 0.000953, fill their column)."""
    hw, m = request.hardware, request.model
    fit = sum(p.memory_gib <= hw.hbm_gib for p in result.ranked)
    over = len(result.ranked) - fit + len(result.rejected.get(OVER_BUDGET, ()))
    invalid = sum(len(items) for reason, items in result.rejected.items()
                  if reason != OVER_BUDGET)
    mine = "" if request.hardware_given else "; this machine's profile, no --hardware given"
    if hw.name in UNFITTED:
        mine += "; data-sheet peaks, efficiencies not fitted to any run of it"
    if hw.calibrated_ranks:
        mine += f"; measured with {hw.calibrated_ranks} ranks sharing the machine"
        if hw.name.startswith("cpu") and hw.calibrated_ranks != request.gpus:
            mine += f" (`plan calibrate --ranks {request.gpus}` measures {request.gpus})"
    unit, scale = memory_unit(max((p.memory_gib for p in shown), default=1.0))
    lines = [f"{' '.join(request.model_flags)}: {count_text(m.num_parameters())} parameters,"
             f" seq {request.seq_len}, global batch {request.global_batch}, {request.precision}",
             f"on {request.gpus} x {hw.name} ({hw.hbm_gib:g} GiB,"
             f" {hw.peak_for(request.precision):g} TFLOP/s peak, {hw.gpus_per_node} per"
             f" node{mine}):"
             f" {fit + over + invalid} layout(s) considered in {seconds:.1f} s: {fit} fit,"
             f" {over} over memory, {invalid} invalid (--explain: why)", ""]
    widths = [3, 9, 9, 8, 8, 9, 7, 7, 8, 7, 7, 7, 8]
    columns = [unit if c == "GiB" else c for c in COLUMNS]
    lines.append("".join((" " + c).rjust(w) for c, w in zip(columns, widths, strict=True))
                 + f"  layout (step s = compute + comm + bubble; {unit} = params + ... +"
                   " buffers)")
    for rank, p in enumerate(shown, 1):
        gib = p.memory.gib()
        cells = [str(rank), f"{p.step_time_s:.4g}", f"{p.compute_s:.4g}",
                 f"{p.exposed_comm_s:.3g}", f"{p.bubble_s:.3g}",
                 f"{p.tflops_per_gpu:.1f}" if p.tflops_per_gpu >= 1 else f"{p.tflops_per_gpu:.2g}",
                 f"{p.mfu:.1%}", f"{p.memory_gib * scale:.1f}",
                 *(f"{gib[k] * scale:.1f}" for k in ("parameters", "gradients", "optimizer_states",
                                             "activations", "buffers"))]
        lines.append("".join((" " + c).rjust(w) for c, w in zip(cells, widths, strict=True))
                     + f"  {short_spec(p.layout, result.base)}")
        lines.append(f"     {train_command(request, p)}")
    return lines


def explain(result: SearchResult, request: Request) -> list[str]:
    """The attention mask the costs assume, then rejected layouts by reason, most frequent
    first, each with a few examples."""
    m, s = request.model, request.seq_len
    span = m.attention_span(s)
    where = f" on layers {m.window_start_layer}-{m.num_layers - 1} of {m.num_layers}" \
        if m.window_start_layer else ""
    lines = [f"attention: sliding window {m.sliding_window}{where} of sequence {s}: attention"
             f" FLOPs {span / s:.3g} of the causal mask's" if span < s else
             f"attention: causal over the whole sequence ({s})", *_moe_lines(request),
             "rejected layouts by reason:"]
    for reason, items in sorted(result.rejected.items(), key=lambda kv: -len(kv[1])):
        lines.append(f"  {reason}: {len(items)}")
        for r in _examples(reason, items):
            lines.append(f"    {short_spec(r.layout, result.base)}: {as_flags(r.detail)}")
    return lines


def _moe_lines(request: Request) -> list[str]:
    """The MoE shape and load the costs assume (`Workload.expert_load`)."""
    m = request.model
    if not m.moe_experts:
        return []
    shared = f"a shared expert of width {m.moe_shared_ffn_size} (gate: {m.moe_shared_gate})" \
        if m.moe_shared_ffn_size else "no shared expert"
    rows = "dropless: all k rows a token" if not m.moe_capacity_factor else \
        f"capacity factor {m.moe_capacity_factor:g}: all k rows a token, the busiest rank's" \
        " at most that factor x the mean"
    load = f"{request.moe_imbalance:g} (--moe-imbalance)" if request.moe_imbalance else \
        f"{MOE_IMBALANCE:g} (assumed, balanced; --moe-imbalance X or a run's" \
        " moe_tokens_per_expert_max / _mean)"
    return [f"MoE: {m.moe_pattern.describe(m.num_layers)}, {m.moe_experts} experts of width"
            f" {m.expert_ffn_size}, top-{m.moe_top_k}, {shared}; {rows}",
            f"MoE load: the busiest expert-parallel rank's rows priced at max/mean expert load"
            f" {load}"]


def _examples(reason: str, items: list) -> list:
    """The closest misses for memory, else the first few."""
    return sorted(items, key=lambda r: r.over_gib)[:EXAMPLES] if reason == OVER_BUDGET \
        else items[:EXAMPLES]


def to_json(request: Request, result: SearchResult, shown: list[Prediction], *,
            explain: bool) -> dict:
    out = {"model": {"parameters": request.model.num_parameters(),
                     "flags": request.model_flags},
           "gpus": request.gpus, "hardware": request.hardware.name,
           "precision": request.precision, "seq_len": request.seq_len,
           "global_batch": request.global_batch, "evaluated": result.evaluated,
           "layouts": [_json_layout(request, result, p) for p in shown],
           "warnings": result.warnings}
    if explain:
        out["rejected"] = {reason: {"count": len(items), "examples": [
            {"layout": r.layout.searched_view(), "detail": r.detail}
            for r in _examples(reason, items)]} for reason, items in result.rejected.items()}
    return out


def _json_layout(request: Request, result: SearchResult, p: Prediction) -> dict:
    memory = p.memory.gib()
    return {"layout": p.layout.searched_view(), "spec": p.layout.spec(result.base),
            "step_time_s": p.step_time_s, "compute_s": p.compute_s,
            "exposed_comm_s": p.exposed_comm_s, "bubble_s": p.bubble_s,
            "tflops_per_gpu": p.tflops_per_gpu, "mfu": p.mfu, "memory_gib": memory.pop("total"),
            "memory": memory, "command": train_command(request, p)}


RANK_BYTES = 512 * 2**20  # one measuring process: the interpreter, torch and its buffers


def _most_ranks() -> int:
    """The processes `calibrate` can start at once: as many as MemAvailable holds (where it
    is not known, 64 per core)."""
    available = available_host_bytes()
    if available is None:
        return 64 * (os.cpu_count() or 1)
    return max(2, available // RANK_BYTES)


def _check_profile_out(out: Path) -> None:
    """`calibrate --out`: a .toml file that can be written where it is named."""
    if out.suffix != ".toml":
        raise SettingError(Code.OUT_PATH,
                           f"`out` {out} must be a .toml file (`hardware` reads it)")
    if out.is_dir():
        raise SettingError(Code.OUT_PATH, f"`out` {out} is a directory: name a .toml file in it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SettingError(Code.OUT_PATH, f"`out` {out}: its folder cannot be created"
                                          f" ({e.strerror or e})") from None
    if not os.access(out.parent, os.W_OK):
        raise SettingError(Code.OUT_PATH, f"`out` {out}: its folder is not writable")


def _calibrate(args: argparse.Namespace) -> int:
    from meshtrain.planner.calibrate import calibrate_machine, check_physical
    from meshtrain.planner.run_fit import fit_runs, read_run

    def report(line: str) -> None:
        print(f"meshtrain: {line}", flush=True)

    if args.ranks < 2 and not args.from_run:
        raise SettingError(Code.RANGE,
                           f"`ranks` must be at least 2 (collectives need a group), got"
                           f" {args.ranks}")
    most = _most_ranks()  # (on a GPU also the devices: calibrate's check)
    if args.ranks > most and not args.from_run:
        raise SettingError(Code.RANGE,
                           f"`ranks` {args.ranks} is more processes than this machine's memory"
                           f" holds at once ({RANK_BYTES // 2**20} MiB each): give at most {most}")
    if args.hardware is not None and not args.from_run:
        raise SettingError(Code.CHOICE,
                           "`hardware` names the profile --from-run fits; a measurement starts"
                           " from none: drop `hardware` or add --from-run")
    if args.out == "":
        raise SettingError(Code.OUT_PATH, "`out` is empty: name a .toml file (or omit `out` for"
                                          " this machine's profile)")
    out = Path(args.out) if args.out is not None else None
    if out is not None:  # checked before minutes of measuring are spent
        _check_profile_out(out)
    ranks = args.ranks
    if args.from_run:
        runs = [read_run(run) for run in args.from_run]  # every run read before the fit
        if len({run.ranks for run in runs}) == 1:  # kept as this machine's at their ranks
            ranks = runs[0].ranks
        base = load_hardware(args.hardware) if args.hardware else \
            default_hardware("auto", ranks)
        hardware = fit_runs(base, runs, report=report)
    else:
        report(f"measuring this machine with {ranks} ranks at once (about 40 s)")
        hardware = calibrate_machine(ranks=ranks, report=report)
    check_physical(hardware)
    report(_profile_summary(hardware))
    if out is None:
        out = calibrated_path(machine_name("auto"), ranks)
        out.parent.mkdir(parents=True, exist_ok=True)
    with writing(out):
        write_atomic(out, hardware.to_toml().encode())
    print(f"meshtrain: wrote {out}; plan with it: meshtrain plan --hardware {out} --gpus N")
    return 0


def _profile_summary(hw: Hardware) -> str:
    """The fitted profile in one line: the numbers the planner's costs rest on."""
    return (f"profile {hw.name}: peak {hw.peak_for('fp32'):.3g} TFLOP/s fp32,"
            f" {hw.peak_for('bf16'):.3g} bf16; matmul_efficiency {hw.matmul_efficiency:.3g};"
            f" memory {hw.hbm_gbytes_per_s:.3g} GB/s; links {hw.intra_node_gbytes_per_s:.3g}"
            f" GB/s, collective_latency_s {hw.collective_latency_s:.3g};"
            f" {hw.hbm_gib:.3g} GiB per rank")
