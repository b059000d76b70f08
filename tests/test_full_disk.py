"""A real full filesystem: a small tmpfs mounted under the test's folder (the tests run as root;
elsewhere they skip, saying why), filled with a file until a checkpoint cannot be written. The
run ends with exit 1 (a failed write, as the guide's table says) on the synchronous and the
background save path alike, one line printed once for both ranks, no traceback, and the
checkpoint saved before it intact and named as the one to continue from."""

import contextlib
import os
import subprocess

import pytest
from harness import run_cli

from meshtrain.checkpointing.checkpoint import latest_checkpoint, read_manifest
from meshtrain.operations.failures import EXIT_FAILED

TINY = ["train", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32", "--num-heads",
        "2", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--eval-every", "0",
        "--log-every", "1", "--nproc", "2", "--tp", "2", "--steps", "4", "--save-every", "2"]
MARGIN = 96 * 1024  # free bytes left: room for metrics rows, not for a rank file (> 130 KB)


@contextlib.contextmanager
def small_tmpfs(folder, size: str = "4m"):
    """A fresh tmpfs of `size` mounted at `folder` for the test's duration."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(folder)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'not root'}):"
                    " a real full filesystem needs one")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _fill(folder, leave: int) -> None:
    """Write a file until only `leave` bytes are free on `folder`'s filesystem."""
    fs = os.statvfs(folder)
    size = fs.f_bavail * fs.f_frsize - leave
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * max(size, 0))


@pytest.mark.parametrize("how", ["sync", pytest.param("async", marks=pytest.mark.extended)])
def test_a_full_disk_during_a_checkpoint_write_is_exit_1_in_one_line(corpus, tmp_path, how):
    with small_tmpfs(tmp_path / "disk") as disk:
        out = disk / "run"
        extra = ["--async-save"] if how == "async" else []
        run_cli(*TINY, *extra, "--stop-at", "2", "--data", corpus, "--out", str(out))
        saved = latest_checkpoint(out / "checkpoints")
        assert saved.name == "step_00000002"
        _fill(disk, MARGIN)
        result = run_cli(*TINY, *extra, "--resume", "--data", corpus, "--out", str(out),
                         check=False)
        assert result.returncode == EXIT_FAILED, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        failed = [line for line in result.stderr.splitlines() if "No space left" in line
                  and not line.startswith("meshtrain: warning:")]
        assert len(failed) == 1, result.stderr  # printed once, not once per rank
        line = failed[0]
        assert line.startswith("meshtrain: ") and "saving the checkpoint failed on rank" in line \
            or "background checkpoint saves in a row failed" in line, line
        assert line.endswith(f"continue from checkpoint {saved} with --resume"), line
        assert latest_checkpoint(out / "checkpoints") == saved
        read_manifest(saved)  # every file's digest still verifies
        ranks = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True)
        assert not ranks.stdout.strip(), ranks.stdout  # no rank left behind
