"""How a failed rank or launch ends: one line at most, never a traceback per rank (`--debug`
shows them), and the exit code of `failures.py`.

A rank whose collective fails because a peer died says nothing: the launcher, which sees every
rank's exit code and signal, names the rank that died.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback

from meshtrain.operations.failures import EXIT_FAILED, EXIT_HANG, EXIT_PEER_FAILED


def unexpected(e: Exception, debug: bool, where: str = "") -> int:
    """An error no check foresaw: one line (`where` names the rank), or with `debug` the
    traceback."""
    if debug:
        traceback.print_exc()
    else:
        message = " ".join(str(e).split())[:300]
        print(f"meshtrain: error: {where}{type(e).__name__}: {message} (rerun with --debug for"
              " the traceback)", file=sys.stderr)
    return EXIT_FAILED


def launch_failure(failures: dict) -> int:
    """The exit code of a launch whose ranks failed (global rank -> `ProcessFailure`), and its
    one line where no rank printed one. The agent SIGTERMs the ranks still running after the
    first failure and lists them too: a death by another signal (or a rank's own exit code)
    is the cause."""
    if any(f.exitcode == EXIT_HANG for f in failures.values()):
        return EXIT_HANG  # the ranks printed the verdict
    signalled = sorted((f.exitcode == -signal.SIGTERM, f.timestamp, rank)
                       for rank, f in failures.items() if f.exitcode < 0)
    if signalled and not signalled[0][0]:
        _, when, rank = signalled[0]
        print(f"meshtrain: rank {rank} was killed by {failures[rank].signal_name()} at"
              f" {time.strftime('%H:%M:%S', time.localtime(when))}; the other ranks stopped",
              file=sys.stderr)
        return EXIT_PEER_FAILED
    codes = {rank: f.exitcode for rank, f in sorted(failures.items())}
    explained = [code for code in codes.values() if code > 0 and code != EXIT_PEER_FAILED]
    if explained:
        return explained[0]  # that rank printed its line
    rank = min(codes)
    print(f"meshtrain: rank {rank} ended with exit code {codes[rank]}"
          f" ({failures[rank].signal_name() if codes[rank] < 0 else 'no message'}); the other"
          " ranks stopped", file=sys.stderr)
    return EXIT_PEER_FAILED


def peer_failed(e: Exception) -> bool:
    """A collective failed because another rank died or left: the backend's own error (NCCL's
    DistBackendError), or gloo's RuntimeError from its transport."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or isinstance(e, RuntimeError) and (
        "gloo/transport" in text or "Connection closed by peer" in text
        or "Connection reset by peer" in text)


def name_silent_peers() -> None:
    """Under plain torchrun no meshtrain launcher names a rank that died without a word: the
    lowest surviving rank of its node does, in one line (torch's agent's report may follow)."""
    from meshtrain.operations.stopping import silent_peers

    silent, speaker = silent_peers()
    if silent and speaker:
        ranks = " and ".join(f"rank {rank}" for rank in silent)
        print(f"meshtrain: {ranks} ended without a word (killed by a signal: SIGKILL or an"
              " out-of-memory kill); the other ranks stopped, the last complete checkpoint is"
              " kept", file=sys.stderr)
