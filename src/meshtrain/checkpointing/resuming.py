"""Which checkpoint a run continues from, and the rules a resumed run's settings must follow.

`resume` demands a checkpoint; `auto_resume` takes the newest complete one when there is one
and starts fresh otherwise (what restarted workers need). Both follow the `latest` pointer, or,
when it is missing or damaged, the newest checkpoint that verifies whole (`repair_latest`). The
run's end (`stop_at`, else `steps`) must lie past the checkpoint's step, except that
`auto_resume` at exactly that step means the run is complete. A changed `steps` or
learning-rate setting is allowed and announced: the schedule follows the new values from the
resumed step on. So is changed data (`data`, `data_path`): each step's batch depends only on
the seed, the step and the data, so the steps from the resumed one on draw from the new data, as
Megatron-LM continues a changed `--data-path` from the samples already consumed (how a later
phase, such as an annealing mix, is trained).

A resumed run carries the settings saved with its checkpoint (config.toml: model, steps,
schedule, optimizer, data, precision, logging) unless a flag or the `config` file gives one
(`carried_settings`). The layout is carried whole only when no degree and no `nproc` is given:
a run resumed on another number of ranks or degrees gets today's defaults for the layout (degrees
not given are 1, dp fills the world), so resharding stays one flag. What a resumed run changes
against its saved settings is announced (`changed_settings`).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from meshtrain.checkpointing.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    point_latest_at,
    read_manifest,
)
from meshtrain.checkpointing.retention import checkpoint_age
from meshtrain.checkpointing.verify import STEP_NAME
from meshtrain.config.run_config import RunConfig
from meshtrain.config.settings import model_arg_key
from meshtrain.errors import Code, SettingError
from meshtrain.parallel.runtime.optim import LR_SCHEDULE_SETTINGS

SCHEDULE_SETTINGS = ("steps", *LR_SCHEDULE_SETTINGS)
DATA_SETTINGS = ("data", "data_path")
NOT_CARRIED = {("checkpoint", "out"), ("checkpoint", "resume"), ("checkpoint", "auto_resume"),
               ("checkpoint", "init_from"), ("train", "stop_at"), ("parallel", "nproc"),
               ("parallel", "layout"), ("parallel", "max_restarts")}
"""How this invocation runs, never what the run is: always the command's own."""
DEGREES = ("nproc", "tp", "pp", "dp", "cp", "ep", "tp_depth", "virtual_stages")
"""Given any of these, the saved layout ([parallel]'s plan settings) is not carried."""


def repair_latest(root: Path) -> str | None:
    """When `latest` in `root` is missing or damaged but complete checkpoints are there: point it
    at the newest one that verifies whole (hashes included) and return the line saying so, so a
    resume never starts over beside saved work. None when `latest` is sound or nothing verifies
    (a damaged pointer is then refused as before)."""
    if not root.is_dir():
        return None
    try:
        if latest_checkpoint(root) is not None:
            return None
        why = "missing"
    except CheckpointError as damage:
        why, refusal = "damaged", damage
    else:
        refusal = None
    if (candidate := _newest_complete(root)) is not None:
        point_latest_at(candidate)
        return (f"{root / 'latest'} was {why}: resuming from {candidate.name}, the newest"
                " complete checkpoint (the latest pointer now names it)")
    if refusal is not None:
        raise refusal
    return None


def _newest_complete(root: Path) -> Path | None:
    """The newest checkpoint in `root` whose metadata verifies (files hashed), or None."""
    for candidate in sorted(_step_dirs(root), key=lambda d: checkpoint_age(d.name),
                            reverse=True):
        try:
            read_manifest(candidate)
        except CheckpointError:
            continue
        return candidate
    return None


def saved_settings(out: Path) -> dict[str, dict] | None:
    """The config.toml tables of the checkpoint a resume into `out` takes (`latest`, else the
    newest complete one); None without one, or when it is unreadable (then `read_manifest`
    refuses the checkpoint where the resume is checked)."""
    root = out / "checkpoints"
    if not root.is_dir():
        return None
    try:
        path = latest_checkpoint(root)
    except CheckpointError:
        path = None
    path = path or _newest_complete(root)
    try:
        return tomllib.loads((path / "config.toml").read_text()) if path else None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None


