"""Data parallelism, the training loop, resume and reshard, against single-process references."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from harness import LLAMA, dense_reference, run_cli, run_on_ranks, worker_mesh
from torch.testing import assert_close

from meshtrain import ParallelMesh
from meshtrain.cli.main import _train_config, main
from meshtrain.cli.parsers import build_parser
from meshtrain.config.run_config import build_config, validate
from meshtrain.data.corpus import BatchSampler
from meshtrain.parallel import CommRecorder, named_full_tensors
from meshtrain.parallel.runtime.optim import OptimizerSettings, clip_grad_norm_
from meshtrain.parallelize import build_model
from meshtrain.training.metrics import MetricsLog, read_metrics
from meshtrain.training.trainer import Trainer, run_training

TOL = dict(rtol=1e-5, atol=1e-6)
FP64_TOL = dict(rtol=1e-10, atol=1e-13)


def _config(corpus: str, out: str, model=None, **train):
    settings = dict(steps=20, global_batch=8, micro_batch=2, seq_len=32, lr=3e-3, min_lr=3e-4,
                    warmup_steps=4, eval_every=10, eval_batches=1, seed=3) | train
    dropout = settings.pop("dropout", 0.0)
    return build_config({}, {"model": {"dropout": dropout} | (model or {}), "train": settings,
                             "parallel": {"device": "cpu"},
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _dense_step_grads(cfg, trainer_data: BatchSampler, step: int, dtype=torch.float32):
    """Loss and full gradients of one step on one process over the whole global batch."""
    model = dense_reference(cfg).to(dtype)
    batches = trainer_data.micro_batches(step, dp_rank=0, dp_size=1)
    total = 0.0
    for inputs, targets in batches:
        loss = model.loss(model(inputs), targets) / len(batches)
        loss.backward()
        total += loss.item()
    return total, dict(named_full_tensors(model, grads=True)), clip_grad_norm_(
        model, ParallelMesh.local())


def _check_dp_parity(corpus, out, tp, dp, model=None, scheme="1d", precision="fp32"):
    grid = {"tp_scheme": scheme} if scheme != "1d" else {}
    mesh = worker_mesh(tp=tp, dp=dp, **grid)
    cfg = _config(corpus, out, model, clip_grad=0.0, precision=precision)
    cfg.plan = dataclasses.replace(cfg.plan, tp_scheme=scheme)
    trainer = Trainer.build(cfg, mesh)
    dtype = trainer.plan.dtype
    tol, rel = (FP64_TOL, 1e-10) if dtype == torch.float64 else (TOL, 1e-5)
    ref_loss, ref_grads, ref_norm = _dense_step_grads(cfg, trainer.train_data, 0, dtype)
    params = sum(p.numel() for p in trainer.model.parameters())
    with CommRecorder() as rec:
        row = trainer.train_step(0)
    assert row["loss"] == pytest.approx(ref_loss, rel=rel)
    assert row["grad_norm"] == pytest.approx(ref_norm.item(), rel=rel)
    # train_step has stepped the optimizer; the gradients it used are still in .grad
    grads = dict(named_full_tensors(trainer.model, grads=True))
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], **tol, msg=name)
    dp_records = rec.select("all_reduce", "dp_cp")
    if dp > 1:
        # Gradient accumulation over 4/dp micro-batches still sends every gradient once:
        # the buckets hold all local parameters, plus one scalar for the logged loss.
        size = dtype.itemsize
        assert sum(r.payload_bytes for r in dp_records) == params * size + size
        assert sorted(r.payload_bytes for r in dp_records)[0] == size
    else:
        assert not dp_records


@pytest.mark.parametrize("tp,dp,model", [(1, 2, None), (2, 2, None), (1, 4, None),
                                         (2, 2, LLAMA), (1, 4, LLAMA),
                                         (2, 2, LLAMA | {"num_kv_heads": 1})], ids=str)
def test_data_parallel_step_matches_single_process(corpus, tmp_path, tp, dp, model):
    run_on_ranks(tp * dp, _check_dp_parity, corpus, str(tmp_path), tp, dp, model)


@pytest.mark.parametrize("model", [None, LLAMA], ids=["gpt", "llama"])
def test_data_parallel_step_at_2d_matches_single_process(corpus, tmp_path, model):
    """dp 2 of 2d q = 2 blocks in fp64: loss, gradient norm and every gradient as one process's
    to 1e-10; the data-parallel all-reduce carries each rank's quarter of the parameters once."""
    run_on_ranks(8, _check_dp_parity, corpus, str(tmp_path), 4, 2, model, "2d", "fp64")


def _trajectory(corpus, out, tp, dp, extra=None, model=None):
    mesh = worker_mesh(tp=tp, dp=dp)
    cfg = _config(corpus, out, model, **{"steps": 12} | (extra or {}))
    trainer = Trainer.build(cfg, mesh)
    return [trainer.train_step(step)["loss"] for step in range(cfg.train.steps)]


