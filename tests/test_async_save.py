"""`async_save`: background checkpoint writes equal synchronous ones bitwise, `latest` moves
only once every rank's file is written, failures are one line and retried, 3 in a row end the
run with exit 1."""

import shutil
import threading
from pathlib import Path

import pytest
import torch
from harness import run_cli, run_on_ranks, worker_mesh
from safetensors.torch import load_file

from meshtrain.checkpointing.async_save import AsyncSaver
from meshtrain.checkpointing.checkpoint import (
    latest_checkpoint,
    point_latest_at,
    read_manifest,
    write_rank_file,
)
from meshtrain.config.run_config import build_config
from meshtrain.operations.failures import EXIT_FAILED, RunFailure
from meshtrain.training.trainer import Trainer


def _trainer(corpus, out, async_save):
    cfg = build_config({}, {"train": {"steps": 8, "global_batch": 4, "micro_batch": 2,
                                      "seq_len": 16, "seed": 1},
                            "parallel": {"device": "cpu"}, "data": {"data": corpus},
                            "checkpoint": {"out": out, "async_save": async_save}})
    trainer = Trainer.build(cfg, worker_mesh(tp=2))
    trainer.saver = AsyncSaver(trainer.mesh) if async_save else None
    return trainer


def _save_both_ways(corpus, out):
    """Sync save at step 2 in out/sync; the same run saves step 2 in the background in
    out/async and trains 2 more steps (changing every tensor) before the write is settled."""
    sync = _trainer(corpus, str(Path(out) / "sync"), False)
    background = _trainer(corpus, str(Path(out) / "async"), True)
    for trainer in (sync, background):
        for step in range(2):
            trainer.train_step(step)
    sync.save(Path(out) / "sync", 2)
    trained = threading.Event()  # the writer starts only after training changed the tensors

    def late_write(pending):
        trained.wait()
        return write_rank_file(pending)

    background.saver.write = late_write
    background.save(Path(out) / "async", 2, background=True)
    for step in range(2, 4):
        background.train_step(step)
    trained.set()
    root = Path(out) / "async" / "checkpoints"
    unpublished = latest_checkpoint(root)
    published = background.settle_save()
    # A foreground save (the end, a stop) first publishes the write in flight.
    background.save(Path(out) / "async", 4, background=True)
    background.save(Path(out) / "async", 5)
    return unpublished, published, sorted(p.name for p in root.glob("step_*")), \
        latest_checkpoint(root).name


def test_background_save_equals_synchronous_bitwise(corpus, tmp_path):
    unpublished, published, steps, latest = run_on_ranks(2, _save_both_ways, corpus,
                                                         str(tmp_path))[0]
    assert unpublished is None and published.name == "step_00000002"
    assert steps == ["step_00000002", "step_00000004", "step_00000005"]
    assert latest == "step_00000005"
    sync = latest_checkpoint(tmp_path / "sync" / "checkpoints")
    read_manifest(published)  # every digest verifies
    for rank in range(2):
        name = f"rank_{rank:05d}.safetensors"
        a, b = load_file(sync / name), load_file(published / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("manifest.json", "train_state.json"):
        assert (sync / name).read_text() == (published / name).read_text()


def _failing_saves(corpus, out):
    """Rank 1's writer fails (full disk) for every save after the first good one."""
    trainer = _trainer(corpus, out, True)
    trainer.train_step(0)
    trainer.save(Path(out), 1, background=True)
    assert trainer.settle_save().name == "step_00000001"

    def full_disk(pending):
        if trainer.mesh.rank == 1:
            raise OSError(28, "No space left on device")
        return write_rank_file(pending)

    trainer.saver.write = full_disk
    outcomes = []
    for step in (2, 3, 4):
        trainer.save(Path(out), step, background=True)
        try:
            outcomes.append(trainer.settle_save())
        except RunFailure as e:
            outcomes.append((e.exit_code, str(e)))
        outcomes.append(latest_checkpoint(Path(out) / "checkpoints").name)
    return outcomes


def test_failed_background_saves_are_retried_then_end_the_run(corpus, tmp_path):
    outcomes = run_on_ranks(2, _failing_saves, corpus, str(tmp_path))[0]
    assert outcomes[:4] == [None, "step_00000001", None, "step_00000001"]
    code, line = outcomes[4]
    assert code == EXIT_FAILED and "3 background checkpoint saves in a row failed" in line
    assert ".tmp_step_00000004/rank_00001.safetensors" in line and "No space left" in line
    assert outcomes[5] == "step_00000001"
    read_manifest(tmp_path / "checkpoints" / "step_00000001")  # the previous one is intact


TINY = ["train", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32", "--num-heads",
        "2", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--eval-every", "0",
        "--steps", "6", "--save-every", "2", "--nproc", "2", "--tp", "2"]


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("rank_*.safetensors"))
    if names != sorted(p.name for p in b.glob("rank_*.safetensors")):
        return False
    for name in names:
        x, y = load_file(a / name), load_file(b / name)
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


@pytest.mark.extended  # 24 s; the library tests above cover the same save path by default
def test_cli_async_run_and_its_resume_equal_the_synchronous_run(corpus, tmp_path):
    """Every checkpoint of a 2-rank `--async-save` run equals the synchronous run's bitwise,
    and resuming from a background-written one (step 4) ends at the same step-6 weights."""
    sync, background = tmp_path / "sync", tmp_path / "async"
    run_cli(*TINY, "--data", corpus, "--out", str(sync))
    run_cli(*TINY, "--data", corpus, "--out", str(background), "--async-save")
    for step in (2, 4, 6):
        name = f"checkpoints/step_{step:08d}"
        assert _same_files(sync / name, background / name), name
    root = background / "checkpoints"
    shutil.rmtree(root / "step_00000006")
    point_latest_at(root / "step_00000004")
    run_cli(*TINY, "--data", corpus, "--out", str(background), "--async-save", "--resume")
    assert latest_checkpoint(root).name == "step_00000006"
    assert _same_files(sync / "checkpoints/step_00000006", root / "step_00000006")
