"""Which checkpoint a run continues from.

`resume` demands a checkpoint; `auto_resume` takes the newest complete one when there is one
and starts fresh otherwise (what restarted workers need). Both follow the `latest` pointer, or,
when it is missing or damaged, the newest checkpoint that verifies whole (`repair_latest`). The
run's end (`stop_at`, else `steps`) must lie past the checkpoint's step, except that
`auto_resume` at exactly that step means the run is complete. The rules its settings follow
against the saved ones are config's (`config.resumed_settings`): this module takes the settings
it needs as values, so checkpointing never imports config.
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
from meshtrain.errors import Code, SettingError


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


def _step_dirs(root: Path) -> list[Path]:
    return [d for d in root.iterdir()
            if STEP_NAME.fullmatch(d.name) and d.is_dir() and not d.is_symlink()]


class RunComplete(Exception):
    """`auto_resume` found the run already finished; `str(self)` is the line to print."""


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint holds, from its verified metadata."""
    return int(read_manifest(path, verify_files=False)["step"])


def checkpoint_to_resume(out: Path, *, resume: bool, auto_resume: bool, steps: int,
                         stop_at: int | None) -> tuple[Path, int] | None:
    """(checkpoint, its step) a run writing to `out` continues from, by its settings of those
    names; None to start fresh. Raises SettingError for a resume the settings forbid and
    RunComplete when there is nothing left to do."""
    if not (resume or auto_resume):
        return None
    path = latest_checkpoint(out / "checkpoints") if (out / "checkpoints").is_dir() else None
    if path is None:
        if resume:
            raise SettingError(Code.RESUME_NO_CHECKPOINT, f"`resume`: no checkpoint in {out}; start"
                               " without `resume`, or use `auto_resume` to start fresh when"
                               " there is none")
        return None
    step = checkpoint_step(path)
    end = stop_at or steps
    if step < end:
        return path, step
    if step == end and auto_resume:
        raise RunComplete(f"{out} is complete: its checkpoint {path.name} is at step {step}, the"
                          " run's end; nothing to do")
    name, value = ("steps", steps) if steps <= step else ("stop_at", stop_at)
    raise SettingError(Code.RESUME_STEPS, f"`{name}` {value} is at or below the step of"
                       f" the checkpoint to resume ({path.name}, step {step}): raise `{name}` past"
                       f" {step} to train on")




def last_good_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint a user told to continue is pointed at: the one `latest` names when it
    verifies whole (hashes included), else the newest that does; None when none does. Only
    failure paths call it: it reads every file of the checkpoint."""
    root = Path(root)
    if not root.is_dir():
        return None
    try:
        latest = latest_checkpoint(root)
        if latest is not None:
            read_manifest(latest)
            return latest
    except CheckpointError:
        pass
    return _newest_complete(root)


def continue_advice(root: str | Path) -> str:
    """What to run after a failure, naming only a checkpoint that is there and verifies."""
    path = last_good_checkpoint(root)
    if path is None:
        return "no checkpoint of this run was saved: train again"
    return f"continue from checkpoint {path} with `resume`"