@pytest.mark.parametrize("model,layouts", [
    (None, [(2, 1), (2, 2)]),  # tp 4 and dp 2 alone: test_model, the dp parity tests
    pytest.param(None, [(4, 2)], marks=pytest.mark.extended),  # tp 4 x dp 2 (8 ranks)
    (LLAMA, [(2, 2)])], ids=["gpt", "gpt-8-ranks", "llama"])
def test_loss_trajectories_equal_across_layouts(corpus, tmp_path, model, layouts):
    reference = run_on_ranks(1, _trajectory, corpus, str(tmp_path), 1, 1, None, model)[0]
    assert reference[-1] < reference[0] - 0.5  # it learns
    for tp, dp in layouts:
        losses = run_on_ranks(tp * dp, _trajectory, corpus, str(tmp_path), tp, dp, None,
                              model)[0]
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
        assert rel < 1e-4, (tp, dp, rel)


def _run(corpus, out, tp, dp, resume=False, **train):
    cfg = _config(corpus, out, **{"steps": 8, "eval_every": 4} | train)
    cfg.checkpoint.resume = resume
    cfg.checkpoint.save_every = 0
    cfg.plan = dataclasses.replace(cfg.plan, tp=tp, dp=dp)
    run_training(cfg)
    return None


def _losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.parametrize("dropout", [pytest.param(0.0, marks=pytest.mark.extended), 0.2])
def test_resume_is_bitwise_identical(corpus, tmp_path, dropout):
    """(Without dropout the resume runs the same path less the RNG streams: extended.)"""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_on_ranks(2, _run, corpus, str(whole), 2, 1, dropout=dropout)
    run_on_ranks(2, _run, corpus, str(parts), 2, 1, dropout=dropout, stop_at=4)
    assert max(_losses(parts)) == 4
    run_on_ranks(2, _run, corpus, str(parts), 2, 1, resume=True, dropout=dropout)
    assert _losses(parts) == _losses(whole)  # bitwise: exact float equality, all 8 steps


def test_resume_at_another_layout(corpus, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_on_ranks(2, _run, corpus, str(whole), 2, 1)
    run_on_ranks(2, _run, corpus, str(parts), 2, 1, stop_at=4)
    run_on_ranks(4, _run, corpus, str(parts), 1, 4, resume=True)  # tp2 -> dp4
    a, b = _losses(parts), _losses(whole)
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) / b[step] < 1e-5, step


def _lr_at(schedule: str = "cosine"):
    settings = OptimizerSettings(lr=1.0, min_lr=0.1, warmup_steps=10, lr_schedule=schedule)
    return lambda step: settings.lr_at(step, total_steps=110)


def test_lr_schedule_warmup_then_cosine():
    lr_at = _lr_at()
    assert lr_at(0) == pytest.approx(0.1)
    assert lr_at(9) == pytest.approx(1.0)
    assert lr_at(60) == pytest.approx(0.55)
    assert lr_at(110) == pytest.approx(0.1)
    assert lr_at(500) == pytest.approx(0.1)


@pytest.mark.parametrize("schedule,at_60,at_100", [
    ("linear", 0.55, 0.19), ("constant", 1.0, 1.0), ("wsd", 1.0, 0.28)])
def test_other_lr_schedules_after_the_same_warmup(schedule, at_60, at_100):
    """wsd with decay fraction 0.2: constant to step 90, then linear to min_lr at 110."""
    lr_at = _lr_at(schedule)
    assert lr_at(0) == pytest.approx(0.1) and lr_at(9) == pytest.approx(1.0)
    assert lr_at(60) == pytest.approx(at_60)
    assert lr_at(90) == pytest.approx(1.0 if schedule != "linear" else 0.28)
    assert lr_at(100) == pytest.approx(at_100 if schedule != "wsd" else 0.55)
    assert lr_at(110) == pytest.approx(0.1 if schedule != "constant" else 1.0)


def _optimizer_hyperparameters(corpus, zero):
    cfg = _config(corpus, "/nonexistent", steps=2, adam_beta1=0.8, adam_beta2=0.99,
                  adam_eps=1e-6)
    cfg.plan = dataclasses.replace(cfg.plan, zero=zero)
    group = Trainer.build(cfg, worker_mesh(dp=2)).sync.optimizer.param_groups[0]
    return group["betas"], group["eps"]


@pytest.mark.parametrize("zero", [0, 1])
def test_adam_betas_and_epsilon_are_settings(corpus, zero):
    for betas, eps in run_on_ranks(2, _optimizer_hyperparameters, corpus, zero):
        assert betas == (0.8, 0.99) and eps == 1e-6
    cfg = _config(corpus, "/nonexistent", adam_beta2=1.0)
    with pytest.raises(ValueError, match="`adam_beta2` must be in \\[0, 1\\), got 1.0"):
        validate(cfg, 1)


