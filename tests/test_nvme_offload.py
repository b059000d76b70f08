"""NVMe offload of ZeRO's optimizer states: bitwise CPU offload's run, the window of buckets in
memory, the offload folder's checks and a full disk, and checkpoints across offload targets."""


import errno
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from harness import rank_pids, run_cli, run_on_ranks, start_cli, worker_mesh

from meshtrain.config.run_config import build_config
from meshtrain.errors import Code, SettingError
from meshtrain.parallel.runtime.nvme_offload import check_offload_dir
from meshtrain.training.trainer import Trainer, run_training


def _cfg(corpus, out, parallel, **train):
    settings = {"steps": 3, "global_batch": 8, "micro_batch": 2, "seq_len": 32, "seed": 4,
                "lr": 3e-3, "warmup_steps": 1, "eval_batches": 1} | train
    return build_config({}, {"train": settings, "parallel": {"device": "cpu"} | parallel,
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _offload(target, folder):
    return {"offload_optimizer": target} | ({"offload_dir": folder} if target == "nvme" else {})


def _weights_after_steps(corpus, out, degrees, stage, target, folder, bucket_mb=0.05):
    parallel = {"zero": stage, "bucket_mb": bucket_mb, **degrees} | _offload(target, folder)
    trainer = Trainer.build(_cfg(corpus, out, parallel), worker_mesh(**degrees))
    rows = [trainer.train_step(step) for step in range(3)]
    store = getattr(trainer.sync.reducers[0].states, "files", None)  # nvme only
    files = sorted(p.name for p in store.directory.iterdir()) if store else []
    window = len(store.slabs) if store else 0
    values, states, _ = trainer.sync.export()
    report = trainer.sync.memory_report()
    trainer.sync.close()
    return ([(r["loss"], r["grad_norm"]) for r in rows],
            {k: v.clone() for k, v in values.items()},
            {k: {n: t.clone() for n, t in s.items()} for k, s in states.items()},
            files, window, report)


@pytest.mark.parametrize("degrees,stage", [
    ({"dp": 2}, 1), ({"dp": 2}, 2), ({"dp": 2}, 3),
    *(pytest.param({"tp": 2, "dp": 2}, stage, marks=pytest.mark.extended)
      for stage in (1, 2, 3))])
def test_nvme_offload_is_bitwise_cpu_offload(corpus, tmp_path, degrees, stage):
    world = degrees.get("tp", 1) * degrees["dp"]
    folder = str(tmp_path / "offload")
    cpu = run_on_ranks(world, _weights_after_steps, corpus, str(tmp_path / "a"), degrees,
                       stage, "cpu", folder)
    nvme = run_on_ranks(world, _weights_after_steps, corpus, str(tmp_path / "b"), degrees,
                        stage, "nvme", folder)
    for rank_cpu, rank_nvme in zip(cpu, nvme, strict=True):
        assert rank_nvme[0] == rank_cpu[0]  # losses and gradient norms
        assert rank_nvme[1].keys() == rank_cpu[1].keys()
        assert all(torch.equal(rank_nvme[1][k], v) for k, v in rank_cpu[1].items())
        for name, moments in rank_cpu[2].items():
            assert all(torch.equal(rank_nvme[2][name][m], t) for m, t in moments.items())
    files, window, report = nvme[0][3:]
    assert len(files) > 3 and window == 3  # more buckets than the window holds in memory
    assert report["optimizer_states"] == 0 and report["offloaded"] > 0
    assert cpu[0][5]["optimizer_states"] >= report["offloaded"]
    assert not (tmp_path / "offload").exists() or not any((tmp_path / "offload").iterdir())


def _train(corpus, out, target, folder, resume=False, **train):
    cfg = _cfg(corpus, out, {"zero": 2, "bucket_mb": 0.05, "dp": 2} | _offload(target, folder),
               steps=4, **train)
    cfg.checkpoint.resume = resume
    run_training(cfg)


def _rows(out):
    rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r}


@pytest.mark.parametrize("moves", [
    (("nvme", "none"), ("none", "nvme")),
    pytest.param((("nvme", "cpu"), ("cpu", "nvme")), marks=pytest.mark.extended)],
    ids=["none", "cpu"])
def test_checkpoints_move_between_nvme_and_other_offload_bitwise(corpus, tmp_path, moves):
    folder = tmp_path / "offload"
    whole = tmp_path / "whole"
    run_on_ranks(2, _train, corpus, str(whole), "nvme", str(folder))
    assert folder.is_dir() and not any(folder.iterdir())  # the run's files are gone
    for first, then in moves:
        out = tmp_path / f"{first}-{then}"
        run_on_ranks(2, _train, corpus, str(out), first, str(folder), stop_at=2)
        run_on_ranks(2, _train, corpus, str(out), then, str(folder), resume=True)
        assert _rows(out) == _rows(whole), (first, then)  # moments and masters came through


def _full_disk_mid_step(corpus, out, folder):
    cfg = _cfg(corpus, out, {"zero": 1, "bucket_mb": 0.05, "dp": 2} | _offload("nvme", folder))
    trainer = Trainer.build(cfg, worker_mesh(dp=2))
    trainer.train_step(0)
    saved = trainer.save(Path(out), 1)

    def full(fd, view, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for reducer in trainer.sync.reducers:
        reducer.states.files.write = full
    with pytest.raises(SettingError) as failure:
        trainer.train_step(1)
        trainer.sync.export()  # a write still in flight fails here at the latest
    trainer.sync.close()
    # the checkpoint is whole: a fresh run under CPU offload resumes from it
    cpu = Trainer.build(_cfg(corpus, out, {"zero": 1, "dp": 2, "offload_optimizer": "cpu"}),
                        worker_mesh(dp=2))
    resumed_at = cpu.resume(Path(out))
    return str(failure.value), failure.value.code, saved.name, resumed_at


def test_a_full_disk_mid_step_is_one_line_and_leaves_the_checkpoint_whole(corpus, tmp_path):
    message, code, _, resumed_at = run_on_ranks(
        2, _full_disk_mid_step, corpus, str(tmp_path / "run"), str(tmp_path / "offload"))[0]
    assert code == Code.OFFLOAD_DIR and "\n" not in message
    assert "No space left on device" in message and "`offload_dir`" in message
    assert resumed_at == 1


def test_the_offload_folder_is_checked_before_any_rank_starts(tmp_path):
    made = tmp_path / "made" / "here"
    check_offload_dir(made, 1)
    assert made.is_dir()
    with pytest.raises(SettingError, match="GiB free, the offloaded optimizer states need"):
        check_offload_dir(made, 2**60)
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingError, match="cannot be created or written"):
        check_offload_dir(tmp_path / "file" / "offload", 1)


def test_cli_refuses_an_offload_folder_it_cannot_create(corpus, tmp_path):
    (tmp_path / "file").write_text("")
    result = run_cli("train", "--nproc", "2", "--zero", "1", "--offload-optimizer", "nvme",
                     "--offload-dir", str(tmp_path / "file" / "x"), "--data", corpus,
                     "--out", str(tmp_path / "run"), "--steps", "1", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        "cannot be created or written (Not a directory): choose another --offload-dir")
    assert not (tmp_path / "run").exists()


@pytest.mark.extended  # the launcher's handling of a killed rank is tested without offload
def test_a_rank_killed_mid_run_leaves_checkpoints_that_resume_without_offload(corpus, tmp_path):
    from test_stopping import _finish, _meshtrain_lines, _wait_for_step

    out, folder = tmp_path / "run", tmp_path / "offload"
    flags = ["train", "--nproc", "2", "--zero", "2", "--bucket-mb", "0.05", "--data", corpus,
             "--out", str(out), "--seq-len", "32", "--global-batch", "8", "--micro-batch", "2"]
    proc = start_cli(*flags, "--offload-optimizer", "nvme", "--offload-dir", str(folder),
                     "--steps", "200", "--save-every", "2")
    _wait_for_step(out, 5, proc)
    os.kill(rank_pids(proc.pid)[1], signal.SIGKILL)  # the step's reads and writes in flight
    code, err = _finish(proc)
    assert code != 0 and len(_meshtrain_lines(err)) == 1, err[-3000:]
    run_cli(*flags, "--resume", "--steps", "10")  # the latest checkpoint verifies and loads
    assert max(_rows(out)) == 10
