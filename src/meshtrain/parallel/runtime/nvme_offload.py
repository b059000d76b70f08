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

Every read is checked against the store's own last write of that file: each chunk's CRC-32,
taken by the I/O thread as it writes the chunk, is compared with the CRC of the bytes read back,
and a file shorter than written fails its read. A mismatch (another process or the disk changed
the file) raises `OffloadFileChanged` naming the file and the store's write number of it
(its sequence, counted per bucket), so a run stops instead of stepping on foreign states.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import weakref
import zlib
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


class OffloadFileChanged(ValueError):
    """An offload file read back differs from what its store last wrote there (changed, cut
    short or overwritten by another process): the states a step would use are not the run's."""


LONGEST_FILE = Path("rank99999", "experts", "bucket99999.bin")
"""The deepest file a run may make under its offload folder (as `RunConfig.offload_folder`
and `sync.py` name them), for the length check before ranks start."""


def check_offload_dir(folder: Path, nbytes: int, run_folder: Path | None = None) -> None:
    """Create `folder` when missing and refuse it, before any rank starts, when it cannot be
    created or written or has less free room than `nbytes` (the states offloaded to it); the
    run's own folder inside it (`run_folder`) when its name or its deepest file's path is too
    long for the filesystem, or it cannot be made there."""
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
    if run_folder is not None:
        _check_run_folder(folder, run_folder)
    free = stats.f_bavail * stats.f_frsize
    if free < nbytes:
        raise SettingError(Code.OFFLOAD_DIR, (
            f"`offload_dir` {folder} has {free / 2**30:.2f} GiB free, the offloaded optimizer"
            f" states need {nbytes / 2**30:.2f} GiB: free room or choose another"
            " `offload_dir`"))


def _check_run_folder(folder: Path, run_folder: Path) -> None:
    """The run's folder fits the filesystem's name and path limits, and can be made."""
    name = run_folder.name
    shown = name if len(name) <= 60 else f"{name[:40]}...({len(name)} characters)"
    longest, path_max = _limit(folder, "PC_NAME_MAX", 255), _limit(folder, "PC_PATH_MAX", 4096)
    deepest = len(os.fsencode(run_folder.absolute() / LONGEST_FILE))
    if len(os.fsencode(name)) > longest or deepest >= path_max:
        raise SettingError(Code.OFFLOAD_DIR, (
            f"`offload_dir` {folder}: the run's folder {shown} is too long for this filesystem"
            f" (a name of at most {longest} bytes, paths under {path_max}): choose a shorter"
            " `run_name` or `offload_dir`"), settings=("offload_dir", "run_name"))
    made = not run_folder.exists()
    try:
        run_folder.mkdir(exist_ok=True)
        if made:
            run_folder.rmdir()
    except OSError as e:
        raise SettingError(Code.OFFLOAD_DIR, (
            f"`offload_dir` {folder}: the run's folder {shown} cannot be made there"
            f" ({e.strerror or e}): choose a shorter `run_name` or another `offload_dir`"),
            settings=("offload_dir", "run_name")) from e


def _limit(folder: Path, name: str, default: int) -> int:
    """A filesystem limit of `folder` (Linux's default where the filesystem names none)."""
    try:
        value = os.pathconf(folder, name)
    except (OSError, ValueError):
        return default
    return value if value > 0 else default


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


def _transfer(write: bool, fd: int, view: memoryview, offset: int) -> bool:
    """One chunk, looping over short transfers (a signal, a full pipe of the kernel); False
    when a read met the end of the file first."""
    done = 0
    while done < len(view):
        part = view[done:]
        n = os.pwritev(fd, [part], offset + done) if write else \
            os.preadv(fd, [part], offset + done)
        if n <= 0:
            if not write:
                return False
            raise OSError(errno.EIO, "an offload file's write made no progress")
        done += n
    return True


class Slab:
    """One page-aligned host buffer and the fp32 tensor over it."""

    def __init__(self, nbytes: int):
        self.buffer = mmap.mmap(-1, nbytes)
        self.tensor = torch.frombuffer(self.buffer, dtype=torch.float32)
        self.owner: int | None = None  # the bucket whose states it holds
        self.pending: list[Future] = []  # its read or write in flight
        self.written: int | None = None  # the bucket of its last write, while that may pend


class NvmeStore:
    """The files of one rank's buckets under `directory`, and the window of slabs.

    `create(k, master)` writes bucket k's first state (moments zero); `load(k)` returns its
    slab's tensor (after a read-ahead started by `prefetch(k)`, or now); `release(k, dirty)`
    writes it back behind the caller's next work (`dirty`) and frees the slab for reuse.
    `write` is the seam every byte to disk goes through (tests inject a full disk there).
    `verify`: check each read against the last write (off only to measure what it costs)."""

    verify = True

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
        # per bucket: how many times the store wrote its file, and each chunk's CRC-32 then
        self.writes = [0] * len(shard_sizes)
        self.digests: list[list[int | None]] = [
            [None] * len(range(0, n, CHUNK)) for n in self.nbytes]
        self._finalizer = weakref.finalize(self, _remove, self.pool, list(self.fds),
                                           self.directory)

    @property
    def offloaded_bytes(self) -> int:
        return sum(STATE_BYTES * n for n in self.sizes)

    def write(self, fd: int, view: memoryview, offset: int) -> None:
        _transfer(True, fd, view, offset)

    def path(self, k: int) -> Path:
        return self.directory / f"bucket{k}.bin"

    def _put(self, k: int, i: int, view: memoryview, offset: int) -> None:
        """Chunk i of bucket k to disk, its CRC kept as what a read must find."""
        self.digests[k][i] = zlib.crc32(view) if self.verify else None
        self.write(self.fds[k], view, offset)

    def _get(self, k: int, i: int, view: memoryview, offset: int) -> None:
        """Chunk i of bucket k from disk, refused unless it is what the store last wrote."""
        whole = _transfer(False, self.fds[k], view, offset)
        expected = self.digests[k][i]
        if whole and (expected is None or zlib.crc32(view) == expected):
            return
        what = f"ends before byte {offset + len(view)}" if not whole else \
            f"bytes {offset}-{offset + len(view)} differ"
        raise OffloadFileChanged(
            f"nvme offload file {self.path(k)} is not what this run last wrote there (write"
            f" {self.writes[k]} of it; {what}): another process or the disk changed it, so the"
            " run stopped before using it; its checkpoints are untouched: find what writes"
            " into `offload_dir`, then resume")

    def _submit(self, slab: Slab, k: int, write: bool) -> None:
        view = memoryview(slab.buffer)[:self.nbytes[k]]
        if write:
            self.bytes_written += self.nbytes[k]
            self.writes[k] += 1
        else:
            self.bytes_read += self.nbytes[k]
        slab.written = k if write else None
        move = self._put if write else self._get
        slab.pending = [self.pool.submit(move, k, i, view[a:a + CHUNK], a)
                        for i, a in enumerate(range(0, self.nbytes[k], CHUNK))]

    def _wait(self, slab: Slab) -> None:
        pending, slab.pending, slab.written = slab.pending, [], None
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
        for slab in self.slabs:  # k's last write lands before k is read back
            if slab.written == k:
                self._wait(slab)
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

    def flush(self) -> None:
        """Wait for every read and write in flight."""
        for slab in self.slabs:
            self._wait(slab)

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
