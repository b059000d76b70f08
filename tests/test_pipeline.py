"""Pipeline parallelism (flush schedules, interleaved, 2BW) against the single-process model."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from harness import LLAMA, dense_reference, run_on_ranks, worker_mesh
from torch.testing import assert_close

from meshtrain import ParallelMesh
from meshtrain.config.run_config import build_config
from meshtrain.parallel import named_full_tensors
from meshtrain.parallel.communication.comm import all_gather_objects
from meshtrain.parallel.runtime.optim import clip_grad_norm_
from meshtrain.parallel.runtime.pipeline import stage_layers
from meshtrain.parallel.schedules.flush import gpipe, one_f_one_b
from meshtrain.parallel.schedules.interleaved import interleaved
from meshtrain.parallel.schedules.pipedream import pipedream_2bw
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.training.trainer import Trainer, run_training

TOL = {"rtol": 1e-5, "atol": 1e-6}
FP64_TOL = {"rtol": 1e-10, "atol": 1e-13}


def _cfg(corpus, schedule, steps=3, model=None):
    return build_config({}, {
        "model": model or {},
        "train": {"steps": steps, "global_batch": 8, "micro_batch": 2, "seq_len": 16, "seed": 3,
                  "eval_batches": 1, "clip_grad": 0.0},
        "parallel": {"device": "cpu", "pp_schedule": schedule},
        "data": {"data": corpus}, "checkpoint": {"out": "/nonexistent"}})


def _plan_fields(parallel: dict) -> dict:
    """Plan fields as the tests give them (pp_layers as its flag's text)."""
    return {key: tuple(int(n) for n in value.split(",")) if key == "pp_layers" else value
            for key, value in parallel.items()}


def _check(corpus, tp, pp, schedule, cp=1, parallel=None, model=None):
    world = torch.distributed.get_world_size()
    grid = {k: v for k, v in (parallel or {}).items() if k == "tp_scheme"}
    mesh = worker_mesh(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp), **grid)
    cfg = _cfg(corpus, schedule, model=model)
    cfg.plan = dataclasses.replace(cfg.plan, **_plan_fields(parallel or {}))
    trainer = Trainer.build(cfg, mesh)
    reference = Trainer.build(cfg, ParallelMesh.local())
    dtype = trainer.plan.dtype
    tol, rel = (FP64_TOL, 1e-10) if dtype == torch.float64 else (TOL, 1e-5)
    dense = dense_reference(cfg).to(dtype)
    batches = trainer.train_data.micro_batches(0, dp_rank=0, dp_size=1)
    for inputs, targets in batches:
        (dense.loss(dense(inputs), targets) / len(batches)).backward()
    ref_grads = dict(named_full_tensors(dense, grads=True))
    ref_norm = clip_grad_norm_(dense, ParallelMesh.local()).item()

    row = trainer.train_step(0)
    ref_row = reference.train_step(0)
    assert row["loss"] == pytest.approx(ref_row["loss"], rel=rel)
    assert row["grad_norm"] == pytest.approx(ref_norm, rel=rel)  # tied embedding once
    grads = {}
    for part in all_gather_objects(dict(named_full_tensors(trainer.model, grads=True)), mesh.pp):
        grads.update(part)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], **tol, msg=lambda m, name=name: f"{name}: {m}")
    # a few more steps: the trajectory and the evaluation follow the single process
    for step in (1, 2):
        assert trainer.train_step(step)["loss"] == pytest.approx(
            reference.train_step(step)["loss"], rel=1e-4)
    assert trainer.evaluate() == pytest.approx(reference.evaluate(), rel=1e-4)
    # the two copies of the tied embedding stay equal (zb-v's rank 0 holds both ends: one)
    tied = trainer.parallel.roles.tied
    assert len(tied) == (mesh.pp.rank in (0, pp - 1) and schedule != "zb-v"
                         and cfg.model_config(256).tie_embeddings)
    if tied:
        copies = all_gather_objects(tied[0].detach().unsqueeze(0), mesh.axis("embed"))
        assert torch.equal(copies[0], copies[-1])


