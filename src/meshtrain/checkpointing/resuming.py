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

SCHEDULE_SETTINGS = ("steps", "lr", "min_lr", "warmup_steps", "lr_schedule", "lr_decay_fraction")
DATA_SETTINGS = ("data", "data_path")


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
    for candidate in sorted(_step_dirs(root), key=lambda d: checkpoint_age(d.name),
                            reverse=True):
        try:
            read_manifest(candidate)
        except CheckpointError:
            continue
        point_latest_at(candidate)
        return (f"{root / 'latest'} was {why}: resuming from {candidate.name}, the newest"
                " complete checkpoint (the latest pointer now names it)")
    if refusal is not None:
        raise refusal
    return None


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
            raise ValueError(f"`resume`: no checkpoint in {out}; start without `resume`, or use"
                             " `auto_resume` to start fresh when there is none")
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
    raise ValueError(f"`{name}` {getattr(t, name)} is at or below the step of the checkpoint"
                     f" to resume ({path.name}, step {step}): raise `{name}` past {step} to"
                     " train on")


def changes(cfg: RunConfig, path: Path, step: int) -> list[str]:
    """The lines announcing changed schedule and data settings against the checkpoint's
    config.toml (none when nothing changed or the checkpoint has no config)."""
    try:
        saved = tomllib.loads((path / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []
    train, lines = saved.get("train", {}), []
    # a schedule setting an older config lacks is not compared; data settings left out were unset
    schedule = _changed(train, cfg.train, [name for name in SCHEDULE_SETTINGS if name in train])
    if schedule:
        values = "value" if len(schedule) == 1 else "values"
        lines.append(f"{', '.join(schedule)} on resume: the learning-rate schedule follows the"
                     f" new {values} from step {step} on")
    if data := _changed(saved.get("data", {}), cfg.data, DATA_SETTINGS):
        lines.append(f"{', '.join(data)} on resume: the batches from step {step} on are drawn"
                     " from the new data")
    return lines


def _changed(saved: dict, settings, names) -> list[str]:
    """"`name` changed from OLD to NEW" for each of `names` whose value differs from the saved
    one (a list as its items joined by spaces, as flags take it)."""
    def shown(value) -> str:
        return "unset" if value is None else " ".join(value) if isinstance(value, list) \
            else str(value)

    return [f"`{name}` changed from {shown(saved.get(name))} to {shown(getattr(settings, name))}"
            for name in names if saved.get(name) != getattr(settings, name)]
