"""Every collective meshtrain sends, in one file.

Plain helpers (`all_reduce`, `all_gather`, `reduce_scatter`, `broadcast`, `reduce`, ...) that
take the mesh axis explicitly and report each call to the active `CommRecorder`s, so tests and
benchmarks count communication exactly. The differentiable operators built on them (Megatron's
f and g, sequence-parallel regions, the all-to-all of MoE and Ulysses) are in `regions.py`.

A collective that a layer runs as ring steps to overlap it with compute (`ring_exchange`) is
recorded once, as the collective it replaces (`count_ring`).

A collective over an axis of size 1 is skipped and not recorded: nothing is sent. Every call is
also reported to the armed `FlightRecorder` (the ring the hang watchdog dumps), which tracks when
this rank blocks in it: async works come back wrapped so that their `wait()` is tracked too.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import flight_recorder
from meshtrain.parallel.communication.flight_recorder import Entry

# The `*_tensor` spellings exist in every torch >= 2.6; newer releases flag them as deprecated
# in favour of `*_single`, which older ones lack. Keep one spelling and silence only that notice.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)",
                        category=FutureWarning)


@dataclass(frozen=True)
class CommRecord:
    """One collective call. `payload_bytes` is numel x itemsize of the full tensor involved:
    the reduced tensor (all-reduce), the gathered output (all-gather), the scattered input
    (reduce-scatter), the input (all-to-all), the broadcast or reduced tensor, or the message
    (send/recv)."""

    op: str
    axis: str
    group_size: int
    dtype: torch.dtype
    payload_bytes: int
    sent_bytes: int | None = None  # exact bytes leaving this rank, where the formula is not


    @property
    def ring_bytes(self) -> float:
        """Bytes each rank sends in a ring (or pairwise) implementation of this call, averaged
        over the group: (n-1)/n of the payload for all-gather, reduce-scatter, all-to-all and
        the pipelined broadcast and reduce (every rank but one forwards it once), twice that for
        all-reduce; for an all-to-all with known splits, exactly the rows sent to others."""
        if self.sent_bytes is not None:
            return float(self.sent_bytes)
        n = self.group_size
        if self.op == "all_reduce":
            return 2 * (n - 1) / n * self.payload_bytes
        if self.op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce"):
            return (n - 1) / n * self.payload_bytes
        return float(self.payload_bytes)


class CommRecorder:
    """Collects a `CommRecord` for every collective issued while it is active.

    with CommRecorder() as rec:
        loss.backward()
    rec.count(op="all_reduce", axis="tp")
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> CommRecorder:
        _active_recorders.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active_recorders.remove(self)

    def select(self, op: str | None = None, axis: str | None = None) -> list[CommRecord]:
        return [r for r in self.records
                if (op is None or r.op == op) and (axis is None or r.axis == axis)]

    def count(self, op: str | None = None, axis: str | None = None) -> int:
        return len(self.select(op, axis))

    def payload_bytes(self, op: str | None = None, axis: str | None = None) -> int:
        return sum(r.payload_bytes for r in self.select(op, axis))

    def ring_bytes(self, op: str | None = None, axis: str | None = None) -> float:
        return sum(r.ring_bytes for r in self.select(op, axis))


# Observers only: which group a collective uses is always passed explicitly.
_active_recorders: list[CommRecorder] = []
_flight_recorders = flight_recorder.ARMED  # the last one armed is fed


def _record(op: str, axis: MeshAxis, tensor: torch.Tensor, sent_bytes: int | None = None, *,
            blocking: bool = True, peer: int | None = None) -> Entry | None:
    """Report a call to the recorders; returns its flight entry (None when none is armed)."""
    if _active_recorders:
        nbytes = tensor.numel() * tensor.element_size()
        record = CommRecord(op, axis.name, axis.size, tensor.dtype, nbytes, sent_bytes)
        for recorder in _active_recorders:
            recorder.records.append(record)
    return _flight(op, axis, tensor, blocking=blocking, peer=peer)


def _flight(op: str, axis: MeshAxis, tensor: torch.Tensor | None = None, *,
            blocking: bool = True, peer: int | None = None) -> Entry | None:
    """Report a call to the armed flight recorder only (calls the counts leave out)."""
    if _flight_recorders:
        return _flight_recorders[-1].issue(op, axis, tensor, blocking=blocking, peer=peer)
    return None


def _done(entry: Entry | None, work: dist.Work | None = None):
    """After the call: a blocking call has ended; an async one's work comes back tracked."""
    if entry is None or not _flight_recorders:
        return work
    return _flight_recorders[-1].done(entry, work)


# ---------------------------------------------------------------------------------------------
# Plain helpers
# ---------------------------------------------------------------------------------------------

