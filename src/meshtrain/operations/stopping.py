"""Graceful stop: SIGTERM, SIGINT, SIGHUP or SIGUSR1 ends a run after the current step with a
checkpoint, the same step on every rank, and exit code EXIT_STOPPED; so does the death of the
launcher that started the ranks (no rank outlives it).

On a rank a signal only records a request (`StopSignals.request`). `Trainer.train_step`
all-reduces the requests (MAX over the world) with the step's other scalars, so every rank reads
the same decision after the same step, saves and exits. A watcher thread learns of each signal
through Python's wakeup fd, so it acts even while the main thread waits inside a collective: a
repeat within DUPLICATE_WINDOW_S counts once (schedulers signal the launcher and every rank), a
later one aborts at once, and a stop the ranks cannot agree on (a peer is gone) gives up after a
deadline instead of hanging.

meshtrain's own launcher (`train --nproc`) takes these signals itself (`LauncherSignals`): the
first is passed to torch's elastic agent, which forwards it to the ranks, waits up to the
shutdown timeout and ends without restarting; the ranks report their exit codes through files,
so the launcher exits with their code and at most one line of its own.

Before a run arms its handling (imports, checks, rendezvous, building the model) a signal is
held (`hold_signals`), never a traceback: a rank acts on it when it arms, so it stops after its
first step with a checkpoint; the launcher stops at once while no step can have run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from meshtrain.operations.failures import (
    EXIT_HANG,
    EXIT_OK,
    EXIT_PEER_FAILED,
    EXIT_SIGNAL_BASE,
    EXIT_STOPPED,
)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
PARENT_POLL_S = 0.5  # how often a launched rank checks that its launcher still lives
DUPLICATE_WINDOW_S = 3.0  # a repeat of a stop signal within this counts once
AGREE_DEADLINE_S = 30.0  # plus two of the longest step: time for every rank to reach the decision
SHUTDOWN_TIMEOUT_S = 600  # the launcher's wait for the ranks' save before it kills them
HANG_GRACE_S = 2.0  # after a hang verdict, the launcher ends the ranks still there this late
SAVE_NOW = 1.0  # request values, all-reduced with MAX: 1 a timed save, 100 + signal number a stop
STOP_BASE = 100.0
# What meshtrain's launcher tells its ranks (environment variables).
LAUNCHER_PID = "MESHTRAIN_LAUNCHER_PID"
EXIT_DIR = "MESHTRAIN_EXIT_DIR"


_held: list[tuple[int, float]] = []  # (signal, monotonic time) that came before arming


def _hold(signum, frame) -> None:
    _held.append((signum, time.monotonic()))


def hold_signals() -> dict:
    """From now until the run arms (`StopSignals.arm`, `LauncherSignals`), remember each stop
    signal instead of acting on it (Python's defaults die silently or print a traceback);
    returns the handlers it replaced."""
    return {sig: signal.signal(sig, _hold) for sig in STOP_SIGNALS}


@contextlib.contextmanager
def signals_held():
    """`hold_signals` for one command run in this process, the previous handlers back after
    it: a process that goes on (a test, a notebook calling `main`) must not keep holding its
    stop signals, nor hand the holding handler to the processes it forks later."""
    previous = hold_signals()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _held.clear()


def take_first_held() -> int | None:
    """The first stop signal held before arming (None: none came), forgetting every held one:
    for a command that acts on it at once (`command_signals.interruptible`)."""
    first = _held[0][0] if _held else None
    _held.clear()
    return first


def _rank_folder() -> Path | None:
    """Where this rank leaves its armed and exit files: meshtrain's launcher's folder, or under
    torchrun the agent's folder of this rank and attempt (beside its error file); else None."""
    if EXIT_DIR in os.environ:
        return Path(os.environ[EXIT_DIR])
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return Path(error_file).parent if error_file else None


def _rank_file(kind: str) -> Path:
    """This rank's file of `kind` (armed, exit) in its folder (`_rank_folder`)."""
    return _rank_folder() / f"rank_{os.environ.get('RANK', '0')}.{kind}"


def stop_signal(request: float) -> signal.Signals | None:
    """The signal an all-reduced request asks to stop for (None: no stop)."""
    return signal.Signals(round(request - STOP_BASE)) if request >= STOP_BASE else None


def under_meshtrain_launcher() -> bool:
    return LAUNCHER_PID in os.environ


def launched() -> bool:
    """Started by a launcher: meshtrain's, or torch's elastic agent (torchrun)."""
    return under_meshtrain_launcher() or "TORCHELASTIC_RUN_ID" in os.environ


def report_exit(code: int) -> None:
    """Leave how this rank ends where its launcher (meshtrain's) or its restarted successors
    (under torchrun) read it."""
    if _rank_folder() is not None:
        with contextlib.suppress(OSError):  # the agent's folder may be gone at its end
            _rank_file("exit").write_text(str(code))


def _files_of(paths) -> dict[int, str]:
    return {int(path.stem.removeprefix("rank_")): path.read_text() for path in paths}


def failed_rank(world: int) -> str | None:
    """On an elastic restart: the rank whose failure caused it, from the files this node's
    ranks of the last attempt left (a killed rank writes no exit file, its peers write
    EXIT_PEER_FAILED); None where they name none. One rank per node reads them."""
    folder = _rank_folder()
    if folder is None:
        return None
    if EXIT_DIR in os.environ:  # meshtrain's launcher: every rank, one folder for all attempts
        codes = _files_of(folder.glob("rank_*.exit"))
        for path in folder.glob("rank_*.exit"):
            path.unlink()
        expected = set(range(world))
    else:  # torchrun: <run>/attempt_<k>/<local rank>/ per attempt, on this node only
        attempt = folder.parent
        if not attempt.name.removeprefix("attempt_").isdigit():
            return None  # not the agent's layout: nothing to read
        last = attempt.parent / f"attempt_{int(attempt.name.removeprefix('attempt_')) - 1}"
        codes = _files_of(last.glob("*/rank_*.exit"))
        expected = set(_files_of(last.glob("*/rank_*.armed"))) | set(codes)
    silent = sorted(expected - set(codes))
    if silent:
        ranks = " and ".join(f"rank {rank}" for rank in silent)
        return f"{ranks} ended without a word (killed by a signal)"
    failed = [(rank, int(code)) for rank, code in sorted(codes.items())
              if code and int(code) not in (EXIT_OK, EXIT_STOPPED, EXIT_PEER_FAILED)]
    return f"rank {failed[0][0]} failed with exit code {failed[0][1]}" if failed else None


def silent_peers() -> tuple[list[int], bool]:
    """Under plain torchrun, for a rank whose collective failed because a peer left: the ranks
    of this node that ended without a word (neither alive nor with an exit file: a SIGKILL, an
    out-of-memory kill), and whether this rank is the one to name them (the lowest of the
    others). This rank's exit file is written first, so a peer that decides after it has
    ended does not count it as silent."""
    report_exit(EXIT_PEER_FAILED)
    folder = _rank_folder()
    try:
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        ranks = range(rank - local, rank - local + int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return [], False
    if folder is None or not folder.parent.name.startswith("attempt_"):
        return [], False
    ended = set(_files_of(folder.parent.glob("*/rank_*.exit")))
    alive = set(rank_processes(os.getppid()))
    silent = [r for r in ranks if r not in ended and r not in alive]
    return silent, rank == min(r for r in ranks if r not in silent)


def _noop(signum, frame) -> None:
    """The Python-level handler: the watcher thread does the work (see `StopSignals`)."""


class StopSignals:
    """This rank's stop requests. `arm` in the main thread before training, `disarm` after."""

    def __init__(self, *, rank: int):
        self.rank = rank
        self.longest_step = 0.0  # seconds; the loop updates it, the deadline grows with it
        self._first: tuple[int, float] | None = None
        self._request = 0.0
        self._echo = False  # a SIGUSR1 passed to the launcher comes back once
        self._saved = False  # the run's last checkpoint is written (`saved`)
        self._deadline: threading.Timer | None = None
        self._pipe: tuple[int, int] | None = None
        self._previous: dict = {}

    def request(self) -> float:
        """This rank's contribution to the step's request: 100 + signal number once asked."""
        return self._request

    def arm(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._pipe = (read_fd, write_fd)
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, _noop)
            signal.siginterrupt(sig, False)  # restart system calls a signal interrupts
        self._previous["wakeup"] = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="meshtrain-stop",
                         daemon=True).start()
        while _held:  # signals of the start-up count from when they came
            sig, when = _held.pop(0)
            self._on_signal(signal.Signals(sig), when)
        if _rank_folder() is not None:  # past start-up: a launcher's signal is forwarded here
            with contextlib.suppress(OSError):
                _rank_file("armed").touch()
        if launched():
            threading.Thread(target=self._watch_parent, args=(os.getppid(),),
                             name="meshtrain-parent", daemon=True).start()

    def _watch_parent(self, parent: int) -> None:
        """A launched rank dies with its launcher: once the launcher is gone (this process was
        handed to another parent; a SIGKILL, an OOM kill, a closed terminal), stop as on SIGHUP:
        a checkpoint after the current step when the ranks agree, else exit by the deadline."""
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        pipe = self._pipe
        try:
            if pipe is not None:  # still armed: the run has not ended by itself
                os.write(pipe[1], bytes([signal.SIGHUP]))  # as if the signal had come
        except OSError:  # disarmed meanwhile
            pass

    def disarm(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._previous.pop("wakeup"))
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._pipe[1])  # the watcher reads end-of-file and closes its end
        self._pipe = None
        self.agreed()

    def agreed(self) -> None:
        """Every rank has read the stop decision: no peer is missing, the save may take long."""
        if self._deadline is not None:
            self._deadline.cancel()

    def _watch(self, read_fd: int) -> None:
        while byte := os.read(read_fd, 1):
            if byte[0] in STOP_SIGNALS:
                self._on_signal(signal.Signals(byte[0]), time.monotonic())
        os.close(read_fd)

    def saved(self) -> None:
        """The checkpoint that ends the run (a stop's, or the last step's) is complete: a signal
        from now on changes nothing (a repeat must not turn it into an unsaved abort)."""
        self._saved = True

    def _on_signal(self, sig: signal.Signals, now: float) -> None:
        if self._saved:
            return
        if self._first is None:
            self._first = (sig, now)
            self._request = STOP_BASE + sig
            if sig == signal.SIGUSR1 and under_meshtrain_launcher():
                self._echo = True  # the launcher stops every rank (and sends it back here)
                os.kill(int(os.environ[LAUNCHER_PID]), sig)
            seconds = AGREE_DEADLINE_S + 2 * self.longest_step
            self._deadline = threading.Timer(seconds, self._give_up, args=(sig, seconds))
            self._deadline.daemon = True
            self._deadline.start()
        elif sig == signal.SIGUSR1 and self._echo:
            self._echo = False
        elif now - self._first[1] > DUPLICATE_WINDOW_S:
            first = signal.Signals(self._first[0]).name
            self._exit(EXIT_SIGNAL_BASE + sig,
                       f"{sig.name} again {now - self._first[1]:.0f} s after {first}: aborted at"
                       " once without saving; the last complete checkpoint is kept",
                       speak=not under_meshtrain_launcher())

    def _give_up(self, sig: signal.Signals, seconds: float) -> None:
        self._exit(EXIT_PEER_FAILED, f"{sig.name}: the ranks did not all reach the end of the"
                                     f" step within {seconds:.0f} s (a peer is gone or stalled):"
                                     " exiting without saving; the last complete checkpoint is"
                                     " kept", speak=True)

    def _exit(self, code: int, line: str, *, speak: bool) -> None:
        """End this process now, from the watcher thread (the main thread may be stuck)."""
        if speak:
            print(f"meshtrain: rank {self.rank}: {line}", file=sys.stderr, flush=True)
        report_exit(code)
        os._exit(code)


