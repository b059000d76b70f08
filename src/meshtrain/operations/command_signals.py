"""Stop signals to the `meshtrain` command itself, apart from a training run's graceful stop
(`stopping.py`): while it starts (importing torch, parsing) a signal ends it at once with one
line and EXIT_STOPPED, a rank holds it until its run arms; a command other than `train` is
`interruptible` (every `finally` on the way out removes what it was writing); once `main` has
its exit code, later signals change nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path

from meshtrain.operations.failures import EXIT_STOPPED
from meshtrain.operations.stopping import (
    LAUNCHER_PID,
    STOP_SIGNALS,
    hold_signals,
    take_first_held,
)

COMMAND_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what stops any command
_command = {"ended": False}  # set once `main` has its exit code: later signals change nothing


def is_meshtrain_command() -> bool:
    """This process is the `meshtrain` command (`python -m meshtrain`, or the console script),
    not a program that imports meshtrain as a library."""
    argv = getattr(sys, "orig_argv", [])
    module = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"]
    return module[:1] == ["meshtrain"] or "-mmeshtrain" in argv or (
        bool(sys.argv) and Path(sys.argv[0]).name == "meshtrain")


def _stop_at_start(signum, frame) -> None:
    """A stop signal to the command before it has its own handling (importing torch, parsing):
    no step can have run and nothing is written yet; after `main` ended, nothing changes."""
    if _command["ended"]:
        return
    print(f"meshtrain: stopped by {signal.Signals(signum).name} during start-up, before the"
          " first step: nothing to save", file=sys.stderr, flush=True)
    os._exit(EXIT_STOPPED)


def handle_start_signals() -> None:
    """The first thing `import meshtrain` does. A rank (of meshtrain's launcher, or the
    `meshtrain` command under torchrun) holds stop signals until it arms (`hold_signals`): torch
    loads for seconds in which its launcher may already forward one. The `meshtrain` command
    itself ends at once with one line and EXIT_STOPPED (not a KeyboardInterrupt traceback, nor a
    silent 143). A program importing meshtrain as a library keeps its handlers."""
    if os.environ.get(LAUNCHER_PID) == str(os.getppid()):
        hold_signals()
    elif is_meshtrain_command():
        _command["ended"] = False
        if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
            hold_signals()
        else:
            for sig in COMMAND_SIGNALS:
                signal.signal(sig, _stop_at_start)


def command_ended() -> None:
    """`main` has its exit code: a stop signal from now on is ignored (the handlers it restores
    on its way out must not turn a finished or saved run into 128+N)."""
    _command["ended"] = True


def ignore_from_now() -> None:
    """The command is about to exit with its code: ignore stop signals (Python's finalization
    resets its handlers to the defaults, under which one would still end the process as 128+N)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Interrupted(BaseException):
    """A stop signal to a command other than `train` (`interruptible`): raised in the main thread
    so that every `finally` on the way out removes what the command was writing."""

    def __init__(self, sig: signal.Signals):
        super().__init__(sig.name)
        self.signal = sig


@contextlib.contextmanager
def interruptible():
    """Around a command other than `train` (`prepare`, `import-hf`, `export`, ...): the first
    SIGTERM, SIGINT or SIGHUP raises `Interrupted`, later ones are ignored while it cleans up;
    one held from start-up (a rank under torchrun) raises at once."""
    raised: list[int] = []

    def handle(signum, frame):
        if not raised:
            raised.append(signum)
            raise Interrupted(signal.Signals(signum))

    previous = {sig: signal.signal(sig, handle) for sig in COMMAND_SIGNALS}
    try:
        held = take_first_held()
        if held is not None:
            handle(held, None)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
