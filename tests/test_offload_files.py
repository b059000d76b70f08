"""A run owns its NVMe offload files: its folder is named by its `out` and locked per rank like
`out`, every read is checked against the run's last write of that file, and a name too long
for the filesystem is refused before any rank starts."""

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from harness import run_cli, run_on_ranks, start_cli, worker_mesh
from test_nvme_offload import _cfg, _rows
from test_stopping import _finish, _meshtrain_lines, _wait_for_step

from meshtrain.config.run_config import build_config
from meshtrain.operations.failures import EXIT_BAD_INPUT, RunFailure
from meshtrain.operations.run_lock import OffloadLock, RunLock
from meshtrain.parallel.runtime.nvme_offload import CHUNK, NvmeStore, OffloadFileChanged
from meshtrain.training.trainer import Trainer

FLAGS = ["--zero", "2", "--bucket-mb", "0.05", "--seq-len", "32", "--global-batch", "8",
         "--micro-batch", "2", "--offload-optimizer", "nvme"]


def _nvme(out, folder, **logging):
    return build_config({}, {"parallel": {"offload_optimizer": "nvme", "offload_dir": folder},
                             "checkpoint": {"out": str(out)}, "logging": logging})


def test_runs_into_outs_of_one_name_get_folders_of_their_own(tmp_path, monkeypatch):
    a, b = _nvme(tmp_path / "a" / "r", "off"), _nvme(tmp_path / "b" / "r", "off")
    assert a.offload_run_folder != b.offload_run_folder
    assert a.offload_run_folder.name.startswith("r-")
    # the same run (resumed, or named through a relative path) finds its own folder again
    monkeypatch.chdir(tmp_path)
    assert _nvme(Path("a") / "r", "off").offload_folder(1) == a.offload_folder(1)
    named = _nvme(tmp_path / "a" / "r", "off", run_name="../x/y")  # no way out of the folder
    assert named.offload_run_folder.parent == Path("off")