def all_reduce(tensor: torch.Tensor, axis: MeshAxis, *, op: dist.ReduceOp = dist.ReduceOp.SUM,
               async_op: bool = False) -> dist.Work | None:
    """Reduce `tensor` in place over `axis`."""
    if axis.size == 1:
        return None
    entry = _record("all_reduce", axis, tensor, blocking=not async_op)
    return _done(entry, dist.all_reduce(tensor, op=op, group=axis.group, async_op=async_op))


def all_gather(tensor: torch.Tensor, axis: MeshAxis, *, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `tensor` along `dim`, in axis-rank order."""
    if axis.size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty((axis.size * tensor.shape[0],) + tuple(tensor.shape[1:]),
                      dtype=tensor.dtype, device=tensor.device)
    entry = _record("all_gather", axis, out)
    _done(entry, dist.all_gather_into_tensor(out, tensor, group=axis.group))
    if dim % tensor.dim() == 0:
        return out
    return torch.cat(out.chunk(axis.size, dim=0), dim=dim)


def reduce_scatter(tensor: torch.Tensor, axis: MeshAxis, *, dim: int = 0,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum `tensor` over `axis` and keep this rank's 1/N slice along `dim`."""
    if axis.size == 1:
        return tensor
    if tensor.shape[dim] % axis.size:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} is not divisible by"
                         f" the {axis.name} degree {axis.size}")
    if dim % tensor.dim() != 0:
        tensor = torch.cat(tensor.chunk(axis.size, dim=dim), dim=0)
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // axis.size,) + tuple(tensor.shape[1:]),
                      dtype=tensor.dtype, device=tensor.device)
    entry = _record("reduce_scatter", axis, tensor)
    _done(entry, dist.reduce_scatter_tensor(out, tensor, op=op, group=axis.group))
    return out


def reduce_scatter_into(output: torch.Tensor, flat: torch.Tensor, axis: MeshAxis, *,
                        op: dist.ReduceOp = dist.ReduceOp.SUM,
                        async_op: bool = False) -> dist.Work | None:
    """Reduce the flat `flat` over `axis` into `output` (this rank's 1/N of it). `output` may be
    this rank's slice of `flat` itself (in place: no extra buffer)."""
    if axis.size == 1:
        return None
    entry = _record("reduce_scatter", axis, flat, blocking=not async_op)
    return _done(entry, dist.reduce_scatter_tensor(output, flat, op=op, group=axis.group,
                                                   async_op=async_op))


def all_gather_into(flat: torch.Tensor, shard: torch.Tensor, axis: MeshAxis, *,
                    async_op: bool = False) -> dist.Work | None:
    """Concatenate every rank's flat `shard` into `flat`; `shard` may be this rank's slice of
    `flat` (in place)."""
    if axis.size == 1:
        return None
    entry = _record("all_gather", axis, flat, blocking=not async_op)
    return _done(entry, dist.all_gather_into_tensor(flat, shard, group=axis.group,
                                                    async_op=async_op))


def split_along(tensor: torch.Tensor, axis: MeshAxis, *, dim: int = -1) -> torch.Tensor:
    """This rank's 1/N chunk of `tensor` along `dim` (no communication)."""
    if axis.size == 1:
        return tensor
    if tensor.shape[dim] % axis.size:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} is not divisible by"
                         f" the {axis.name} degree {axis.size}")
    return tensor.chunk(axis.size, dim=dim)[axis.rank].contiguous()


def broadcast(tensor: torch.Tensor, axis: MeshAxis, *, src_axis_rank: int = 0) -> None:
    """Overwrite `tensor` on every rank of `axis` with axis rank `src_axis_rank`'s copy."""
    if axis.size == 1:
        return
    entry = _record("broadcast", axis, tensor)
    _done(entry, dist.broadcast(tensor, src=axis.ranks[src_axis_rank], group=axis.group))


def reduce(tensor: torch.Tensor, axis: MeshAxis, *, dst_axis_rank: int,
           op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """Sum `tensor` over `axis` into axis rank `dst_axis_rank`'s copy (the others' copies are
    left in an unspecified state)."""
    if axis.size == 1:
        return
    entry = _record("reduce", axis, tensor)
    _done(entry, dist.reduce(tensor, dst=axis.ranks[dst_axis_rank], op=op, group=axis.group))


def all_to_all(tensor: torch.Tensor, axis: MeshAxis, *, send_splits: list[int],
               recv_splits: list[int]) -> torch.Tensor:
    """Send `send_splits[r]` rows of `tensor` (in order) to axis rank r; receive
    `recv_splits[r]` rows from each. Uneven splits are fine on gloo and NCCL."""
    if axis.size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(recv_splits),) + tuple(tensor.shape[1:]))
    row_bytes = tensor[0].numel() * tensor.element_size() if len(tensor) else 0
    entry = _record("all_to_all", axis, tensor,
                    sent_bytes=(sum(send_splits) - send_splits[axis.rank]) * row_bytes)
    _done(entry, dist.all_to_all_single(out, tensor, output_split_sizes=recv_splits,
                                        input_split_sizes=send_splits, group=axis.group))
    return out


