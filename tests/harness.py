"""The one way tests (and benchmarks) run ranks: a function on N gloo ranks, with ranks spawned
once per world size and reused; and meshtrain's command line or a script under torchrun in a
subprocess, for what only a real launch shows.

    results = run_on_ranks(2, check_something, arg)   # one result per rank

The function must live at module level in an importable module (a test file is fine). Workers
keep their process group between calls; `worker_mesh(...)` caches meshes by degrees so tests do not
create new process groups each time. A rank that raises fails the call with its traceback; a call
that does not finish within `timeout` seconds kills the pool (the next call starts a fresh one).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import queue
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

from meshtrain.operations.stopping import rank_processes
from meshtrain.parallelize import build_model

_pools: dict[int, RankPool] = {}
_worker_meshes: dict = {}  # in worker processes only


def _worker(rank: int, world_size: int, port: int, env: dict, tasks, results,
            release_groups: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.clear()  # the pool's creator's environment, as a spawned worker would see it
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        while (task := tasks.get()) is not None:
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # report anything, including assertion failures
                results.put((rank, False, traceback.format_exc()))
            if release_groups:
                _release_task_groups()
            # What a task leaves alive (cached meshes, imported modules) stays for good: out of
            # the collector's reach, later tasks' collections stop walking it again and again.
            gc.collect()
            gc.freeze()
    finally:
        dist.destroy_process_group()


def _release_task_groups() -> None:
    """Destroy the process groups a task made beyond the cached meshes' (a run builds its own
    mesh). Gloo wakes each group's socket loop every 10 ms: the hundreds a pool piled up over
    the suite kept idle pools busy, slowing every other test."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    kept = {dist.group.WORLD}.union(*(mesh.process_groups for mesh in _worker_meshes.values()))
    for group in list(_world.pg_map):
        if group not in kept:
            dist.destroy_process_group(group)


# What every worker imports before its first task; the fork server imports it once.
_PRELOAD = ["torch._dynamo", "meshtrain.training.trainer", "meshtrain.cli.main", "harness"]