@pytest.mark.parametrize("tp,pp,world,schedule", [
    (1, 2, 2, "1f1b"), (1, 2, 2, "gpipe"), (2, 2, 4, "1f1b"), (1, 2, 4, "1f1b"),
    (1, 4, 4, "1f1b"), (1, 4, 4, "gpipe"), (2, 2, 8, "1f1b"), (1, 2, 2, "eager-1f1b"),
], ids=lambda v: str(v))
def test_pipeline_matches_single_process(corpus, tp, pp, world, schedule):
    run_on_ranks(world, _check, corpus, tp, pp, schedule)


@pytest.mark.parametrize("tp,pp,world,schedule,model", [
    (1, 2, 2, "gpipe", LLAMA), (2, 2, 4, "1f1b", LLAMA), (1, 4, 4, "1f1b", LLAMA),
    (1, 2, 2, "1f1b", LLAMA | {"tie_word_embeddings": True}),  # Llama 3.2: tied copies synced
    (2, 2, 4, "1f1b", LLAMA | {"num_kv_heads": 1}),  # one key/value head on both TP ranks
    (1, 2, 2, "interleaved", LLAMA | {"tie_word_embeddings": True}),
], ids=lambda v: str(v))
def test_llama_pipeline_matches_single_process(corpus, tp, pp, world, schedule, model):
    parallel = {"virtual_stages": 2} if schedule == "interleaved" else None
    run_on_ranks(world, _check, corpus, tp, pp, schedule, 1, parallel, model)


@pytest.mark.parametrize("model", [None, pytest.param(LLAMA, marks=pytest.mark.extended)],
                         ids=["gpt", "llama"])
def test_pipeline_with_2d_tensor_parallelism(corpus, model):
    """Interleaved 1F1B over pp 2 of 2d q = 2 blocks in fp64: gradients to 1e-10, trajectory
    and evaluation follow the single process (hidden states `[b/q, s, h/q]` between stages)."""
    parallel = {"tp_scheme": "2d", "virtual_stages": 2, "precision": "fp64"}
    run_on_ranks(8, _check, corpus, 4, 2, "interleaved", 1, parallel, model)


@pytest.mark.parametrize("tp,cp,parallel", [(2, 1, {"sequence_parallel": True}),
                                            (1, 2, {"cp_mode": "ring"}),
                                            (1, 2, {"cp_mode": "all2all"})], ids=str)
@pytest.mark.parametrize("model", [None, LLAMA], ids=["gpt", "llama"])
def test_pipeline_with_sequence_and_context_parallelism(corpus, tp, cp, parallel, model):
    run_on_ranks(2 * tp * cp, _check, corpus, tp, 2, "1f1b", cp, parallel, model)


def test_stage_layers():
    assert stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(8, 2, [3, 5]) == [range(0, 3), range(3, 8)]
    with pytest.raises(ValueError, match="sums to 3: the counts must sum to the model's 4"):
        stage_layers(4, 2, [1, 2])
    with pytest.raises(ValueError, match="has 3 entries: give one layer count per"):
        stage_layers(4, 2, [1, 1, 2])
    with pytest.raises(ValueError, match="leaves a stage without layers"):
        stage_layers(4, 2, [0, 4])


def _layers_of_stage(corpus, parallel, num_layers=None):
    cfg = _cfg(corpus, parallel.get("pp_schedule", "1f1b"))
    cfg.model.num_layers = num_layers
    cfg.plan = dataclasses.replace(cfg.plan, **_plan_fields(parallel))
    return list(Trainer.build(cfg, worker_mesh(tp=1, pp=2, dp=1)).model.layers)


@pytest.mark.parametrize("split,layers", [("1,3", [["0"], ["1", "2", "3"]]),
                                          ("3,1", [["0", "1", "2"], ["3"]])])