def send(tensor: torch.Tensor, axis: MeshAxis, to: int, *, tag: int = 0) -> dist.Work:
    """Start sending `tensor` to axis rank `to`; wait on the returned work before reusing it."""
    entry = _record("send", axis, tensor, blocking=False, peer=axis.ranks[to])
    return _done(entry, dist.isend(tensor.contiguous(), dst=axis.ranks[to], group=axis.group,
                                   tag=tag))


def recv(tensor: torch.Tensor, axis: MeshAxis, src: int, *, tag: int = 0,
         async_op: bool = False) -> dist.Work | None:
    """Receive into `tensor` from axis rank `src`: blocking, or started (`async_op`: wait on
    the returned work before reading `tensor`)."""
    entry = _record("recv", axis, tensor, blocking=not async_op, peer=axis.ranks[src])
    work = dist.irecv(tensor, src=axis.ranks[src], group=axis.group, tag=tag)
    if async_op:
        return _done(entry, work)
    work.wait()
    return _done(entry)


def ring_shift(tensor: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Send `tensor` to the next rank of `axis` and return the previous rank's (a ring step)."""
    if axis.size == 1:
        return tensor
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    nxt, prev = axis.ranks[(axis.rank + 1) % axis.size], axis.ranks[(axis.rank - 1) % axis.size]
    _record("send", axis, tensor, blocking=False)  # counted as a send (its bytes)
    entry = _flight("sendrecv", axis, tensor, peer=prev)  # blocks on both; named by `prev`
    ops = [dist.P2POp(dist.isend, tensor, nxt, axis.group),
           dist.P2POp(dist.irecv, out, prev, axis.group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    _done(entry)
    return out


class _Works:
    """Several works waited on as one (the sends and receives of one ring step)."""

    __slots__ = ("works",)

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def wait(self, *args) -> bool:
        return all([work.wait(*args) for work in self.works])


def ring_exchange(sends: list[torch.Tensor], recvs: list[torch.Tensor],
                  axis: MeshAxis) -> dist.Work | _Works:
    """One step of a ring, started: send each of `sends` to the next rank of `axis` and
    receive the matching entry of `recvs` from the previous one (entry i under tag i, so several
    rings may share a step). Returns a work to wait on before reading `recvs` or reusing
    `sends`.

    Not counted by itself: the layer that runs a collective as ring steps reports that
    collective once (`count_ring`). The flight recorder sees each step as a sendrecv.
    """
    assert axis.size > 1 and all(t.is_contiguous() for t in (*sends, *recvs))
    nxt, prev = axis.ranks[(axis.rank + 1) % axis.size], axis.ranks[(axis.rank - 1) % axis.size]
    ops = []
    for tag, (send_, recv_) in enumerate(zip(sends, recvs, strict=True)):
        ops += [dist.P2POp(dist.isend, send_, nxt, axis.group, tag),
                dist.P2POp(dist.irecv, recv_, prev, axis.group, tag)]
    entry = _flight("sendrecv", axis, sends[0], blocking=False, peer=prev)
    return _done(entry, _Works(dist.batch_isend_irecv(ops)))


def count_ring(op: str, axis: MeshAxis, chunk: torch.Tensor) -> None:
    """Report to the `CommRecorder`s, once, a collective that a layer runs as `axis.size - 1`
    `ring_exchange` steps of `chunk`-sized pieces (the overlapped tensor-parallel linears): as
    the single `op` ("all_gather" or "reduce_scatter") it replaces, whose payload is the whole
    tensor of `axis.size` such chunks. So the counts, payload bytes and ring bytes equal the
    unchunked call's: a ring all-gather or reduce-scatter sends (n-1)/n of that payload per
    rank, which is what the steps send."""
    if axis.size == 1 or not _active_recorders:
        return
    nbytes = chunk.numel() * chunk.element_size() * axis.size
    record = CommRecord(op, axis.name, axis.size, chunk.dtype, nbytes)
    for recorder in _active_recorders:
        recorder.records.append(record)


def backend(axis: MeshAxis) -> str:
    """The backend `axis`'s collectives run on ("gloo", "nccl"): what a measurement of them
    describes."""
    return dist.get_backend(axis.group)


def barrier(axis: MeshAxis) -> None:
    if axis.size > 1:
        _done(_flight("barrier", axis), dist.barrier(group=axis.group))


def all_gather_objects(obj, axis: MeshAxis) -> list:
    """Every rank's picklable `obj`, in axis-rank order (small metadata only)."""
    if axis.size == 1:
        return [obj]
    out = [None] * axis.size
    entry = _flight("all_gather_object", axis)
    dist.all_gather_object(out, obj, group=axis.group)
    _done(entry)
    return out
