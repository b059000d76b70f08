"""Mixed precision: bf16 and fp16 (loss scaling) track fp32; overflow skips on every rank."""

import dataclasses
import functools
import json
import math
from pathlib import Path

import pytest
import torch
from harness import LLAMA, raises_as_flags, run_on_ranks, worker_mesh

from meshtrain.cli.auto_layout import choose_layout
from meshtrain.config.run_config import build_config, validate
from meshtrain.memory import zero_formula_bytes
from meshtrain.training.trainer import Trainer, run_training


@pytest.fixture(scope="module")
def corpus(corpus_file) -> str:
    """The corpus the 16-bit tolerances were set on (fp16 over 50 steps drifts further from fp32
    on the shared one: 3.3e-2 for Llama against its 5e-3)."""
    return corpus_file(40_000, seed=7)


def _cfg(corpus, out="/nonexistent", model=None, **train):
    settings = {"steps": 50, "global_batch": 8, "micro_batch": 4, "seq_len": 32, "seed": 8,
                "lr": 2e-3, "warmup_steps": 5} | train
    return build_config({}, {"model": model or {}, "train": settings,
                             "parallel": {"device": "cpu"},
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _trajectory(corpus, tp, model=None, **train):
    world = torch.distributed.get_world_size()
    trainer = Trainer.build(_cfg(corpus, model=model, micro_batch=8, **train),
                            worker_mesh(tp=tp, dp=world // tp))
    return [trainer.train_step(step) for step in range(trainer.cfg.train.steps)]


def _max_rel(rows, reference):
    return max(abs(r["loss"] - f["loss"]) / f["loss"] for r, f in zip(rows, reference,
                                                                       strict=True))


FAMILIES = {"gpt": None, "llama": LLAMA}
# Llama's 50-step precision runs are extended (the same precision path as GPT's, which stay)
TRACKED = ["gpt", pytest.param("llama", marks=pytest.mark.extended)]


@functools.cache
def _fp32(corpus, family: str) -> list:
    """The fp32 run at tp 2 that every 16-bit run of `family` is compared with (run once)."""
    fp32 = run_on_ranks(2, _trajectory, corpus, 2, FAMILIES[family])[0]
    assert fp32[-1]["loss"] < fp32[0]["loss"] - 1.0  # it learns
    return fp32


@pytest.mark.parametrize("family", TRACKED)
def test_bf16_tracks_fp32_over_50_steps(corpus, family):
    bf16 = run_on_ranks(2, _trajectory, corpus, 2, FAMILIES[family], precision="bf16")[0]
    assert _max_rel(bf16, _fp32(corpus, family)) < 2e-2
    if family == "gpt":  # the gradient dtype is the family's business no more than precision is
        bf16_grads = run_on_ranks(2, _trajectory, corpus, 2, precision="bf16",
                                  grad_dtype="bf16")[0]
        assert _max_rel(bf16_grads, _fp32(corpus, family)) < 2e-2


@pytest.mark.parametrize("family", TRACKED)
def test_fp16_with_loss_scaling_tracks_fp32_over_50_steps(corpus, family):
    fp16 = run_on_ranks(2, _trajectory, corpus, 2, FAMILIES[family], precision="fp16")[0]
    assert _max_rel(fp16, _fp32(corpus, family)) < 5e-3
    assert all(r["skipped"] == 0 for r in fp16) and fp16[0]["loss_scale"] == 2.0**16


def _forced_overflow(corpus, zero):
    mesh = worker_mesh(tp=1, dp=2)
    cfg = _cfg(corpus, steps=4, precision="fp16")
    cfg.plan = dataclasses.replace(cfg.plan, zero=zero)
    trainer = Trainer.build(cfg, mesh)
    trainer.train_step(0)
    before = {k: v.clone() for k, v in trainer.sync.export()[0].items()}  # fp32 masters
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    param = trainer.model.layers["0"].ln1.weight
    handle = param.register_hook(lambda g: g * math.inf) if mesh.rank == 1 else None
    row = trainer.train_step(1)  # only rank 1 overflows
    if handle:
        handle.remove()
    unchanged = all(torch.equal(v, before[k]) for k, v in trainer.sync.export()[0].items())
    model_unchanged = all(torch.equal(a, b) for a, b in zip(weights,
                                                            trainer.model.parameters(),
                                                            strict=True))
    after = trainer.train_step(2)
    return row["skipped"], row["loss_scale"], after["loss_scale"], unchanged, model_unchanged


@pytest.mark.parametrize("zero", [0, 2])
def test_overflow_on_one_rank_skips_the_step_everywhere(corpus, zero):
    # under ZeRO-2 the inf reaches whichever rank owns that gradient's shard: still all skip
    for skipped, scale, next_scale, unchanged, model_unchanged in run_on_ranks(
            2, _forced_overflow, corpus, zero):
        assert skipped == 1 and next_scale == scale / 2
        assert unchanged and model_unchanged


def _run(corpus, out, **train):
    cfg = _cfg(corpus, out, steps=8, **train)
    cfg.checkpoint.resume = "stop_at" not in train and Path(out, "checkpoints").exists()
    cfg.plan = dataclasses.replace(cfg.plan, tp=2)
    run_training(cfg)


def _losses(out):
    rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("loss_scale")) for r in rows if "loss" in r]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_resume_in_16_bit_is_bitwise(corpus, tmp_path, precision):
    # fp16: the scale doubles every 2 clean steps, so a resume that lost it would differ
    extra = {"precision": precision, "loss_scale_window": 2}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_on_ranks(2, _run, corpus, str(whole), **extra)
    run_on_ranks(2, _run, corpus, str(parts), stop_at=5, **extra)
    run_on_ranks(2, _run, corpus, str(parts), **extra)
    assert _losses(parts) == _losses(whole)
    if precision == "fp16":
        scales = [scale for _, _, scale in _losses(whole)]
        assert scales[5] != scales[0]  # the resumed step needs the saved scale, not a fresh one


@pytest.mark.parametrize("train,parallel,match", [
    ({"precision": "fp8"}, {}, "--precision must be fp32, bf16, fp16 or fp64"),
    ({"precision": "fp16", "grad_dtype": "bf16"}, {}, "--grad-dtype bf16 must be fp32 or the"),
    ({"loss_scale_window": 0}, {}, "--loss-scale-window must be positive"),
    ({"precision": "fp64"}, {"zero": 1}, "--zero 1 keeps fp32 master shards, which would round"),
])
def test_bad_precision_settings(corpus, train, parallel, match):
    cfg = _cfg(corpus, **train)
    cfg.plan = dataclasses.replace(cfg.plan, tp=1)
    cfg.plan = dataclasses.replace(cfg.plan, **parallel)
    with raises_as_flags(match):
        validate(cfg, 1)


def test_auto_layout_plans_no_fp64_run(corpus):
    cfg = _cfg(corpus, precision="fp64")
    with raises_as_flags("--layout auto plans fp32, bf16, fp16 runs, not --precision fp64"):
        choose_layout(cfg, 2, set())


def _memory(corpus, **train):
    trainer = Trainer.build(_cfg(corpus, steps=2, **train), worker_mesh(tp=2))
    trainer.train_step(0)
    return trainer.memory_report()


@pytest.mark.parametrize("train,p,g,k", [({}, 4, 4, 8),
                                         ({"precision": "bf16"}, 2, 4, 12),
                                         ({"precision": "bf16", "grad_dtype": "bf16"}, 2, 2, 12),
                                         ({"precision": "fp64"}, 8, 8, 16)])
def test_model_state_bytes_match_the_zero_paper_baseline(corpus, train, p, g, k):
    report = run_on_ranks(2, _memory, corpus, **train)[0]
    psi = report["num_parameters"]
    assert report["parameters"] == p * psi and report["gradients"] == g * psi
    expected = zero_formula_bytes(psi, param_bytes=p, grad_bytes=g, state_bytes=k)
    assert abs(report["total"] - expected) / expected < 0.05, (report, expected)