def test_uneven_pipeline_split_matches_single_process(corpus, split, layers):
    assert run_on_ranks(2, _layers_of_stage, corpus, {"pp_layers": split}) == layers
    run_on_ranks(2, _check, corpus, 1, 2, "1f1b", 1, {"pp_layers": split})


def test_interleaved_stages_hold_every_pth_chunk(corpus):
    # 4 layers, pp 2 x 2 virtual stages: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3
    parallel = {"pp_schedule": "interleaved", "virtual_stages": 2}
    assert run_on_ranks(2, _layers_of_stage, corpus, parallel) == [["0", "2"], ["1", "3"]]
    split = run_on_ranks(2, _layers_of_stage, corpus, parallel | {"pp_layers": "1,2,2,1"}, 6)
    assert split == [["0", "3", "4"], ["1", "2", "5"]]


@pytest.mark.parametrize("tp,world", [(1, 2), (1, 4), (2, 4)], ids=str)
def test_interleaved_matches_single_process(corpus, tp, world):
    run_on_ranks(world, _check, corpus, tp, 2, "interleaved", 1, {"virtual_stages": 2})


def _peaks(corpus, pp, num_layers):
    """Per schedule: (peak in-flight chunks, peak saved bytes) of this rank's real steps."""
    peaks = {}
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("2bw", 1)):
        cfg = _cfg(corpus, schedule)
        cfg.plan = dataclasses.replace(cfg.plan, virtual_stages=v)
        cfg.model.num_layers = num_layers
        trainer = Trainer.build(cfg, worker_mesh(tp=1, pp=pp, dp=1))
        trainer.executor.count_saved_bytes = True
        runs = []
        for step in range(cfg.train.steps if schedule == "2bw" else 1):  # 2BW: across steps
            trainer.train_step(step)
            runs.append(trainer.executor.last_run)
        peaks[schedule] = (max(r.peak_in_flight for r in runs),
                           max(r.peak_saved_bytes for r in runs))
    return peaks


@pytest.mark.parametrize("pp,num_layers", [(2, 4), (4, 8)])
def test_measured_peak_activations_match_the_simulator(corpus, pp, num_layers):
    m = 4  # global batch 8 / micro-batch 2
    measured = run_on_ranks(pp, _peaks, corpus, pp, num_layers)
    expected = {"gpipe": simulate(gpipe(pp, m)).peak_in_flight,
                "1f1b": simulate(one_f_one_b(pp, m)).peak_in_flight,
                "interleaved": simulate(interleaved(pp, m, 2), v=2).peak_in_flight,
                "2bw": simulate(pipedream_2bw(pp, m, 3)).peak_in_flight}
    for name, peaks in expected.items():
        assert [rank[name][0] for rank in measured] == peaks, name
    assert [rank["gpipe"][0] for rank in measured] == [m] * pp
    assert [rank["1f1b"][0] for rank in measured] == [min(m, pp - s) for s in range(pp)]
    # saved bytes are proportional to the live micro-batches (each one's are the same); 2BW
    # holds what 1F1B does, also while the next step's micro-batches are in flight
    for rank in measured:
        (gpipe_live, gpipe_bytes), (ofob_live, ofob_bytes) = rank["gpipe"], rank["1f1b"]
        assert gpipe_bytes > 0 and gpipe_bytes * ofob_live == ofob_bytes * gpipe_live
        assert rank["2bw"] == rank["1f1b"]


def _p2p_bytes(corpus, pp):
    from meshtrain.parallel import CommRecorder

    mesh = worker_mesh(tp=1, pp=pp, dp=1)
    trainer = Trainer.build(_cfg(corpus, "1f1b"), mesh)
    with CommRecorder() as rec:
        trainer.train_step(0)
    # activations travel on the pp groups, gradients on pp_grad
    return (rec.payload_bytes("send", "pp") + rec.payload_bytes("send", "pp_grad"),
            rec.payload_bytes("recv", "pp") + rec.payload_bytes("recv", "pp_grad"))