def _store(folder, sizes=(3 * CHUNK // 12 + 5, 100)):
    store = NvmeStore(folder, list(sizes))
    for k, n in enumerate(sizes):
        store.create(k, torch.arange(n, dtype=torch.float32))
    return store


def _step(store, k, add=1.0):
    store.load(k).add_(add)
    store.release(k, dirty=True)
    store.flush()  # the write has landed


def _flip(store, k):  # a byte in the file's second chunk
    with open(store.path(k), "r+b") as f:
        f.seek(CHUNK + 7)
        byte = f.read(1)
        f.seek(CHUNK + 7)
        f.write(bytes([byte[0] ^ 1]))


def _truncate(store, k):
    os.truncate(store.path(k), CHUNK)


def _stale(store, k):  # the file as it was one write ago
    copy = store.path(k).with_suffix(".old")
    shutil.copy(store.path(k), copy)
    _step(store, k)
    shutil.copyfile(copy, store.path(k))  # in place: a rename would leave the run its file


def _foreign(store, k):  # another run's states for the same bucket
    other = _store(store.directory.parent / "other")
    _step(other, k, add=3.0)  # (the same bytes as ours would be harmless)
    shutil.copy(other.path(k), store.path(k))
    other.close()


@pytest.mark.parametrize("damage", [_flip, _truncate, _stale, _foreign])
def test_a_read_that_is_not_the_runs_last_write_is_refused(tmp_path, damage):
    store = _store(tmp_path / "rank0" / "dense")
    _step(store, 0)
    _step(store, 0)  # read back and checked: the store's own writes pass
    damage(store, 0)
    with pytest.raises(OffloadFileChanged) as failure:
        store.load(0)
    message = str(failure.value)
    assert str(store.path(0)) in message and "\n" not in message
    assert f"not what this run last wrote there (write {store.writes[0]} of it;" in message
    store.close()
    assert not (tmp_path / "rank0").exists()


def _lock_both(folder: str) -> str:
    mesh = worker_mesh(dp=2)
    lock = OffloadLock(Path(folder) / f"rank{mesh.rank}")
    try:
        lock.acquire_agreed(mesh)
    except RunFailure as e:
        assert e.agreed and e.exit_code == EXIT_BAD_INPUT
        return str(e)
    finally:
        lock.release()
    return ""


def test_ranks_agree_on_a_refused_offload_folder(tmp_path):
    run = tmp_path / "off" / "r-1234abcd"
    held = RunLock(run / "rank1", "another-run", "offload_dir")
    held.acquire()  # this process: a live holder
    refusals = run_on_ranks(2, _lock_both, str(run))
    assert refusals[0] == refusals[1] and f"pid {os.getpid()}" in refusals[0]
    assert "the `offload_dir` folder" in refusals[0] and "run id another-run" in refusals[0]
    assert not (run / "rank0").exists()  # rank 0 let its own go
    held.release()
    assert run_on_ranks(2, _lock_both, str(run)) == ["", ""]
    assert not run.exists()


def test_an_offload_run_name_too_long_is_refused_before_ranks_start(corpus, tmp_path):
    result = run_cli("train", "--nproc", "2", *FLAGS, "--offload-dir", str(tmp_path / "off"),
                     "--run-name", "n" * 300, "--data", corpus, "--out", str(tmp_path / "run"),
                     "--steps", "1", check=False)
    assert result.returncode == EXIT_BAD_INPUT
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "is too long for this filesystem" in result.stderr
    assert "choose a shorter --run-name or --offload-dir" in result.stderr
    assert not (tmp_path / "run").exists() and not any((tmp_path / "off").iterdir())


def _damage_until_exit(proc, files, damage):
    """Damage rank 1's offload files again and again (the run rewrites each every step) until
    the run ends."""
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        for path in files.glob("bucket*.bin"):
            try:
                damage(path)
            except FileNotFoundError:
                pass  # the run is removing its files
        time.sleep(0.05)


def _zero_second_half(path):
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        f.write(bytes(size - size // 2))


def _changed_mid_step(corpus, out, folder):
    parallel = {"zero": 1, "bucket_mb": 0.05, "dp": 2, "offload_optimizer": "nvme",
                "offload_dir": folder}
    trainer = Trainer.build(_cfg(corpus, out, parallel), worker_mesh(dp=2))
    trainer.train_step(0)
    saved = trainer.save(Path(out), 1)
    store = trainer.sync.reducers[0].states.files
    store.flush()
    # every rank's (a rank alone would leave its peers waiting in the step's all-gather)
    _zero_second_half(store.path(len(store.sizes) - 1))
    try:
        trainer.train_step(1)
        failure = ""
    except OffloadFileChanged as e:
        failure = str(e)
    trainer.sync.close()
    cpu = Trainer.build(_cfg(corpus, out, {"zero": 1, "dp": 2, "offload_optimizer": "cpu"}),
                        worker_mesh(dp=2))
    return failure, str(store.path(len(store.sizes) - 1)), saved.name, cpu.resume(Path(out))


def test_an_offload_file_changed_between_steps_stops_the_step(corpus, tmp_path):
    """In process (the command line's exit code and line: the extended test below)."""
    ranks = run_on_ranks(2, _changed_mid_step, corpus, str(tmp_path / "run"),
                         str(tmp_path / "off"))
    for failure, path, _, resumed_at in ranks:
        assert failure.startswith(f"nvme offload file {path} is not what this run last wrote")
        assert resumed_at == 1  # the checkpoint saved before is whole


@pytest.mark.extended  # 17 s; the in-process test above checks the step against the same files
def test_an_offload_file_changed_mid_run_stops_it_with_the_checkpoint_whole(corpus, tmp_path):
    out, folder = tmp_path / "run", tmp_path / "off"
    flags = ["train", "--nproc", "2", *FLAGS, "--offload-dir", str(folder), "--data", corpus,
             "--out", str(out)]
    proc = start_cli(*flags, "--steps", "300", "--save-every", "2")
    _wait_for_step(out, 3, proc)
    rank1 = _nvme(out, str(folder)).offload_folder(1) / "dense"
    _damage_until_exit(proc, rank1, _zero_second_half)
    code, err = _finish(proc)
    lines = _meshtrain_lines(err)
    assert code == EXIT_BAD_INPUT and len(lines) == 1, err[-3000:]
    assert f"nvme offload file {rank1}/bucket" in lines[0]
    assert "another process or the disk changed it" in lines[0]
    assert not folder.exists() or not any(folder.iterdir())  # the run's files are gone
    # the last checkpoint is whole: the same run resumes from it (its own folder again)
    saved = max(_rows(out))
    run_cli(*flags, "--resume", "--steps", str(saved + 2))
    assert max(_rows(out)) == saved + 2


def test_a_held_offload_folder_refuses_the_run_before_ranks_start(corpus, tmp_path):
    out, folder = tmp_path / "run", tmp_path / "off"
    held = RunLock(_nvme(out, str(folder)).offload_folder(1), "another-run", "offload_dir")
    held.acquire()  # this process: a live run holding rank 1's folder
    result = run_cli("train", "--nproc", "2", *FLAGS, "--offload-dir", str(folder), "--data",
                     corpus, "--out", str(out), "--steps", "1", check=False)
    held.release()
    assert result.returncode == EXIT_BAD_INPUT
    assert result.stderr.strip().splitlines() == [
        f"meshtrain: error: the --offload-dir folder {held.out} is in use by another run (host"
        f" {os.uname().nodename}, pid {os.getpid()}, run id another-run): wait for it to end or"
        f" choose another --offload-dir; if that run is gone, delete {held.path}"]
    assert not out.exists()


@pytest.mark.extended  # 15 s; the test above refuses the same way with this process the holder
def test_a_second_live_run_on_the_same_offload_folder_is_refused(corpus, tmp_path):
    out, folder = tmp_path / "run", tmp_path / "off"
    flags = ["train", "--nproc", "2", *FLAGS, "--offload-dir", str(folder), "--data", corpus,
             "--out", str(out)]
    first = start_cli(*flags, "--steps", "3000")
    _wait_for_step(out, 1, first)
    (out / ".lock").unlink()  # `out`'s lock deleted by hand while its run lives
    second = run_cli(*flags, "--steps", "3000", "--auto-resume", check=False)
    first.terminate()
    code, _ = _finish(first)
    assert code == 3  # the first run was untouched: stopped by the signal, with a checkpoint
    assert second.returncode == EXIT_BAD_INPUT
    [line] = second.stderr.strip().splitlines()
    assert "--offload-dir folder" in line and "is in use by another run (host" in line
    assert not any(folder.iterdir())
