"""NVMe offload of ZeRO's optimizer states (ZeRO-Infinity's idea): each bucket's fp32 master
shard and Adam moments live in one file, and only a window of buckets is in host memory.

A bucket's file holds three runs of `shard_size` fp32 values: master, exp_avg, exp_avg_sq,
padded to the 4 KiB a direct-I/O transfer needs. The host side is a pool of `WINDOW`
page-aligned slabs (anonymous mmap), each big enough for the largest bucket: while the
optimizer steps bucket k, bucket k+1 is being read into one slab and bucket k-1 written from
another, so at most three buckets' states are in memory. Reads and writes are split into
chunks that a small thread pool moves with `os.preadv`/`os.pwritev`; files are opened with
`O_DIRECT` where the filesystem takes it (the page cache would otherwise keep a second copy),
buffered otherwise. The files are removed when the store closes or the process exits.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from meshtrain.errors import Code, SettingError

WINDOW = 3
"""Slabs in host memory: the bucket being stepped, the next one read ahead, the last written."""
ALIGN = 4096
"""Direct I/O needs offsets, lengths and buffers aligned to the device's block (4 KiB covers
every NVMe and most filesystems)."""
CHUNK = 8 * 2**20
"""Bytes per I/O task: several in flight keep an NVMe queue busy."""
THREADS = 4
STATES = 3  # master, exp_avg, exp_avg_sq
STATE_BYTES = STATES * 4
"""Bytes offloaded per parameter: fp32 master, exp_avg and exp_avg_sq."""


def check_offload_dir(folder: Path, nbytes: int) -> None:
    """Create `folder` when missing and refuse it, before any rank starts, when it cannot be
    created or written or has less free room than `nbytes` (the states offloaded to it)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(b"0" * ALIGN)
            probe.flush()
        stats = os.statvfs(folder)
    except OSError as e:
        raise SettingError(Code.OFFLOAD_DIR, (
            f"`offload_dir` {folder} cannot be created or written ({e.strerror or e}):"
            " choose another `offload_dir`")) from e
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise SettingError(Code.OFFLOAD_DIR, (
            f"`offload_dir` {folder} has {free / 2**30:.2f} GiB free, the offloaded optimizer"
            f" states need {nbytes / 2**30:.2f} GiB: free room or choose another"
            " `offload_dir`"))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _open(path: Path) -> tuple[int, bool]:
    """A read-write descriptor, direct where the filesystem allows it (tmpfs refuses)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def _transfer(write: bool, fd: int, view: memoryview, offset: int) -> None:
    """One chunk, looping over short transfers (a signal, a full pipe of the kernel)."""
    done = 0
    while done < len(view):
        part = view[done:]
        n = os.pwritev(fd, [part], offset + done) if write else \
            os.preadv(fd, [part], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short read of an offload file")
        done += n


class Slab:
    """One page-aligned host buffer and the fp32 tensor over it."""

    def __init__(self, nbytes: int):
        self.buffer = mmap.mmap(-1, nbytes)
        self.tensor = torch.frombuffer(self.buffer, dtype=torch.float32)
        self.owner: int | None = None  # the bucket whose states it holds
        self.pending: list[Future] = []  # its read or write in flight


class NvmeStore:
    """The files of one rank's buckets under `directory`, and the window of slabs.

    `create(k, master)` writes bucket k's first state (moments zero); `load(k)` returns its
    slab's tensor (after a read-ahead started by `prefetch(k)`, or now); `release(k, dirty)`
    writes it back behind the caller's next work (`dirty`) and frees the slab for reuse.
    `write` is the seam every byte to disk goes through (tests inject a full disk there)."""

    def __init__(self, directory: Path, shard_sizes: list[int]):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.sizes = shard_sizes
        self.nbytes = [_aligned(STATE_BYTES * n) for n in shard_sizes]
        self.fds: list[int] = []
        self.direct = []
        for k in range(len(shard_sizes)):
            fd, direct = _open(self.directory / f"bucket{k}.bin")
            self.fds.append(fd)
            self.direct.append(direct)
        slab_bytes = max(self.nbytes, default=ALIGN)
        self.slabs = [Slab(slab_bytes) for _ in range(min(WINDOW, len(shard_sizes)))]
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="nvme-offload")
        self.bytes_read = self.bytes_written = 0
        self._finalizer = weakref.finalize(self, _remove, self.pool, list(self.fds),
                                           self.directory)

    @property
    def offloaded_bytes(self) -> int:
        return sum(STATE_BYTES * n for n in self.sizes)

    def write(self, fd: int, view: memoryview, offset: int) -> None:
        _transfer(True, fd, view, offset)

    def _read(self, fd: int, view: memoryview, offset: int) -> None:
        _transfer(False, fd, view, offset)

    def _submit(self, slab: Slab, k: int, write: bool) -> None:
        view = memoryview(slab.buffer)[:self.nbytes[k]]
        move = self.write if write else self._read
        if write:
            self.bytes_written += self.nbytes[k]
        else:
            self.bytes_read += self.nbytes[k]
        slab.pending = [self.pool.submit(move, self.fds[k], view[a:a + CHUNK], a)
                        for a in range(0, self.nbytes[k], CHUNK)]

    def _wait(self, slab: Slab) -> None:
        pending, slab.pending = slab.pending, []
        for future in pending:
            try:
                future.result()
            except OSError as e:
                raise SettingError(Code.OFFLOAD_DIR, (
                    f"`offload_dir` {self.directory}: moving optimizer states failed"
                    f" ({e.strerror or e}): free room there or choose another"
                    " `offload_dir`")) from e

    def _slab_for(self, k: int) -> Slab:
        """The slab holding bucket k, or a free one (the oldest write finished first)."""
        for slab in self.slabs:
            if slab.owner == k:
                return slab
        free = [s for s in self.slabs if s.owner is None]
        # a slab whose write has landed first, else the one written longest ago
        slab = next((s for s in free if all(f.done() for f in s.pending)), None) or \
            (free[0] if free else None)
        if slab is None:
            raise RuntimeError("nvme offload: every slab is in use (release buckets in turn)")
        self._wait(slab)
        slab.owner = k
        return slab

    def create(self, k: int, master: torch.Tensor) -> None:
        """Bucket k's file: `master`, then zero moments (written now, in full)."""
        slab = self._slab_for(k)
        values = slab.tensor[:STATES * self.sizes[k]]
        values.zero_()
        values[:self.sizes[k]].copy_(master)
        self._submit(slab, k, write=True)
        self._wait(slab)
        slab.owner = None

    def prefetch(self, k: int) -> None:
        if any(s.owner == k for s in self.slabs) or all(s.owner is not None for s in self.slabs):
            return
        self._submit(self._slab_for(k), k, write=False)

    def load(self, k: int) -> torch.Tensor:
        """Bucket k's states as one tensor [master | exp_avg | exp_avg_sq] in host memory."""
        resident = any(s.owner == k for s in self.slabs)
        slab = self._slab_for(k)
        if not resident:
            self._submit(slab, k, write=False)
        self._wait(slab)
        return slab.tensor[:STATES * self.sizes[k]]

    def release(self, k: int, *, dirty: bool) -> None:
        """Write bucket k back (asynchronously) if it changed; its slab is free once done."""
        slab = next(s for s in self.slabs if s.owner == k)
        if dirty:
            self._submit(slab, k, write=True)
        slab.owner = None

    def close(self) -> None:
        """Remove the files (after a failed write too: they are no checkpoint)."""
        self._finalizer()


def _remove(pool: ThreadPoolExecutor, fds: list[int], directory: Path) -> None:
    """Close and delete the store's files, then the rank's and the run's folders once
    nothing else is left in them (`directory` is run/rank<N>/<reducer>)."""
    pool.shutdown(wait=True)
    for fd in fds:
        os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)
    for folder in (directory.parent, directory.parent.parent):
        try:
            folder.rmdir()
        except OSError:
            return  # another reducer's or rank's files are still there