def test_p2p_bytes_per_step_are_analytic(corpus):
    # m = 4 micro-batches of [2, 16, 64] fp32: each inner stage boundary carries m activations
    # forward and m gradients backward
    activation = 2 * 16 * 64 * 4
    sends = run_on_ranks(2, _p2p_bytes, corpus, 2)
    assert [s for s, _ in sends] == [4 * activation, 4 * activation]
    assert [r for _, r in sends] == [4 * activation, 4 * activation]
    sends = run_on_ranks(4, _p2p_bytes, corpus, 4)
    assert sum(s for s, _ in sends) == 2 * 3 * 4 * activation  # 3 boundaries, both directions


def _save_pp(corpus, out, pp, parallel=None):
    world = torch.distributed.get_world_size()
    cfg = _cfg(corpus, "1f1b")
    cfg.plan = dataclasses.replace(cfg.plan, **_plan_fields(parallel or {}))
    trainer = Trainer.build(cfg, worker_mesh(tp=1, pp=pp, dp=world // pp))
    trainer.train_step(0)
    trainer.save(out, 1)
    merged = {}
    for part in all_gather_objects(dict(named_full_tensors(trainer.model)), trainer.mesh.pp):
        merged.update(part)
    return merged


def _load_pp(corpus, out, pp, step=1, model=None, schedule="1f1b"):
    world = torch.distributed.get_world_size()
    trainer = Trainer.build(_cfg(corpus, schedule, model=model),
                            worker_mesh(tp=1, pp=pp, dp=world // pp))
    assert trainer.resume(out) == step
    merged = {}
    params = {name: t.clone() for name, t in named_full_tensors(trainer.model)}
    for part in all_gather_objects(params, trainer.mesh.pp):
        merged.update(part)
    return merged, trainer.train_step(step)["loss"]


def test_checkpoint_moves_between_pipeline_degrees(corpus, tmp_path):
    saved = run_on_ranks(2, _save_pp, corpus, tmp_path, 2)[0]
    loaded, loss_pp1 = run_on_ranks(2, _load_pp, corpus, tmp_path, 1)[0]  # pp2 -> dp2
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    _, loss_pp4 = run_on_ranks(4, _load_pp, corpus, tmp_path, 4)[0]  # pp2 -> pp4
    assert loss_pp4 == pytest.approx(loss_pp1, rel=1e-5)


def test_checkpoint_from_interleaved_loads_without_pipeline(corpus, tmp_path):
    parallel = {"pp_schedule": "interleaved", "virtual_stages": 2}
    saved = run_on_ranks(2, _save_pp, corpus, tmp_path, 2, parallel)[0]
    loaded, _ = run_on_ranks(2, _load_pp, corpus, tmp_path, 1)[0]
    assert sorted(saved) == sorted(loaded)
    assert any(name.startswith("layers.3.") for name in saved)  # logical names, not per chunk
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def _assign(params, values):
    with torch.no_grad():
        for param, value in zip(params, values, strict=True):
            param.copy_(value)


def _delayed_reference(cfg, steps):
    """Single process applying 2BW's update: the gradient of step t is computed at W(t - 1)
    (W(-1) = W(0)) and applied to W(t)."""
    ref = Trainer.build(cfg, ParallelMesh.local())
    params = list(ref.model.parameters())
    step_optimizer = ref.sync.step
    previous = [p.detach().clone() for p in params]
    losses = []
    for t in range(steps):
        current = [p.detach().clone() for p in params]
        _assign(params, previous)

        def delayed(lr, current=current):
            _assign(params, current)
            step_optimizer(lr)

        ref.sync.step = delayed
        losses.append(ref.train_step(t)["loss"])
        previous = current
    return ref, losses


def _check_2bw(corpus, pp, out, steps=3, model=None):
    world = torch.distributed.get_world_size()
    mesh = worker_mesh(tp=1, pp=pp, dp=world // pp)
    cfg = _cfg(corpus, "2bw", steps=steps, model=model)
    trainer = Trainer.build(cfg, mesh)
    losses = [trainer.train_step(t)["loss"] for t in range(steps)]
    reference, ref_losses = _delayed_reference(cfg, steps)
    flush = Trainer.build(cfg, ParallelMesh.local())
    flush_losses = [flush.train_step(t)["loss"] for t in range(steps)]
    assert ref_losses[1] != pytest.approx(flush_losses[1], rel=1e-4)  # the delay shows
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert trainer.evaluate() == pytest.approx(reference.evaluate(), rel=1e-5)
    weights = {}
    for part in all_gather_objects(dict(named_full_tensors(trainer.model)), mesh.pp):
        weights.update(part)
    ref_weights = dict(named_full_tensors(reference.model))
    assert weights.keys() == ref_weights.keys()
    for name, tensor in weights.items():  # W(steps): the update of the last step included
        assert_close(tensor, ref_weights[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    trainer.save(out, steps)
    return ref_weights


@pytest.mark.parametrize("pp,world,model", [(2, 2, None), (4, 4, None), (2, 4, None),
                                            (2, 2, LLAMA)], ids=str)
def test_2bw_matches_delayed_update_reference(corpus, tmp_path, pp, world, model):
    ref_weights = run_on_ranks(world, _check_2bw, corpus, pp, tmp_path, 3, model)[0]
    loaded, _ = run_on_ranks(2, _load_pp, corpus, tmp_path, 1, 3, model)[0]  # W(3)
    for name, tensor in ref_weights.items():
        assert_close(loaded[name], tensor, **TOL, msg=lambda m, name=name: f"{name}: {m}")


def _run_2bw(corpus, out, stop_at=None):
    cfg = _cfg(corpus, "2bw", steps=6)
    cfg.checkpoint.out = out
    cfg.checkpoint.resume = stop_at is None and Path(out, "checkpoints").exists()
    cfg.train.stop_at = stop_at
    cfg.plan = dataclasses.replace(cfg.plan, pp=2)
    run_training(cfg)


def _2bw_losses(out):
    rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_2bw_resume_continues_the_delayed_run(corpus, tmp_path):
    """The checkpoint also holds W(t-1), which the resumed step's micro-batches need."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_on_ranks(2, _run_2bw, corpus, str(whole))
    run_on_ranks(2, _run_2bw, corpus, str(parts), 3)
    run_on_ranks(2, _run_2bw, corpus, str(parts))
    assert _2bw_losses(parts) == _2bw_losses(whole)  # bitwise, as any same-layout resume


def _check_moe(corpus, pp, ep, parallel=None, model=None):
    from test_moe import _cfg as moe_cfg
    from test_moe import _reference

    world = torch.distributed.get_world_size()
    mesh = worker_mesh(pp=pp, dp=world // pp, ep=ep)
    cfg = moe_cfg(corpus, 2, model)  # 4 experts, top-2, every 2nd layer: 1 MoE layer a stage
    # interleaved v 2: both in rank 1's 2 chunks
    cfg.plan = dataclasses.replace(cfg.plan, **_plan_fields(parallel or {}))
    trainer = Trainer.build(cfg, mesh)
    ref_loss, ref_routing, ref_grads, ref_norm = _reference(cfg)
    row = trainer.train_step(0)
    assert row["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    mean_aux = sum(a for mb in ref_routing for _, _, a in mb) / len(ref_routing)
    assert row["moe_aux_loss"] == pytest.approx(mean_aux, rel=1e-6)  # both stages' layers
    grads = {}
    for axis in (mesh.ep, mesh.pp):
        parts = all_gather_objects(dict(grads or named_full_tensors(trainer.model, grads=True)),
                                   axis)
        grads = {k: v for part in parts for k, v in part.items()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("pp,ep,world,parallel,model", [
    (2, 1, 2, None, None), (2, 2, 4, None, None),
    (2, 1, 2, {"pp_schedule": "interleaved", "virtual_stages": 2}, None),
    (2, 2, 4, None, LLAMA)], ids=str)
def test_pipeline_with_experts(corpus, pp, ep, world, parallel, model):
    run_on_ranks(world, _check_moe, corpus, pp, ep, parallel, model)
