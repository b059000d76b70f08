"""Replica groups under torchft: each group holds a whole model copy in its own layout (tp, pp,
ZeRO inside the group) and the groups average their gradients through torchft's `Manager`
instead of the world group, so a group that fails costs the others one discarded step, not a
restart.

Per step every rank asks the lighthouse for a quorum (`start_step`): a group that joins late
receives the live state of a healthy group first (torchft's checkpoint transport, rank k from
rank k of the same layout); the gradients are then averaged over the groups taking part
(`reduce`, torchft divides by the participants) and the step commits only when every rank of
every participating group reduced cleanly (`commit`). torchft is an optional extra, imported
only here and only under `fault_tolerance`.
"""

from __future__ import annotations

import datetime
import hashlib
import http.server
import logging
import os
import socket
import warnings
from collections.abc import Callable

import torch

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.communication import comm

FT_EXTRA = "pip install 'meshtrain[ft]'"
FT_TIMEOUT = datetime.timedelta(seconds=30)  # one cross-group collective or a state transfer


def torchft_module():
    """torchft, or a refusal naming the extra that installs it. Its Rust side logs warnings
    and worse only (RUST_LOG, unless set)."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError:
        raise SettingError(Code.FT_PACKAGE, f"`fault_tolerance` needs the torchft package:"
                                            f" {FT_EXTRA}") from None
    return torchft


def _group_store(mesh: ParallelMesh) -> tuple[torch.distributed.TCPStore | None, str, int]:
    """A key-value store of this group for torchft (rank 0 serves it): the group's own, so a
    restarted group never reads the keys of its previous life."""
    host = os.environ.get("MASTER_ADDR") or socket.gethostname()
    store = None
    if mesh.world.rank == 0:
        store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    port = comm.all_gather_objects(store.port if store else None, mesh.world)[0]
    return store, host, port


class ReplicaGroups:
    """This rank's membership of the replica groups: the quorum, the cross-group reduction and
    the commit decision, through one torchft `Manager` per rank."""

    def __init__(self, mesh: ParallelMesh, *, group_id: int, num_groups: int, lighthouse: str,
                 min_groups: int, quorum_timeout: float, fingerprint: dict[str, str],
                 state: Callable[[], dict], load: Callable[[dict], None]):
        torchft_module()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        _quiet_torchft()
        self.group_id, self.num_groups = group_id, num_groups
        self.device = mesh.device
        self._store, host, port = _group_store(mesh)
        pg = ProcessGroupNCCL(timeout=FT_TIMEOUT) if mesh.device.type == "cuda" \
            else ProcessGroupGloo(timeout=FT_TIMEOUT)
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_groups,
            use_async_quorum=False, replica_id=str(group_id),
            lighthouse_addr=_http(lighthouse), rank=mesh.world.rank,
            world_size=mesh.world_size, store_addr=host, store_port=port,
            timeout=FT_TIMEOUT, quorum_timeout=datetime.timedelta(seconds=quorum_timeout),
            connect_timeout=FT_TIMEOUT, init_sync=False)
        self.manager.register_state_dict_fn("meshtrain", load, state)
        self.members: list[int] = []  # the groups that took part in the latest step
        self.fields = sorted(fingerprint)
        self._hashes = torch.tensor([_hash(f"{key}={fingerprint[key]}") for key in self.fields],
                                    dtype=torch.float64, device=mesh.device)
        self._compared = -1  # the latest quorum whose fingerprints were compared
        self.committed = 0  # steps this process took part in
        self.discarded = 0  # steps this process saw dropped

    def resume_at(self, step: int) -> None:
        """Count from a checkpoint's step (a group with more steps still heals the others)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def start_step(self) -> int:
        """Join the next quorum (healing from a live group first when behind); returns the
        step to take (0-based), the groups' committed count. At a new quorum the groups
        compare their settings first (`_compare_fingerprints`)."""
        self.manager.start_quorum()
        quorum = self.manager._quorum_id  # (torchft 0.2.0 has no public accessor)
        if quorum != self._compared:
            self._compare_fingerprints()
            self._compared = -1 if self.manager.errored() else quorum
        return self.manager.current_step()

    def _compare_fingerprints(self) -> None:
        """Before a gradient is averaged with a group new to the quorum (tensors of other
        shapes would break the reduction): each group sends its settings' hashes in its own
        slot, compared with those of the lowest-numbered group that has committed steps here
        (at the run's first quorum, the lowest-numbered). A group that differs is refused,
        naming the first differing field; the others discard the step (it leaves before the
        next quorum)."""
        n, width = self.num_groups, 2 + len(self.fields)
        slots = torch.zeros(n, width, dtype=torch.float64, device=self.device)
        slots[self.group_id, 0], slots[self.group_id, 1] = 1.0, float(self.committed > 0)
        slots[self.group_id, 2:] = self._hashes
        self.manager.allreduce(slots, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        if self.manager.errored():
            return
        rows = slots.tolist()
        present = [g for g in range(n) if rows[g][0] > 0.5]
        reference = rows[([g for g in present if rows[g][1] > 0.5] or present)[0]][2:]
        for group in present:
            differing = [key for key, mine, theirs in zip(self.fields, rows[group][2:],
                                                          reference, strict=True)
                         if mine != theirs]
            if differing and group == self.group_id:
                raise SettingError(Code.REPLICA_GROUP_MISMATCH, _mismatch(group, differing[0]))
            if differing:
                self.manager.report_error(RuntimeError(f"group {group}: another"
                                                       f" `{differing[0]}`"))

    def reduce(self, grads) -> None:
        """Average this rank's gradients with the same rank of every participating group: one
        flat buffer per dtype, so a step costs one torchft reduction, not one per tensor."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        flats = {dtype: torch.cat([g.reshape(-1) for g in group])
                 for dtype, group in by_dtype.items()}
        works = [self.manager.allreduce(flat) for flat in flats.values()]
        for work in works:
            work.wait()
        for dtype, group in by_dtype.items():
            for grad, piece in zip(group, flats[dtype].split([g.numel() for g in group]),
                                   strict=True):
                grad.copy_(piece.view_as(grad))

    def reduce_scalars(self, loss: torch.Tensor, request: torch.Tensor | None) -> torch.Tensor:
        """The loss averaged over the participating groups (and `request`, the stop/save
        decision, their maximum, in place); records which groups took part (`members`)."""
        n = self.num_groups
        joint = torch.zeros(1 + n, dtype=torch.float64, device=self.device)
        joint[0], joint[1 + self.group_id] = loss, 1.0
        works = [self.manager.allreduce(joint, reduce_op=torch.distributed.ReduceOp.SUM)]
        if request is not None:
            works.append(self.manager.allreduce(request.reshape(1),
                                                reduce_op=torch.distributed.ReduceOp.MAX))
        for work in works:
            work.wait()
        values = joint.tolist()
        self.members = [g for g in range(n) if values[1 + g] > 0.5] or [self.group_id]
        return torch.tensor(values[0] / len(self.members), dtype=loss.dtype, device=self.device)

    def commit(self) -> bool:
        """Whether the step commits: every rank of every participating group reduced cleanly
        and at least `min_replica_groups` took part (else every group discards it)."""
        committed = self.manager.should_commit()
        self.committed += committed
        self.discarded += not committed
        return committed

    @property
    def leader(self) -> bool:
        """Whether this group writes the run's files: the lowest-numbered one taking part."""
        return bool(self.members) and self.group_id == min(self.members)

    def row(self) -> dict:
        """The metrics of the latest step: how many groups took part and, when some did not,
        which (their sequences of the global batch were not trained on)."""
        missing = [g for g in range(self.num_groups) if g not in self.members]
        return {"replica_groups": len(self.members)} | (
            {"groups_missing": missing} if missing else {})

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def check_fingerprint(group_id: int, mine: dict[str, str], theirs: dict[str, str]) -> None:
    """Refuse a live state sent by a group of another model or layout (a healing group would
    otherwise load tensors of other shapes), naming the first differing field."""
    for key in sorted(mine.keys() | theirs.keys()):
        if mine.get(key) != theirs.get(key):
            raise SettingError(Code.REPLICA_GROUP_MISMATCH, _mismatch(group_id, key))


def _mismatch(group_id: int, key: str) -> str:
    return (f"replica group {group_id}: `{key}` differs from the running groups': start every"
            " group with the same model and layout settings")


def _hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:5], 16)


def _quiet_torchft() -> None:
    """torchft's per-quorum info, its tracebacks of a reduction a dead peer broke (the failed
    group's restart line names the failure), the checkpoint server's access lines and torch's
    note on the read-only buffers it receives are no news to a user."""
    logging.getLogger("torchft").setLevel(logging.CRITICAL)  # (a peer's death: its own line)
    http.server.BaseHTTPRequestHandler.log_message = lambda self, *args: None
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _http(address: str) -> str:
    return address if "://" in address else f"http://{address}"
