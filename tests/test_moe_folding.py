"""Expert tensor parallelism 1 (`etp` 1, Megatron's MoE parallel folding): experts whole on
every rank, ep carved out of dp x cp x tp. One training step against one process (loss,
gradient norm, every gradient, the experts gathered from their owners), the ep and edp groups,
and the dispatch all-to-all's bytes against the formula taken from the reference's own
per-token choices (with capacity: dropped choices are not sent); their DTensor state dict
through torch.distributed.checkpoint into one process. The refusals are in
test_cli.py and test_mesh.py; trajectories, choices and resharding in test_moe_layouts.py."""

import dataclasses

import pytest
import torch
from harness import dense_reference, run_on_ranks, worker_mesh
from torch.testing import assert_close

import meshtrain.parallel.layers.expert as expert_layer
from meshtrain import ParallelMesh
from meshtrain.config.run_config import build_config
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.parallel import CommRecorder, named_full_tensors
from meshtrain.parallel.communication.comm import all_gather_objects
from meshtrain.parallel.runtime.optim import clip_grad_norm_
from meshtrain.training.trainer import Trainer

TOL = {"rtol": 1e-5, "atol": 1e-6}
EXPERTS, GLOBAL_BATCH, MICRO_BATCH, SEQ_LEN = 4, 4, 2, 16
MODEL = {"moe_experts": EXPERTS, "moe_top_k": 2, "moe_every": 2, "moe_capacity_factor": 1.0,
         "moe_z_loss_coef": 0.001}


def _cfg(corpus, degrees: dict):
    cfg = build_config({}, {
        "model": MODEL, "parallel": {"device": "cpu", **degrees},
        "train": {"steps": 1, "global_batch": GLOBAL_BATCH, "micro_batch": MICRO_BATCH,
                  "seq_len": SEQ_LEN, "seed": 2, "clip_grad": 0.0},
        "data": {"data": corpus}, "checkpoint": {"out": "/nonexistent"}})
    cfg.plan = dataclasses.replace(cfg.plan, **degrees)
    return cfg


def _reference(cfg):
    """One process over the step's micro-batches: the loss, each micro-batch's per MoE layer
    (experts [T, k], kept [T, k]), every gradient and the gradient norm."""
    model = dense_reference(cfg)
    batches = Trainer.build(cfg, ParallelMesh.local()).train_data.micro_batches(
        0, dp_rank=0, dp_size=1)
    choices, original = [], expert_layer.route

    def capture(logits, rule, **kwargs):
        routing = original(logits, rule, **kwargs)
        choices[-1].append((routing.experts, routing.kept))
        return routing

    expert_layer.route, total = capture, 0.0
    try:
        for inputs, targets in batches:
            choices.append([])
            aux = AuxiliaryOutputs()
            cross_entropy = model.cross_entropy(model(inputs, aux=aux), targets)
            ((cross_entropy + aux.loss) / len(batches)).backward()
            total += cross_entropy.item() / len(batches)
    finally:
        expert_layer.route = original
    norm = clip_grad_norm_(model, ParallelMesh.local()).item()
    return total, choices, dict(named_full_tensors(model, grads=True)), norm


def _dispatched_rows(choices, mesh, rank: int, experts: range | None = None) -> int:
    """Kept choices (to `experts`, or any) of the tokens rank `rank` dispatches: its data
    rank's micro-batches, its tp rank's s/tp positions of each sequence (pp = cp = 1)."""
    tp = mesh.tp.size
    tp_rank, dp_rank = rank % tp, rank // tp
    m = len(choices) // mesh.dp.size
    part = torch.arange(SEQ_LEN * MICRO_BATCH) % SEQ_LEN // (SEQ_LEN // tp) == tp_rank
    rows = 0
    for layers in choices[dp_rank * m:(dp_rank + 1) * m]:
        for chosen, kept in layers:
            keep = kept[part]
            if experts is not None:
                keep = keep & (chosen[part] >= experts.start) & (chosen[part] < experts.stop)
            rows += int(keep.sum())
    return rows


