"""How a run ends when it does not finish: one documented exit code per kind of ending, and the
exception that carries the one line the user sees.

The codes are part of the command-line interface (docs/guide.md lists them): a scheduler's
job script can tell "stopped early, resumable" from "broken input" or "hung".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1  # an unexpected error; `--debug` shows its traceback
EXIT_BAD_INPUT = 2  # a setting, a file or a checkpoint that cannot be used
EXIT_STOPPED = 3  # a signal asked the run to stop: it saved a checkpoint to resume from
EXIT_HANG = 4  # a collective waited longer than `collective_timeout`
EXIT_NONFINITE = 5  # the loss or the gradient norm stopped being finite
EXIT_PEER_FAILED = 6  # another rank died or failed first: the one line comes from elsewhere
EXIT_SIGNAL_BASE = 128  # + N: a second signal N aborted a stop unsaved (as shells report)


class RunFailure(Exception):
    """A run that cannot go on. `str(self)` is the one line to print, naming settings in
    backticks; `exit_code` is one of the codes above. `agreed`: every rank raises the same
    failure (a collective decision), so only global rank 0 prints the line."""

    def __init__(self, message: str, exit_code: int, *, agreed: bool = False):
        super().__init__(message)
        self.exit_code = exit_code
        self.agreed = agreed


@contextlib.contextmanager
def writing(path: Path, then: Callable[[], str] | None = None):
    """Turn a failed write of a run file (a full disk, a revoked permission) into one line
    naming the file (exit 1, as every failed write); what a checkpoint already holds is
    untouched. `then()`: what to do after freeing space, computed only on a failure (it names
    only a checkpoint that is there, e.g. `resuming.continue_advice`); default: run again."""
    try:
        yield
    except OSError as e:
        advice = then() if then is not None else "run the command again"
        raise RunFailure(f"writing {path} failed ({e.strerror or e}): free space or fix the"
                         f" permissions, then {advice}", EXIT_FAILED) from None
