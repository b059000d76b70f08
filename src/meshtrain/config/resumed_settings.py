"""The rules a resumed run's settings follow against those saved with its checkpoint.

A resumed run carries the settings saved with its checkpoint (config.toml: model, steps,
schedule, optimizer, data, precision, logging) unless a flag or the `config` file gives one
(`carried_settings`). The layout is carried whole only when no degree and no `nproc` is given:
a run resumed on another number of ranks or degrees gets today's defaults for the layout (degrees
not given are 1, dp fills the world), so resharding stays one flag. What a resumed run changes
against its saved settings is announced (`changed_settings`). A changed `steps` or learning-rate
setting is allowed and announced: the schedule follows the new values from the resumed step on.
So is changed data (`data`, `data_path`): each step's batch depends only on the seed, the step
and the data, so the steps from the resumed one on draw from the new data, as Megatron-LM
continues a changed `--data-path` from the samples already consumed (how a later phase, such as
an annealing mix, is trained) (`changes`).

Settings are config's: which checkpoint a run resumes from is `checkpointing.resuming`'s, and
neither package imports the other (the command line joins them).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from meshtrain.config.run_config import RunConfig
from meshtrain.config.settings import model_arg_key
from meshtrain.parallel.runtime.optim import LR_SCHEDULE_SETTINGS

SCHEDULE_SETTINGS = ("steps", *LR_SCHEDULE_SETTINGS)
DATA_SETTINGS = ("data", "data_path")
NOT_CARRIED = {("checkpoint", "out"), ("checkpoint", "resume"), ("checkpoint", "auto_resume"),
               ("checkpoint", "init_from"), ("train", "stop_at"), ("parallel", "nproc"),
               ("parallel", "layout"), ("parallel", "max_restarts"),
               *(("parallel", name) for name in ("fault_tolerance", "replica_groups",
                                                 "min_replica_groups", "replica_group_id",
                                                 "lighthouse"))}
"""How this invocation runs, never what the run is: always the command's own."""
DEGREES = ("nproc", "tp", "pp", "dp", "cp", "ep", "etp", "tp_depth", "virtual_stages")
"""Given any of these, the saved layout ([parallel]'s plan settings) is not carried."""


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
