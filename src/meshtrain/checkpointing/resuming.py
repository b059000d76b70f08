"""Which checkpoint a run continues from, and the rules a resumed run's settings must follow.

`resume` demands a checkpoint; `auto_resume` takes the newest complete one when there is one
and starts fresh otherwise (what restarted workers need). The run's end (`stop_at`, else
`steps`) must lie past the checkpoint's step, except that `auto_resume` at exactly that step
means the run is complete. A changed `steps` or learning-rate setting is allowed and announced:
the schedule follows the new values from the resumed step on.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from meshtrain.checkpointing.checkpoint import latest_checkpoint, read_manifest
from meshtrain.config.run_config import RunConfig

SCHEDULE_SETTINGS = ("steps", "lr", "min_lr", "warmup_steps", "lr_schedule", "lr_decay_fraction")


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


def schedule_changes(cfg: RunConfig, path: Path, step: int) -> str | None:
    """The line announcing changed schedule settings against the checkpoint's config.toml
    (None when none changed or the checkpoint has no config)."""
    try:
        saved = tomllib.loads((path / "config.toml").read_text()).get("train", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    changed = [(name, saved[name], getattr(cfg.train, name)) for name in SCHEDULE_SETTINGS
               if name in saved and saved[name] != getattr(cfg.train, name)]
    if not changed:
        return None
    parts = [f"`{name}` changed from {old} to {new}" for name, old, new in changed]
    values = "value" if len(changed) == 1 else "values"
    return (f"{', '.join(parts)} on resume: the learning-rate schedule follows the new {values}"
            f" from step {step} on")