def test_the_lr_schedule_is_a_setting_the_run_logs(corpus, tmp_path, capsys):
    flags = ["train", "--lr-schedule", "wsd", "--lr-decay-fraction", "0.5", "--data", corpus,
             "--out", str(tmp_path / "run")]
    cfg = _train_config(build_parser().parse_args(flags))
    assert (cfg.optimizer.lr_schedule, cfg.optimizer.lr_decay_fraction) == ("wsd", 0.5)
    assert main(["train", "--lr-schedule", "step", "--data", corpus, "--out",
                 str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "--lr-schedule must be cosine, linear, constant or wsd, got 'step'" in err
    cfg = _config(corpus, str(tmp_path / "wsd"), steps=6, warmup_steps=2, lr_schedule="wsd",
                  lr_decay_fraction=0.5, eval_every=0)
    run_on_ranks(1, run_training, cfg)
    lrs = [row["lr"] for row in read_metrics(tmp_path / "wsd" / "metrics.jsonl") if "lr" in row]
    assert lrs == pytest.approx([1.5e-3, 3e-3, 3e-3, 3e-3, 3e-3, 1.65e-3])  # decay: steps 4, 5


def _check_clip_counts_once():
    """Replicated parameters count once, TP shards are summed: the norm equals the dense one."""
    mesh = worker_mesh(tp=2)
    from meshtrain import preset

    cfg = preset("tiny", vocab_size=37)
    dense = build_model(cfg, ParallelMesh.local(), seed=1)
    model = build_model(cfg, mesh, seed=1)
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(0))
    for m in (dense, model):
        m.loss(m(ids[:, :-1]), ids[:, 1:]).backward()
    expected = torch.cat([g.flatten() for _, g in named_full_tensors(dense, grads=True)]).norm()
    assert_close(clip_grad_norm_(model, mesh), expected, **TOL)


def test_clip_grad_norm_counts_each_parameter_once():
    run_on_ranks(2, _check_clip_counts_once)


def test_gradient_buckets_close_before_overflowing_and_guard_their_views():
    from meshtrain import preset
    from meshtrain.parallel.runtime.data_parallel import GradientReducer

    model = build_model(preset("tiny"), ParallelMesh.local(), seed=0)
    layer_bytes = sum(p.numel() for p in model.layers["0"].parameters()) * 4
    reducer = GradientReducer(list(model.parameters()), ParallelMesh.local().dp_cp,
                              bucket_bytes=int(2.5 * layer_bytes))
    sizes = [b.buffer.numel() * 4 for b in reducer.buckets]
    assert max(sizes[:-1]) <= 2.5 * layer_bytes
    assert reducer.buckets[-1].params[-1] is model.embedding.word.weight  # reduced last
    assert sum(sizes) == sum(p.numel() for p in model.parameters()) * 4
    reducer.wait()  # views intact: fine
    model.layers["0"].ln1.weight.grad = None
    with pytest.raises(RuntimeError, match="zero gradients with the reducer's zero_grad"):
        reducer.wait()


def test_metrics_rows_wait_for_flush(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # a step writes no file
    log.flush()
    assert [row["step"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    log.write({"step": 4, "loss": 0.25})
    log.close()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4


def test_progress_lines_checkpoints_profile_and_wandb_of_a_run_without_a_terminal(
        corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves the machine
    out = tmp_path / "run"
    result = run_cli("train", "--data", corpus, "--model", "tiny", "--num-layers", "1",
                     "--steps", "5", "--log-every", "2", "--eval-every", "0", "--seq-len", "16",
                     "--device", "cpu", "--out", str(out), "--save-every", "2",
                     "--profile-steps", "2:3", "--wandb-project", "p", "--run-name", "first")
    lines = [line for line in result.stderr.splitlines() if line.startswith("train: step")]
    assert [line.split(",")[0] for line in lines] == \
        ["train: step 2/5", "train: step 4/5", "train: step 5/5"], result.stderr
    assert all(re.search(r"tokens/s, [\d.e+-]+ TFLOP/s per rank, [\d.]+% MFU,"
                         r" ETA \d:\d\d:\d\d$", line) for line in lines), lines
    assert "\r" not in result.stderr  # no bar redraws in a log
    rows = read_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5]
    last = rows[-1]  # the progress line shows the row's TFLOP/s and MFU (cpu-gloo's peak)
    assert lines[-1].endswith(f" {last['tflops']:.3g} TFLOP/s per rank, {last['mfu']:.1%} MFU,"
                              f" ETA 0:00:00")
    saved = [line for line in result.stderr.splitlines() if "saved checkpoint" in line]
    assert saved == [f"meshtrain: saved checkpoint {out}/checkpoints/step_0000000{n}"
                     for n in (2, 4)]  # the last one the closing line names
    trace = json.loads((out / "profile" / "rank0.json").read_text())
    assert trace["traceEvents"] and "profiled steps 2-3" in result.stderr
    run_id = (out / "wandb" / "run_id").read_text()
    [record] = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    assert b"first" in record.read_bytes()  # the run, under its name (rows: test_run_logging)