def _check_step(corpus, degrees: dict) -> None:
    mesh = worker_mesh(**degrees)
    cfg = _cfg(corpus, degrees)
    trainer = Trainer.build(cfg, mesh)
    ref_loss, choices, ref_grads, ref_norm = _reference(cfg)
    with CommRecorder() as rec:
        row = trainer.train_step(0)
    assert row["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)  # each expert counted once
    # ep: consecutive ranks of dp x tp (tp innermost); edp: the ranks holding the same experts
    ep, world = mesh.ep.size, mesh.world_size
    assert mesh.ep.ranks == tuple(range(mesh.rank - mesh.ep.rank, mesh.rank - mesh.ep.rank + ep))
    assert mesh.axis("edp").ranks == tuple(range(mesh.rank % ep, world, ep))
    grads = {}
    for part in all_gather_objects(dict(named_full_tensors(trainer.model, grads=True)), mesh.ep):
        grads.update(part)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], **TOL, msg=name)
    # Per MoE layer and micro-batch: the counts (E int64) forward; this rank's kept rows out
    # and the rows its experts served back, forward, and the same two reversed backward.
    local = EXPERTS // ep
    mine = range(mesh.ep.rank * local, (mesh.ep.rank + 1) * local)
    sent = _dispatched_rows(choices, mesh, mesh.rank)
    served = sum(_dispatched_rows(choices, mesh, r, mine) for r in mesh.ep.ranks)
    h, calls = cfg.model_config(256).hidden_size, len(choices) // mesh.dp.size * len(choices[0])
    a2a = rec.select("all_to_all", "ep")
    assert len(a2a) == 5 * calls
    assert sum(r.payload_bytes for r in a2a) == 2 * (sent + served) * h * 4 + calls * EXPERTS * 8


@pytest.mark.parametrize("degrees", [
    {"tp": 2, "ep": 2, "etp": 1},  # the default tier's: the ep group is the tp pair
    pytest.param({"tp": 2, "dp": 2, "ep": 4, "etp": 1}, marks=pytest.mark.extended),
    pytest.param({"tp": 2, "dp": 2, "ep": 2, "etp": 1}, marks=pytest.mark.extended)], ids=str)
def test_whole_experts_match_one_process_and_send_the_formula_bytes(corpus, degrees):
    world = degrees["tp"] * degrees.get("dp", 1)
    run_on_ranks(world, _check_step, corpus, degrees)


def _save_dtensors(corpus, out: str) -> dict:
    """One step at tp 2 x ep 2 with whole experts, its DTensor state saved by dcp; every
    parameter whole, experts gathered from their owners."""
    import torch.distributed.checkpoint as dcp

    from meshtrain.checkpointing.dtensor_state import dtensor_state_dict

    degrees = {"tp": 2, "ep": 2, "etp": 1}
    mesh = worker_mesh(**degrees)
    trainer = Trainer.build(_cfg(corpus, degrees), mesh)
    trainer.train_step(0)
    dcp.save({"model": dtensor_state_dict(trainer.model, mesh)}, checkpoint_id=f"{out}/dcp")
    full = {}
    for part in all_gather_objects(dict(named_full_tensors(trainer.model)), mesh.ep):
        full.update(part)
    return full


@pytest.mark.extended
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_whole_experts_save_as_dtensors_that_load_into_one_process(corpus, tmp_path):
    """Whole experts are `Replicate()` DTensors of their rank: dcp joins both ranks' experts
    and loads every parameter into a one-process model's tensors, bitwise."""
    import torch.distributed.checkpoint as dcp

    full = run_on_ranks(2, _save_dtensors, corpus, str(tmp_path))[0]
    dense = dense_reference(_cfg(corpus, {}))
    state = {"model": {n: torch.zeros_like(p) for n, p in dense.named_parameters()}}
    dcp.load(state, checkpoint_id=f"{tmp_path}/dcp", no_dist=True)
    assert set(state["model"]) == set(full)
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, full[name]), name
