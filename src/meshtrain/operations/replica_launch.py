"""Starting replica groups (`fault_tolerance`): the settings checked before anything starts,
and on one machine the torchft lighthouse plus one meshtrain launcher per group, each with its
own torch elastic agent, so a failed rank restarts only its own group.

Across machines each group is its own torchrun job given `replica_group_id` and `lighthouse`
(a `torchft_lighthouse` started beside them); on one machine `train --nproc N
--replica-groups R --fault-tolerance` runs the lighthouse in its own process and starts R
launchers of N / R ranks, forwarding stop signals to them; each is told to end with it (a
parent-death signal), so nothing outlives the run.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh
from meshtrain.operations.failures import EXIT_FAILED, EXIT_OK, EXIT_STOPPED, RunFailure
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.replica_groups import torchft_module

LIGHTHOUSE_WAIT_S = 10.0  # how long a group waits for the lighthouse to answer
HEARTBEAT_TIMEOUT_MS = 2000  # a group silent this long leaves the next quorum
JOIN_TIMEOUT_MS = 3000  # how long a quorum waits for a heartbeating group to ask to join
GROUPS_PARENT = "MESHTRAIN_REPLICA_GROUPS_PARENT"  # set in the launchers of the groups


def group_world(cfg, world: int, *, under_torchrun: bool) -> int:
    """The ranks of one replica group (`world` itself without fault tolerance), every
    replica-group number checked first; raises `SettingError`. (Whether torchft is installed
    is `torchft_module`'s to say.)"""
    p = cfg.parallel
    if not p.fault_tolerance:
        given = [name for name in ("replica_group_id", "lighthouse") if getattr(p, name)]
        given += [name for name in ("replica_groups", "min_replica_groups")
                  if getattr(p, name) != 1]
        if given:
            raise SettingError(Code.FT_SETTING, f"`{given[0]}` needs `fault_tolerance`: add it"
                                                f" or drop `{given[0]}`")
        return world
    groups = p.replica_groups
    if groups < 1:
        raise SettingError(Code.RANGE, f"`replica_groups` must be positive, got {groups}")
    if not 1 <= p.min_replica_groups <= groups:
        raise SettingError(Code.MIN_REPLICA_GROUPS,
                           f"`min_replica_groups` {p.min_replica_groups} must be from 1 to"
                           f" `replica_groups` {groups}: lower it")
    if cfg.train.global_batch % groups:
        raise SettingError(Code.REPLICA_GROUPS,
                           f"`replica_groups` {groups} does not divide `global_batch`"
                           f" {cfg.train.global_batch}: each group trains an equal share")
    if p.replica_group_id is None and not under_torchrun:  # the launcher of every group
        if world % groups:
            raise SettingError(Code.REPLICA_GROUPS,
                               f"`replica_groups` {groups} does not divide the {world} ranks"
                               " (`nproc`): give a multiple of it")
        world //= groups
    elif p.replica_group_id is None or not 0 <= p.replica_group_id < groups or not p.lighthouse:
        raise SettingError(Code.REPLICA_GROUP_ID,
                           f"a replica group started alone needs `replica_group_id` (0 to"
                           f" {groups - 1}) and `lighthouse` HOST:PORT")
    return world


def check_lighthouse(address: str) -> None:
    """Refuse a lighthouse that does not answer within `LIGHTHOUSE_WAIT_S` (exit 2, one line)."""
    torchft_module()
    from torchft._torchft import LighthouseClient

    try:
        LighthouseClient(_http(address),
                         connect_timeout=datetime.timedelta(seconds=LIGHTHOUSE_WAIT_S))
    except RuntimeError:
        raise SettingError(Code.LIGHTHOUSE,
                           f"`lighthouse` {address} did not answer within {LIGHTHOUSE_WAIT_S:g}"
                           " s: start torchft_lighthouse there or correct the address") from None


def run_groups(argv: list[str], *, groups: int, ranks: int, min_groups: int,
               run_id: str) -> int:
    """One machine: the lighthouse here, then `groups` meshtrain launchers of `ranks` ranks
    each; returns 0 when a group finished the run, EXIT_STOPPED when a signal stopped it,
    else the first group's failure code (each group printed its own line)."""
    torchft_module()
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_groups,
                                  join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    address = lighthouse.address().removeprefix("http://")
    env = os.environ | {"TORCHELASTIC_RUN_ID": run_id, GROUPS_PARENT: str(os.getpid())}
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "meshtrain", *argv, "--nproc",
                                   str(ranks), "--replica-group-id", str(k), "--lighthouse",
                                   address], env=env, preexec_fn=_end_with_parent)
                 for k in range(groups)]
        with _forwarded_signals(procs):
            codes = [proc.wait() for proc in procs]
    finally:
        lighthouse.shutdown()
    if EXIT_STOPPED in codes:
        return EXIT_STOPPED
    return EXIT_OK if EXIT_OK in codes else next(code for code in codes if code)


@contextlib.contextmanager
def _forwarded_signals(procs: list[subprocess.Popen]):
    """SIGTERM and SIGINT go on to every group's launcher, which stops its ranks with a
    checkpoint as a lone run's does."""
    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _end_with_parent() -> None:
    """In a group's launcher (before exec): SIGTERM when the process that started it dies."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_for_groups(folder: Path, *, group_id: int, num_groups: int, timeout: float,
                    mesh: ParallelMesh) -> None:
    """The start of a run: every group's rank 0 marks `folder` (OUT/replica_groups/start.RUN_ID)
    and waits for all groups' marks, so that no group trains alone ahead of one still
    starting (a group restarted later heals instead)."""
    waited = None
    if mesh.world.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"group{group_id}").touch()
        deadline = time.monotonic() + timeout
        while len(list(folder.glob("group*"))) < num_groups and time.monotonic() < deadline:
            time.sleep(0.05)
        waited = len(list(folder.glob("group*")))
    if comm.all_gather_objects(waited, mesh.world)[0] < num_groups:
        raise RunFailure(f"replica group {group_id}: not every one of the {num_groups} groups"
                         f" started within {timeout:g} s (`collective_timeout`): start them all",
                         EXIT_FAILED, agreed=True)


def _http(address: str) -> str:
    return address if "://" in address else f"http://{address}"
