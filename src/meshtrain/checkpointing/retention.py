"""What stays in a run's `checkpoints/`: the leftovers of a killed save are removed by the next
save, and with `keep_last` N only the newest N complete checkpoints stay after each save.

Only names a save writes are touched: `.tmp_step_*` directories and `.latest.tmp` (leftovers),
and `step_NNNNNNNN` / `step_NNNNNNNN.k` directories with a manifest (checkpoints). Anything else
in the directory is left alone, and the checkpoint `latest` names is never deleted.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from meshtrain.checkpointing.verify import STEP_NAME, latest_checkpoint

LEFTOVER = re.compile(r"\.tmp_step_.+")
POINTER_TMP = ".latest.tmp"


def remove_leftovers(root: Path) -> None:
    """Delete what interrupted saves left in `root` (run by one process, before it writes)."""
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name != POINTER_TMP and not LEFTOVER.fullmatch(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def checkpoint_age(name: str) -> tuple[int, int]:
    """Sort key, oldest first: the step, then the re-save number (`step_N` before `step_N.1`)."""
    match = STEP_NAME.fullmatch(name)
    return int(match.group(1)), int(match.group(2) or 0)


def keep_newest(root: Path, keep_last: int) -> list[str]:
    """Delete the complete checkpoints in `root` older than the newest `keep_last` (0 keeps
    them all), never the one `latest` names; returns the names deleted. Each is first renamed to
    a leftover name, so a deletion cut short never leaves a checkpoint that looks complete."""
    if keep_last == 0:
        return []
    latest = latest_checkpoint(root)
    complete = sorted((entry for entry in root.iterdir()
                       if STEP_NAME.fullmatch(entry.name) and entry.is_dir()
                       and not entry.is_symlink() and (entry / "manifest.json").is_file()),
                      key=lambda entry: checkpoint_age(entry.name))
    doomed = [entry for entry in complete[:-keep_last]
              if latest is None or entry.name != latest.name]
    for entry in doomed:
        hidden = root / f".tmp_{entry.name}.old"
        shutil.rmtree(hidden, ignore_errors=True)
        entry.rename(hidden)
        shutil.rmtree(hidden)
    return [entry.name for entry in doomed]
