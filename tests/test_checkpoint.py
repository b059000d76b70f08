"""Checkpoints: atomic, verified, layout-independent, pickle-free; consolidated export."""

from pathlib import Path

import pytest
import torch
from harness import run_on_ranks, worker_mesh
from safetensors.torch import load_file
from torch.testing import assert_close

from meshtrain.checkpointing import checkpoint as ckpt
from meshtrain.checkpointing.checkpoint import CheckpointError, latest_checkpoint, read_manifest
from meshtrain.checkpointing.model_files import export_safetensors
from meshtrain.config.run_config import build_config
from meshtrain.operations.failures import EXIT_FAILED, RunFailure
from meshtrain.parallel import named_full_tensors
from meshtrain.training.trainer import Trainer


def _cfg(corpus, out):
    return build_config({}, {"train": {"steps": 8, "global_batch": 4, "micro_batch": 2,
                                       "seq_len": 16, "seed": 1},
                             "model": {"vocab_size": 259},  # not divisible by tp
                             "parallel": {"device": "cpu"},
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _train_and_save(corpus, out, tp, dp, steps):
    trainer = Trainer.build(_cfg(corpus, out), worker_mesh(tp=tp, dp=dp))
    for step in range(steps):
        trainer.train_step(step)
    trainer.save(Path(out), steps)
    return {name: t.clone() for name, t in named_full_tensors(trainer.model)}


def _crash_during_save(corpus, out):
    """Train 2 steps and save; then crash while writing step 4's manifest."""
    trainer = Trainer.build(_cfg(corpus, out), worker_mesh(tp=2))
    for step in range(2):
        trainer.train_step(step)
    trainer.save(Path(out), 2)
    for step in range(2, 4):
        trainer.train_step(step)
    real = ckpt._fsync_write

    def crash(path, text):
        if path.name == "manifest.json":
            raise OSError("simulated crash")
        real(path, text)

    ckpt._fsync_write = crash
    try:
        # Rank 0 fails before renaming the directory into place: every rank gets the same
        # agreed failure, a failed write's exit 1 (no rank is left waiting), and the previous
        # checkpoint stays.
        with pytest.raises(RunFailure, match="saving the checkpoint failed on rank 0") as failed:
            trainer.save(Path(out), 4)
        assert failed.value.exit_code == EXIT_FAILED and failed.value.agreed
    finally:
        ckpt._fsync_write = real


def test_crash_mid_save_keeps_previous_checkpoint(corpus, tmp_path):
    run_on_ranks(2, _crash_during_save, corpus, str(tmp_path))
    root = tmp_path / "checkpoints"
    assert latest_checkpoint(root).name == "step_00000002"
    assert not (root / "step_00000004").exists()
    read_manifest(latest_checkpoint(root))  # still verifies


def _load_into_layout(corpus, out, tp, dp):
    trainer = Trainer.build(_cfg(corpus, out + "-load"), worker_mesh(tp=tp, dp=dp))
    step = trainer.resume(Path(out))
    return step, {name: t.clone() for name, t in named_full_tensors(trainer.model)}


@pytest.mark.parametrize("save_layout,load_layout", [((2, 1), (1, 1)), ((1, 2), (4, 1)),
                                                     ((4, 1), (2, 2))])
def test_load_at_another_layout(corpus, tmp_path, save_layout, load_layout):
    saved = run_on_ranks(save_layout[0] * save_layout[1], _train_and_save, corpus, str(tmp_path),
                         *save_layout, 3)[0]
    step, loaded = run_on_ranks(load_layout[0] * load_layout[1], _load_into_layout, corpus,
                                str(tmp_path), *load_layout)[0]
    assert step == 3
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert_close(loaded[name], saved[name], rtol=0, atol=0, msg=name)


def test_files_are_pickle_free_and_cover_each_piece_once(corpus, tmp_path):
    run_on_ranks(4, _train_and_save, corpus, str(tmp_path), 2, 2, 1)
    path = latest_checkpoint(tmp_path / "checkpoints")
    assert {p.suffix for p in path.iterdir()} == {".safetensors", ".json", ".toml"}
    manifest = read_manifest(path)
    assert manifest["layout"]["tp"] == 2 and manifest["layout"]["dp"] == 2
    qkv = manifest["tensors"]["model/layers.0.attn.qkv.weight"]
    assert qkv["shape"] == [192, 64]
    # q, k, v blocks on two TP ranks, written by DP rank 0 only: 6 pieces of 32 rows
    assert sorted((p["offset"], p["length"]) for p in qkv["pieces"]) == [
        (i * 32, 32) for i in range(6)]
    assert manifest["tensors"]["model/embedding.word.weight"]["shape"] == [259, 64]


def _saved_once(corpus, out):
    return _train_and_save(corpus, out, 2, 1, 1)


@pytest.fixture()
def saved_run(corpus, tmp_path):
    params = run_on_ranks(2, _saved_once, corpus, str(tmp_path))[0]
    return tmp_path, latest_checkpoint(tmp_path / "checkpoints"), params


def test_corrupt_and_truncated_files_are_rejected(saved_run):
    _, path, _ = saved_run
    data_file = path / "rank_00001.safetensors"
    original = data_file.read_bytes()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0xFF
    data_file.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="rank_00001.safetensors: corrupt or truncated"):
        read_manifest(path)
    data_file.write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_manifest(path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json: corrupt or truncated"):
        read_manifest(path)


def test_other_model_shape_is_rejected(saved_run):
    _, path, _ = saved_run
    from meshtrain import preset

    with pytest.raises(CheckpointError, match="different model shape: hidden_size 64 there vs"
                                              " 128 here"):
        read_manifest(path, preset("tiny", vocab_size=259, hidden_size=128))


def test_export_writes_the_full_unpadded_model(saved_run, tmp_path):
    _, path, params = saved_run
    out = tmp_path / "model.safetensors"
    assert export_safetensors(path, out) == len(params)
    exported = load_file(str(out))
    assert exported.keys() == params.keys()
    assert exported["embedding.word.weight"].shape == (259, 64)
    for name, tensor in params.items():
        assert torch.equal(exported[name], tensor), name
