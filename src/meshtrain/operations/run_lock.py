"""`OUT/.lock`: one live run per output directory; the same lock, per rank, on a run's NVMe
offload folders (`OFFLOAD/<run>/rank<N>/.lock`, taken by each rank: `lock_offload_folder`).

The lock names its owner: host, process id and run id (torchrun's TORCHELASTIC_RUN_ID, which
every rank and every restarted worker of one elastic run shares; meshtrain's launcher passes its
own id to its ranks as that). A lock is the caller's own when its run id matches; stale when its
owner process is gone from this host, and then taken over. Who takes it: the launching process
(`train --nproc`, or a single-process run) before any rank starts; under torchrun, global rank
0 once the process group exists, telling every rank the outcome so none waits on a refused peer.
Once the ranks exist, the lock also lists those on its host (`record_ranks`: pid and start
time, so a reused pid is not taken for them): it is not taken over while any of them lives,
even when the process that took it is gone (a killed launcher's ranks, until they stop).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path

import torch

from meshtrain.operations.failures import EXIT_BAD_INPUT, RunFailure, writing

LOCK_FILE = ".lock"


class RunLockError(ValueError):
    """`out` (or an offload folder) cannot be locked for this run: another live run holds it,
    or its lock file cannot be written. A `ValueError`, as these were before they had their own
    type: the command line ends them with exit code 2 and their one line."""


def own_run_id() -> str | None:
    return os.environ.get("TORCHELASTIC_RUN_ID") or None


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable or half-written: treated as a live owner we cannot name


def _started(pid: int) -> int | None:
    """When process `pid` of this host started (clock ticks since boot); None when it is gone
    or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _alive(owner: dict) -> bool:
    """False only when the owner and every rank it lists are known to be gone: processes of
    this host that have exited."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return True
    ranks = owner.get("ranks", [])
    if any(isinstance(r, dict) and _started(r.get("pid", -1)) == r.get("started")
           for r in ranks):
        return True
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    return True


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}


def record_ranks(out: str | Path, mesh) -> None:
    """Every rank: tell rank 0 who it is; rank 0 lists the ranks on the lock's host in the
    lock (when the lock exists: a run that holds one)."""
    from meshtrain.parallel.communication import comm
    ranks = comm.all_gather_objects(_me(), mesh.world)
    path = Path(out) / LOCK_FILE
    owner = _read(path) if mesh.rank == 0 else None
    if not owner:
        return
    owner["ranks"] = [r for r in ranks if r["host"] == owner.get("host")]
    tmp = path.with_name(f".lock.{os.getpid()}.tmp")
    with writing(path):
        tmp.write_text(json.dumps(owner))
        os.replace(tmp, path)


def _refusal(out: Path, owner: dict, setting: str = "out") -> str:
    who = (f"host {owner.get('host')}, pid {owner.get('pid')}, run id {owner.get('run_id')}"
           if owner else "its lock file is unreadable")
    what = "`out`" if setting == "out" else f"the `{setting}` folder"
    return (f"{what} {out} is in use by another run ({who}): wait for it to end or choose"
            f" another `{setting}`; if that run is gone, delete {out / LOCK_FILE}")


def check_free(out: str | Path, run_id: str | None = None, setting: str = "out") -> None:
    """Raise (one line, naming the owner) when a live run other than `run_id` holds `out` (a
    folder of `setting`)."""
    out = Path(out)
    owner = _read(out / LOCK_FILE)
    if owner is None or (run_id is not None and owner.get("run_id") == run_id):
        return
    if _alive(owner):
        raise RunLockError(_refusal(out, owner, setting))


class RunLock:
    """The lock of `out` (a folder of `setting`) for run `run_id` (default: a new random id)."""

    def __init__(self, out: str | Path, run_id: str | None = None, setting: str = "out"):
        self.out, self.run_id, self.setting = Path(out), run_id or uuid.uuid4().hex, setting
        self.held = False

    @property
    def path(self) -> Path:
        return self.out / LOCK_FILE

    def acquire(self) -> None:
        """Take the lock (creating `out`), over a stale one or one of the same run; raises
        RunLockError naming the owner when another live run holds it."""
        check_free(self.out, self.run_id, self.setting)
        mine = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": self.run_id}
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.out / f".lock.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(mine))
            try:
                os.link(tmp, self.path)  # atomic: fails when a lock exists
            except FileExistsError:
                os.replace(tmp, self.path)  # stale or ours (checked above)
            else:
                tmp.unlink()
        except OSError as e:
            raise RunLockError(f"`{self.setting}` {self.out}: cannot write its lock file ({e});"
                               f" choose a writable `{self.setting}`") from None
        if _read(self.path) != mine:  # another run took it over at the same moment
            raise RunLockError(_refusal(self.out, _read(self.path) or {}, self.setting))
        self.held = True

    def release(self) -> None:
        if self.held and (_read(self.path) or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire_agreed(self, mesh) -> None:
        """Global rank 0 takes the lock; every rank learns a refusal (RunFailure, agreed)."""
        from meshtrain.parallel.communication import comm
        reason = ""
        if mesh.rank == 0:
            try:
                self.acquire()
            except RunLockError as e:
                reason = str(e)
        refused = torch.tensor(1.0 if reason else 0.0, device=mesh.device)
        comm.all_reduce(refused, mesh.world, op=torch.distributed.ReduceOp.MAX)
        if refused.item():
            raise RunFailure(reason, EXIT_BAD_INPUT, agreed=True)


def check_offload_free(run_folder: Path | None, run_id: str | None = None) -> None:
    """Before ranks start: refuse when a live run other than `run_id` holds any rank's folder
    in this run's offload folder."""
    ranks = sorted(run_folder.glob("rank*")) if run_folder is not None else []
    for folder in ranks:
        check_free(folder, run_id, "offload_dir")


class OffloadLock:
    """Rank `rank`'s lock on its NVMe offload folder `folder` (None: no nvme offload): every
    rank takes its own at once, a refusal is agreed (RunFailure, exit 2, rank 0's line naming
    a holder). `release` also removes the folder and the run's folder once empty (the files
    are gone by then: the store removes its own)."""

    def __init__(self, folder: Path | None):
        self.lock = RunLock(folder, own_run_id(), "offload_dir") if folder else None

    def acquire_agreed(self, mesh) -> None:
        from meshtrain.parallel.communication import comm
        if self.lock is None:
            return
        reason = ""
        try:
            self.lock.acquire()
        except RunLockError as e:
            reason = str(e)
        refusals = [r for r in comm.all_gather_objects(reason, mesh.world) if r]
        if refusals:
            self.release()
            raise RunFailure(refusals[0], EXIT_BAD_INPUT, agreed=True)

    def release(self) -> None:
        if self.lock is None or not self.lock.held:
            return
        self.lock.release()
        for folder in (self.lock.out, self.lock.out.parent):
            try:
                folder.rmdir()
            except OSError:
                return  # another rank's files, or this rank's left by a failed close
