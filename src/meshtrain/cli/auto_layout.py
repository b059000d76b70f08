"""`meshtrain train --layout auto|SPEC`: the planner chooses the run's layout before any rank
starts.

Every rank (and the launching process) searches with the same inputs, so all reach the same
choice without communicating. Layout settings given as flags or in the TOML file are fixed in the
search, as the fields a spec names are.
"""

from __future__ import annotations

import dataclasses

from meshtrain.cli.units import memory_text
from meshtrain.config.run_config import RunConfig
from meshtrain.data.blend import load_data
from meshtrain.data.corpus import BYTE_VOCAB_SIZE
from meshtrain.errors import Code, SettingError
from meshtrain.parallel.runtime.plan import ParallelPlan, parse_spec, spec_key
from meshtrain.planner.costs import Prediction
from meshtrain.planner.hardware import Hardware, calibrated_path, device_profile, load_hardware
from meshtrain.planner.search import search
from meshtrain.planner.workload import ELEMENT_BYTES


def default_hardware(device: str, ranks: int | None = None) -> Hardware:
    """This machine's profile: the one `plan calibrate` measured of it at `ranks` ranks (at
    most its CUDA devices) where there is one, else the built-in profile of its CUDA device
    (unless `device` is cpu), else the CPU one."""
    import torch

    cuda = device != "cpu" and torch.cuda.is_available()
    if ranks is not None:
        local = min(ranks, torch.cuda.device_count()) if cuda else ranks
        measured = calibrated_path(machine_name(device), local)
        if measured.is_file():
            return load_hardware(str(measured))
    name = torch.cuda.get_device_name(0) if cuda else None
    hardware = device_profile(name)
    if hardware is None:
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"no built-in hardware profile matches the CUDA device {name!r}: pass"
                           " `hardware` FILE.toml (meshtrain plan calibrate writes one)")
    return hardware


def machine_name(device: str) -> str:
    """The name `plan calibrate` gives this machine's profiles (its device and backend), under
    which `default_hardware` finds them."""
    import torch

    return "cuda-nccl" if device != "cpu" and torch.cuda.is_available() else "cpu-gloo"


def fixed_fields(cfg: RunConfig, given: set[tuple[str, str]]) -> dict[str, object]:
    """The `layout` spec's fields and the plan's settings given (flags or TOML), by field name,
    which must agree."""
    spec = cfg.parallel.layout or "auto"
    fixed = {} if spec == "auto" else parse_spec(spec)
    for f in dataclasses.fields(ParallelPlan):
        value = getattr(cfg.plan, f.name)
        if (f.metadata["section"], f.name) not in given or value is None:
            continue
        if f.name in fixed and fixed[f.name] != value:
            raise SettingError(Code.LAYOUT_AUTO,
                               f"`{f.name}` {value} contradicts `layout`"
                               f" {spec_key(f)}={fixed[f.name]}: give it once")
        fixed[f.name] = value
    return fixed


def choose_layout(cfg: RunConfig, world_size: int, given: set[tuple[str, str]]) -> str:
    """Search the run's layout on `world_size` devices, set its settings from the fastest that
    fits, and say what was chosen and why."""
    p, t = cfg.parallel, cfg.train
    if cfg.plan.precision not in ELEMENT_BYTES:
        raise SettingError(Code.LAYOUT_AUTO,
                           f"`layout` auto plans {', '.join(ELEMENT_BYTES)} runs, not `precision`"
                           f" {cfg.plan.precision}: give the layout settings yourself")
    for name in ("pp_layers", "recompute_layers"):
        if getattr(cfg.plan, name) is not None:
            raise SettingError(Code.LAYOUT_AUTO,
                               f"`{name}` belongs to one layout: drop it with `layout` (the"
                               " planner splits layers evenly and recomputes all or none)")
    hardware = load_hardware(p.hardware) if p.hardware else default_hardware(p.device,
                                                                             world_size)
    d = cfg.data
    vocab = cfg.model.vocab_size or (BYTE_VOCAB_SIZE if d.data is None and d.data_path is None
                                     else load_data(d.data, d.data_path).vocab_size)
    model = cfg.model_config(vocab)
    result = search(model, hardware, gpus=world_size, seq_len=t.seq_len,
                    global_batch=t.global_batch, precision=cfg.plan.precision,
                    fixed=fixed_fields(cfg, given))
    best = result.best()
    cfg.plan = best.layout
    lines = [f"`layout` {p.layout} chose {short_spec(best.layout, result.base)} for"
             f" {world_size} rank(s) on"
             f" {hardware.name}: {describe(best)}"]
    if len(result.ranked) > 1:
        second = result.ranked[1]
        slower = second.step_time_s / best.step_time_s - 1
        lines.append(f"runner-up {short_spec(second.layout, result.base)}:"
                     f" {second.step_time_s:.4g} s a step"
                     f" ({slower:+.2%}), {memory_text(second.memory_gib)} per rank")
    return "\n".join([lines[0], *(f"  {line}" for line in lines[1:] + result.warnings)])


def describe(prediction: Prediction) -> str:
    p = prediction
    return (f"predicted {p.step_time_s:.4g} s a step (compute {p.compute_s:.4g}, exposed"
            f" communication {p.exposed_comm_s:.4g}, bubble {p.bubble_s:.4g}), {p.mfu:.1%} MFU,"
            f" {memory_text(p.memory_gib)} per rank")


def short_spec(layout: ParallelPlan, reference: ParallelPlan | None = None) -> str:
    """The degrees and micro-batch, then only the fields off their defaults (the others: off
    `reference`'s): a `--layout` spec that fixes what matters of this layout."""
    default = dict(ParallelPlan().spec_items())
    return ",".join(f"{key}={value}" for key, value in layout.spec_items(reference)
                    if key in ("tp", "pp", "dp", "mb") or default.get(key) != value)