def _worker_context():
    """Workers forked from one server that imported torch and meshtrain once (a clean process:
    no threads, no OpenMP pool), instead of each importing them again: a spawned 8-rank pool
    paid the imports eight times over on two cores."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankPool:
    """`world_size` gloo ranks that run functions until closed; `with RankPool(n) as pool:`
    closes them on leaving (run_on_ranks keeps one pool per world size instead). With
    `release_groups` (run_on_ranks' pools) each task's process groups beyond the cached meshes
    are destroyed after it; without (the benchmarks), a task's groups serve later tasks."""

    def __init__(self, world_size: int, release_groups: bool = False):
        from meshtrain.parallel.runtime.process_groups import free_port

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        ctx = _worker_context()
        port = free_port()
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        env = dict(os.environ)
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, env, self.tasks[r],
                                                        self.results, release_groups),
                                  daemon=True)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        results: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            if any(not ok for ok, _ in results.values()):
                deadline = min(deadline, time.monotonic() + 5.0)  # peers may be stuck waiting
            wait = min(5.0, max(0.05, deadline - time.monotonic()))  # wake to see dead ranks
            try:
                rank, ok, value = self.results.get(timeout=wait)
                results[rank] = (ok, value)
            except queue.Empty:
                if time.monotonic() >= deadline or not all(p.is_alive() for p in self.procs):
                    break
        failures = {r: v for r, (ok, v) in results.items() if not ok}
        if failures or len(results) < self.world_size:
            exited = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            self.close(kill=True)
            if failures:
                rank = min(failures)
                raise AssertionError(f"rank {rank} of {self.world_size} failed:\n{failures[rank]}")
            missing = sorted(set(range(self.world_size)) - set(results))
            died = f" (ranks {exited} exited)" if exited else ""
            raise TimeoutError(f"ranks {missing} of {self.world_size} did not finish"
                               f" {fn.__name__} within {timeout}s{died}")
        return [results[r][1] for r in range(self.world_size)]

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, kill: bool = False) -> None:
        if _pools.get(self.world_size) is self:  # not another pool of run_on_ranks' cache
            del _pools[self.world_size]
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def run_on_ranks(world_size: int, fn, *args, timeout: float = 120.0, **kwargs) -> list:
    """Run `fn(*args, **kwargs)` on every rank of a `world_size` gloo pool; per-rank results."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = RankPool(world_size, release_groups=True)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def _close_all() -> None:
    for pool in list(_pools.values()):
        pool.close()


def worker_mesh(**degrees):
    """The ParallelMesh for these degrees in this worker, created once per test module."""
    from meshtrain.parallel.runtime.process_groups import init_parallel

    key = tuple(sorted(degrees.items()))
    if key not in _worker_meshes:
        _worker_meshes[key] = init_parallel(**degrees, device="cpu")
    return _worker_meshes[key]


def _forget_meshes() -> None:
    _worker_meshes.clear()  # (their groups go as the task ends)


def forget_meshes() -> None:
    """Every pool drops its cached meshes and their groups (conftest: as a test module ends, so
    idle pools hold no groups of modules that are done)."""
    for pool in list(_pools.values()):
        with contextlib.suppress(AssertionError, TimeoutError):  # it closed itself: fresh next
            pool.run(_forget_meshes)


@contextlib.contextmanager
def raises_as_flags(match: str):
    """`pytest.raises(ValueError, match=match)`, matched on the message as the CLI prints it:
    library errors name settings (`pp_schedule`), the CLI shows flags (--pp-schedule)."""
    import pytest

    from meshtrain.cli.flags import as_flags

    with pytest.raises(ValueError) as error:
        yield error
    shown = as_flags(str(error.value))
    assert re.search(match, shown), f"{match!r} not found in {shown!r}"


LLAMA = {"model": "llama-tiny"}  # model settings of the Llama family's parity runs


def dense_reference(cfg, vocab_size: int = 256):
    """The single-process model of a run's settings (its family, its seed)."""
    from meshtrain import ParallelMesh

    model_cfg = cfg.model_config(vocab_size)
    return build_model(model_cfg, ParallelMesh.local(), seed=cfg.train.seed)


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m meshtrain ARGS` in a subprocess (one thread per rank it spawns)."""
    result = subprocess.run([sys.executable, "-m", "meshtrain", *args], capture_output=True,
                            text=True, timeout=240, env=_one_thread())
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def start_cli(*args: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE) -> subprocess.Popen:
    """`python -m meshtrain ARGS` started, not waited for (to signal or kill it meanwhile)."""
    return subprocess.Popen([sys.executable, "-m", "meshtrain", *args], env=_one_thread(),
                            text=True, stdout=stdout, stderr=stderr)


def pipe_holders(pipe) -> list[str]:
    """'pid: command line' of every other process holding an end of `pipe` (a file object from
    `Popen`): who keeps a child's stdout or stderr open after the child has exited."""
    name = f"pipe:[{os.fstat(pipe.fileno()).st_ino}]"
    holders = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        pid = int(fd_dir.parent.name)
        with contextlib.suppress(OSError):
            if pid != os.getpid() and any(os.readlink(fd) == name for fd in fd_dir.iterdir()):
                command = (fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                holders.append(f"{pid}: {command.decode(errors='replace').strip()}")
    return holders


def run_torchrun(script: str, *args: str, nproc: int = 2,
                 timeout: float = 180) -> subprocess.CompletedProcess:
    """`script ARGS` on `nproc` local ranks under torchrun (torch's elastic launcher)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), script, *args], capture_output=True,
                          text=True, timeout=timeout, env=_one_thread())


def rank_pids(parent: int) -> dict[int, int]:
    """Global rank -> pid of `parent`'s children that are ranks."""
    return rank_processes(parent)


def _one_thread() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1")


def word_level_tokenizer(folder, words: int, special: str):
    """`folder`/tokenizer.json: a Hugging Face word-level tokenizer of the words w0 .. w{words-1},
    [UNK] and one special token, made with the tokenizers library."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(words)} | {"[UNK]": words}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([special])
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def cp_core_errors(full: list, reference, mine, mesh, cp_mode: str, mask) -> float:
    """Largest difference between this cp rank's attention core on its tokens `mine` (output
    and q/k/v gradients, of the summed squared output) and the dense `reference` computed from
    `full` (whose gradients the caller's backward filled)."""
    from meshtrain.parallel.layers.attention import AttentionCore

    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in full]
    core = AttentionCore(dropout=0.0, eager=False, cp_axis=mesh.cp, cp_mode=cp_mode,
                         recompute=False)
    out = core(*local, None, mask)
    out.pow(2).sum().backward()
    errors = [(out - reference[:, :, mine]).abs().max().item()]
    errors += [(t.grad - f.grad[:, :, mine]).abs().max().item()
               for t, f in zip(local, full, strict=True)]
    return max(errors)