def carried_settings(saved: dict[str, dict], given: set[tuple[str, str]],
                     settings: set[tuple[str, str]], layout: set[str]) -> dict[str, dict]:
    """The saved tables a resumed run starts from, below its `config` file and flags: every
    known setting (`settings`, as (table, name)) that was not `given` (a model setting given
    through `model_arg` counts), except `NOT_CARRIED`, the `layout` settings of [parallel] when
    a degree or `nproc` is given, and [model] when `model` is (its shape settings are the saved
    preset's); saved `model_arg` items keep only the keys not given."""
    keep_layout = not any(name in DEGREES for _, name in given)
    tables: dict[str, dict] = {}
    for section, values in saved.items():
        if section == "model" and ("model", "model") in given:
            continue  # another model: none of the saved one's settings
        for name, value in values.items() if isinstance(values, dict) else ():
            key = (section, name)
            if key not in settings or key in given or key in NOT_CARRIED:
                continue
            if section == "parallel" and name in layout and not keep_layout:
                continue
            if key == ("model", "model_arg"):
                value = [item for item in value if ("model", model_arg_key(item)) not in given]
                if not value:
                    continue
            tables.setdefault(section, {})[name] = value
    return tables


def changed_settings(saved: dict[str, dict], resolved: dict[str, dict]) -> str | None:
    """The line naming the settings this resumed run runs differently from its checkpoint's
    (schedule and data changes have their own lines: `changes`); None when none differ."""
    skip = NOT_CARRIED | {("train", n) for n in SCHEDULE_SETTINGS} | \
        {("data", n) for n in DATA_SETTINGS}
    changed = [f"`{name}` {saved[section][name]} -> {value}"
               for section, values in resolved.items() for name, value in values.items()
               if (section, name) not in skip and name in saved.get(section, {})
               and saved[section][name] != value]
    return f"changed from the checkpoint's settings: {', '.join(changed)}" if changed else None


def _step_dirs(root: Path) -> list[Path]:
    return [d for d in root.iterdir()
            if STEP_NAME.fullmatch(d.name) and d.is_dir() and not d.is_symlink()]


class RunComplete(Exception):
    """`auto_resume` found the run already finished; `str(self)` is the line to print."""


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint holds, from its verified metadata."""
    return int(read_manifest(path, verify_files=False)["step"])


def checkpoint_to_resume(cfg: RunConfig) -> tuple[Path, int] | None:
    """(checkpoint, its step) this run continues from; None to start fresh. Raises ValueError
    for a resume the settings forbid and RunComplete when there is nothing left to do."""
    c = cfg.checkpoint
    if not (c.resume or c.auto_resume):
        return None
    out = Path(c.out)
    path = latest_checkpoint(out / "checkpoints") if (out / "checkpoints").is_dir() else None
    if path is None:
        if c.resume:
            raise SettingError(Code.RESUME_NO_CHECKPOINT, f"`resume`: no checkpoint in {out}; start"
                               " without `resume`, or use `auto_resume` to start fresh when"
                               " there is none")
        return None
    step = checkpoint_step(path)
    t = cfg.train
    end = t.stop_at or t.steps
    if step < end:
        return path, step
    if step == end and c.auto_resume:
        raise RunComplete(f"{out} is complete: its checkpoint {path.name} is at step {step}, the"
                          " run's end; nothing to do")
    name = "steps" if t.steps <= step else "stop_at"
    raise SettingError(Code.RESUME_STEPS, f"`{name}` {getattr(t, name)} is at or below the step of"
                       f" the checkpoint to resume ({path.name}, step {step}): raise `{name}` past"
                       f" {step} to train on")


def changes(cfg: RunConfig, path: Path, step: int) -> list[str]:
    """The lines announcing changed schedule and data settings against the checkpoint's
    config.toml (none when nothing changed or the checkpoint has no config)."""
    try:
        saved = tomllib.loads((path / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []
    train, lines, tables = saved.get("train", {}), [], cfg.to_dict()
    # a schedule setting an older config lacks is not compared; data settings left out were unset
    schedule = _changed(train, tables["train"],
                        [name for name in SCHEDULE_SETTINGS if name in train])
    if schedule:
        values = "value" if len(schedule) == 1 else "values"
        lines.append(f"{', '.join(schedule)} on resume: the learning-rate schedule follows the"
                     f" new {values} from step {step} on")
    if data := _changed(saved.get("data", {}), tables["data"], DATA_SETTINGS):
        lines.append(f"{', '.join(data)} on resume: the batches from step {step} on are drawn"
                     " from the new data")
    return lines


def _changed(saved: dict, current: dict, names) -> list[str]:
    """"`name` changed from OLD to NEW" for each of `names` whose value in `current` (a table of
    `RunConfig.to_dict`) differs from the saved one (a list as its items joined by spaces, as
    flags take it)."""
    def shown(value) -> str:
        return "unset" if value is None else " ".join(value) if isinstance(value, list) \
            else str(value)

    return [f"`{name}` changed from {shown(saved.get(name))} to {shown(current[name])}"
            for name in names if saved.get(name) != current[name]]