def shutdown_timeout() -> int:
    """Seconds the launcher waits for stopping ranks (torch's own variable overrides it)."""
    return int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S))


class LauncherSignals:
    """Stop signals in meshtrain's launcher (a context around torch's elastic `run`).

    The first raises torch's `SignalException`: its agent forwards the signal to every rank,
    waits `shutdown_timeout` for them and ends without a restart. While some rank has not armed
    (no step can have run) it asks the agent for SIGKILL instead: nothing is lost, and a rank
    still importing torch would die of the signal without a word. A repeat within
    DUPLICATE_WINDOW_S is dropped; a later one is sent on to the ranks, which abort."""

    def __init__(self, world: int):
        self.world = world
        self._first: tuple[int, float] | None = None
        self.in_start_up = False  # the first signal came before every rank had armed
        self._folder = tempfile.TemporaryDirectory(prefix="meshtrain-ranks-")
        self._previous: dict = {}
        self._closed = threading.Event()

    def __enter__(self) -> LauncherSignals:
        os.environ[LAUNCHER_PID] = str(os.getpid())
        os.environ[EXIT_DIR] = self._folder.name
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        if _held:  # during the launcher's own checks: no rank is started
            self._first, self.in_start_up = _held[0], True
            _held.clear()
        threading.Thread(target=self._end_after_hang, name="meshtrain-hang", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._closed.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for name in (LAUNCHER_PID, EXIT_DIR):
            os.environ.pop(name, None)
        self._folder.cleanup()

    def _handle(self, signum: int, frame) -> None:
        from torch.distributed.elastic.multiprocessing import SignalException

        sig, now = signal.Signals(signum), time.monotonic()
        if self._first is None:
            self._first = (sig, now)
            self.in_start_up = len(self._ranks("armed")) < self.world
            raise SignalException(f"meshtrain's launcher got {sig.name}",
                                  sigval=signal.SIGKILL if self.in_start_up else sig)
        if now - self._first[1] > DUPLICATE_WINDOW_S:
            ended = self.codes()  # a rank that reported its end (its checkpoint saved) is left
            for rank, pid in rank_processes(os.getpid()).items():
                if rank in ended:
                    continue
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def _ranks(self, kind: str) -> dict[int, str]:
        """Global rank -> content of its file of `kind` (armed, exit), complete ones."""
        found = {}
        for path in Path(self._folder.name).glob(f"rank_*.{kind}"):
            try:
                text = path.read_text()
            except OSError:  # removed meanwhile (a restart's rank 0, or the launcher's end)
                continue
            if text or kind == "armed":
                found[int(path.stem.removeprefix("rank_"))] = text
        return found


    def codes(self) -> dict[int, int]:
        """Exit codes the ranks reported, by global rank."""
        return {rank: int(code) for rank, code in self._ranks("exit").items()}

    def _end_after_hang(self) -> None:
        """Once a rank reports a hang verdict, SIGKILL the ranks that have not ended by
        HANG_GRACE_S later: stopped or stuck in the backend, they would hold torch's agent for
        its shutdown timeout."""
        while EXIT_HANG not in self.codes().values():
            if self._closed.wait(0.5):
                return
        if self._closed.wait(HANG_GRACE_S):
            return
        ended = self.codes()
        for rank, pid in rank_processes(os.getpid()).items():
            if rank not in ended:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


    def outcome(self) -> int:
        """The launcher's exit code after a stop signal, and its one line where the ranks
        could not say it (a rank killed, or all aborted)."""
        codes, sig = self.codes(), signal.Signals(self._first[0])
        if self.in_start_up:
            print(f"meshtrain: stopped by {sig.name} during start-up, before the first step:"
                  " nothing to save", file=sys.stderr)
            return EXIT_STOPPED
        missing = [rank for rank in range(self.world) if rank not in codes]
        if missing:
            ranks = ", ".join(f"rank {r}" for r in missing)
            print(f"meshtrain: {sig.name}: {ranks} ended without reporting (killed by the"
                  f" signal, or after the launcher's {shutdown_timeout()} s shutdown timeout);"
                  " the last complete checkpoint is kept", file=sys.stderr)
            return EXIT_SIGNAL_BASE + sig
        aborted = sorted(code for code in codes.values() if code > EXIT_SIGNAL_BASE)
        if aborted:
            return self.explain(aborted[-1])
        other = [codes[r] for r in sorted(codes) if codes[r] not in (EXIT_OK, EXIT_STOPPED)]
        if other:
            return other[0]  # that rank printed its line
        return EXIT_STOPPED if EXIT_STOPPED in codes.values() else EXIT_OK

    def explain(self, code: int) -> int:
        """`code` (a failed rank's), with the line for the ranks that aborted on a repeated
        signal: they leave the line to this launcher."""
        if code > EXIT_SIGNAL_BASE and code in self.codes().values():
            name = signal.Signals(code - EXIT_SIGNAL_BASE).name
            print(f"meshtrain: {name} again while stopping: aborted without saving; the last"
                  " complete checkpoint is kept", file=sys.stderr)
        return code


def rank_processes(parent: int) -> dict[int, int]:
    """Global rank -> pid of the live children of `parent` that are ranks (their RANK variable):
    the ranks meshtrain's launcher or a torchrun agent started, also before they run a line."""
    pids = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1]
                                               .split()[1]) != parent:
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        pids |= {int(item[5:]): int(entry.name) for item in env if item.startswith(b"RANK=")}
    return pids
