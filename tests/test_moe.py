"""Mixture-of-Experts: routing rules, and expert parallelism against a single-process MoE."""

import pytest
import torch
from harness import LLAMA, dense_reference, raises_as_flags, run_on_ranks, worker_mesh
from torch.testing import assert_close

from meshtrain import ParallelMesh, preset
from meshtrain.config.run_config import build_config
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.parallel import CommRecorder, named_full_tensors
from meshtrain.parallel.communication.comm import all_gather_objects
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.layers.routing import capacity, route
from meshtrain.parallel.runtime.capabilities import check_capabilities
from meshtrain.parallel.runtime.optim import clip_grad_norm_
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

TOL = {"rtol": 1e-5, "atol": 1e-6}


def test_capacity_rule_first_choices_then_position_order():
    # 6 tokens, 2 experts, k=2, capacity ceil(0.5 * 6 * 2 / 2) = 3
    logits = torch.tensor([[2.0, 1.0]] * 4 + [[1.0, 2.0]] * 2)
    r = route(logits, top_k=2, capacity_factor=0.5)
    assert capacity(6, num_experts=2, top_k=2, capacity_factor=0.5) == 3
    # expert 0: first choices of tokens 0-3 -> tokens 0,1,2 kept, 3 dropped; then second
    # choices of tokens 4,5 come after all first choices -> dropped
    assert r.experts[:, 0].tolist() == [0, 0, 0, 0, 1, 1]
    assert r.kept[:, 0].tolist() == [True, True, True, False, True, True]
    # second choices come after every first choice: tokens 0-3 go to expert 1 behind tokens 4
    # and 5 (slots 2..5), tokens 4 and 5 to expert 0 behind its four first choices (slots 4, 5)
    assert r.slots[:, 1].tolist() == [2, 3, 4, 5, 4, 5]
    assert r.kept[:, 1].tolist() == [True, False, False, False, False, False]
    assert r.tokens_per_expert.tolist() == [3 + 0, 2 + 1]
    assert_close(r.weights.sum(-1), torch.ones(6))  # GShard: renormalised


def test_capacity_factor_zero_is_dropless():
    logits = torch.tensor([[2.0, 1.0]] * 6)  # every token's both choices pile on the same expert
    r = route(logits, top_k=2, capacity_factor=0.0)
    assert r.kept.all()
    assert r.tokens_per_expert.tolist() == [6, 6]


def test_switch_aux_loss_and_top1_weights():
    torch.manual_seed(0)
    logits = torch.randn(10, 4)
    r = route(logits, top_k=1, capacity_factor=10.0)
    probs = logits.softmax(-1)
    f = torch.bincount(probs.argmax(-1), minlength=4).float() / 10
    assert_close(r.aux_loss, 4 * (f * probs.mean(0)).sum())
    assert_close(r.weights[:, 0], probs.max(-1).values)  # Switch: not renormalised
    assert r.kept.all()
    assert_close(r.z_loss, torch.logsumexp(logits, -1).pow(2).mean())


def _cfg(corpus, top_k, model=None):
    return build_config({}, {
        "model": {"moe_experts": 4, "moe_top_k": top_k, "moe_every": 2,
                  "moe_capacity_factor": 1.0, "moe_z_loss_coef": 0.001} | (model or {}),
        "train": {"steps": 4, "global_batch": 8, "micro_batch": 2, "seq_len": 16, "seed": 2,
                  "clip_grad": 0.0},
        "parallel": {"device": "cpu"}, "data": {"data": corpus},
        "checkpoint": {"out": "/nonexistent"}})


def _layer_routing(layer: dict) -> tuple:
    """(tokens per expert, dropped choices, aux loss) of one MoE layer's forward."""
    return (layer["tokens_per_expert"].clone(), layer["assigned"] - int(layer["kept"]),
            layer["aux_loss"].item())


def _record_last_routing(model) -> dict[int, dict]:
    """Each MoE layer's routing of its latest forward, by layer order."""
    last = {}
    for i, moe in enumerate(m for m in model.modules() if isinstance(m, MoE)):
        moe.register_forward_hook(lambda _m, args, _out, i=i: last.__setitem__(
            i, args[1].routing[-1]))
    return last


def _reference(cfg):
    """Single process, ep=1: the same micro-batches one after another."""
    model = dense_reference(cfg)
    trainer_data = Trainer.build(cfg, ParallelMesh.local()).train_data
    batches = trainer_data.micro_batches(0, dp_rank=0, dp_size=1)
    total, routing = 0.0, []
    for inputs, targets in batches:
        aux = AuxiliaryOutputs()
        cross_entropy = model.cross_entropy(model(inputs, aux=aux), targets)
        ((cross_entropy + aux.loss) / len(batches)).backward()
        total += cross_entropy.item() / len(batches)
        routing.append([_layer_routing(layer) for layer in aux.routing])
    return total, routing, dict(named_full_tensors(model, grads=True)), clip_grad_norm_(
        model, ParallelMesh.local()).item()


def _check_ep(corpus, tp, ep, top_k, model=None):
    world = torch.distributed.get_world_size()
    mesh = worker_mesh(tp=tp, dp=world // tp, ep=ep)
    cfg = _cfg(corpus, top_k, model)
    trainer = Trainer.build(cfg, mesh)
    last = _record_last_routing(trainer.model)
    ref_loss, ref_routing, ref_grads, ref_norm = _reference(cfg)
    with CommRecorder() as rec:
        row = trainer.train_step(0)
    assert row["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)  # each expert counted once

    # Same routing as the reference for this rank's micro-batches (the last one it ran).
    m = 4 // mesh.dp.size  # micro-batches per DP rank
    mine = ref_routing[mesh.dp.rank * m + m - 1]
    for i, (tokens, dropped, aux) in enumerate(mine):
        got_tokens, got_dropped, got_aux = _layer_routing(last[i])
        assert torch.equal(got_tokens, tokens)
        assert got_dropped == dropped
        assert got_aux == pytest.approx(aux, rel=1e-6)
    assert len(last) == len(mine)
    total_tokens = sum(sum(t.sum().item() for t, _, _ in mb) for mb in ref_routing)
    assert row["moe_tokens_per_expert_mean"] * 4 * len(ref_routing[0]) == total_tokens
    dropped = sum(d for mb in ref_routing for _, d, _ in mb)
    assert row["moe_drop_rate"] == pytest.approx(dropped / (dropped + total_tokens))
    mean_aux = sum(a for mb in ref_routing for _, _, a in mb) / len(ref_routing)
    assert row["moe_aux_loss"] == pytest.approx(mean_aux, rel=1e-6)

    # Gradients: gather every expert from its EP owner, compare all with the reference.
    grads = dict(named_full_tensors(trainer.model, grads=True))
    if ep > 1:
        merged = {}
        for part in all_gather_objects(grads, mesh.ep):
            merged.update(part)
        grads = merged
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], **TOL, msg=name)

    # All-to-all bytes: per MoE layer and micro-batch, the counts (E int64), this rank's kept
    # rows out and the rows its experts served back (forward), the same two reversed (backward).
    if ep > 1:
        h = cfg.model_config(256).hidden_size
        layers = len(mine)
        sent = sum(int(t.sum()) for mb in ref_routing[mesh.dp.rank * m:(mesh.dp.rank + 1) * m]
                   for t, _, _ in mb)
        members = [mesh.dp.rank - mesh.ep.rank + j for j in range(ep)]  # dp ranks of my EP group
        local = slice(mesh.ep.rank * 4 // ep, (mesh.ep.rank + 1) * 4 // ep)
        served = sum(int(t[local].sum()) for d in members for mb in ref_routing[d * m:(d + 1) * m]
                     for t, _, _ in mb)
        a2a = rec.select("all_to_all", "ep")
        assert len(a2a) == 5 * layers * m
        assert sum(r.payload_bytes for r in a2a) == (2 * (sent + served) * h * 4
                                                     + layers * m * 4 * 8)
    else:
        assert rec.count("all_to_all") == 0


SHARED = {"moe_every": 1, "moe_first_dense": 1, "moe_ffn_size": 16, "moe_shared_ffn_size": 24,
          "moe_shared_gate": "sigmoid"}
"""Narrow experts, a gated shared expert, the first layer dense (`test_moe_shapes.py`)."""
SHARED_LLAMA = LLAMA | {"moe_every": 1, "moe_layers": [0, 2], "moe_ffn_size": 32,
                        "moe_shared_ffn_size": 64, "moe_shared_gate": "none"}


@pytest.mark.parametrize("tp,ep,top_k,world,model", [
    (1, 1, 1, 2, None), (1, 2, 1, 2, None), (1, 2, 2, 4, None), (1, 4, 2, 4, None),
    (2, 2, 2, 4, None), (1, 2, 2, 2, LLAMA), (2, 2, 1, 4, LLAMA), (1, 2, 2, 2, SHARED),
    (2, 1, 2, 2, {"moe_gemm": "grouped"}),
    pytest.param(2, 2, 2, 4, SHARED, marks=pytest.mark.extended),
    pytest.param(2, 2, 2, 4, SHARED_LLAMA, marks=pytest.mark.extended)], ids=str)
def test_expert_parallel_matches_single_process(corpus, tp, ep, top_k, world, model):
    """Llama's experts are SwiGLU MLPs; a shared expert is tensor-parallel like the dense
    MLP and replicated over ep."""
    run_on_ranks(world, _check_ep, corpus, tp, ep, top_k, model)


def test_bad_moe_settings():
    with raises_as_flags("--moe-top-k 2 exceeds --moe-experts 1"):
        preset("tiny", moe_experts=1, moe_top_k=2).validate()
    with raises_as_flags("--moe-capacity-factor must be > 0, or 0 for dropless"):
        preset("tiny", moe_experts=4, moe_capacity_factor=-1.0).validate()
    with raises_as_flags("--moe-experts 6 must be divisible by --ep 4"):
        preset("tiny", moe_experts=6).validate_for_ep(4)
    with raises_as_flags("--ep 2 needs an MoE model"):
        preset("tiny").validate_for_ep(2)
    with raises_as_flags("--moe-top-k must be >= 1, got 0"):
        preset("tiny", moe_experts=4, moe_top_k=0).validate()
    preset("tiny", moe_experts=4, moe_top_k=3).validate()  # any 1 <= k <= experts
    with raises_as_flags("--moe-bias-rate must be a finite number >= 0"):
        preset("tiny", moe_experts=4, moe_bias_rate=-0.1).validate()
    with raises_as_flags("--moe-bias-rate must be a finite number, got nan"):
        preset("tiny", moe_experts=4, moe_bias_rate=float("nan")).validate()
    with raises_as_flags("--moe-score must be softmax or sigmoid, got 'tanh'"):
        preset("tiny", moe_experts=4, moe_score="tanh").validate()
    with raises_as_flags("--moe-aux-loss-scope must be micro-batch or global"):
        preset("tiny", moe_experts=4, moe_aux_loss_scope="step").validate()
    with raises_as_flags("--moe-routed-scaling must be a finite number > 0"):
        preset("tiny", moe_experts=4, moe_routed_scaling=0.0).validate()


def test_capacity_mode_is_refused_with_split_sequences_and_dropless_is_not():
    """A capacity is per rank, so with sp or cp it would not be one process's; dropless
    routing is per token (its parity: test_moe_layouts.py)."""
    for plan in (ParallelPlan(tp=2, sequence_parallel=True), ParallelPlan(cp=2)):
        with raises_as_flags(r"^--moe-capacity-factor 1.0 with --sequence-parallel or --cp > 1"
                             r" is not supported \(its capacity is per rank\): use 0"):
            check_capabilities(plan, preset("tiny", moe_experts=4, moe_capacity_factor=1.0))
        check_capabilities(plan, preset("tiny", moe_experts=4, moe_capacity_factor=0.0))


def test_moe_layers_and_parameter_count():
    cfg = preset("tiny", vocab_size=64, moe_experts=4, moe_every=2)
    model = build_model(cfg, ParallelMesh.local(), seed=5)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    names = [n for n, _ in model.named_parameters() if ".experts." in n]
    assert len(names) == 2 * 4 * 4  # 2 MoE layers x 4 experts x (fc w, b, proj w, b)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def _save_moe(corpus, out, tp, ep):
    world = torch.distributed.get_world_size()
    cfg = _cfg(corpus, 2)
    trainer = Trainer.build(cfg, worker_mesh(tp=tp, dp=world // tp, ep=ep))
    trainer.train_step(0)
    trainer.save(out, 1)
    params = dict(named_full_tensors(trainer.model))
    merged = {}
    for part in all_gather_objects(params, trainer.mesh.ep):
        merged.update(part)
    return merged


def _load_moe(corpus, out, tp, ep):
    world = torch.distributed.get_world_size()
    trainer = Trainer.build(_cfg(corpus, 2), worker_mesh(tp=tp, dp=world // tp, ep=ep))
    assert trainer.resume(out) == 1
    return dict(named_full_tensors(trainer.model))


def test_moe_checkpoint_moves_between_ep_degrees(corpus, tmp_path):
    saved = run_on_ranks(4, _save_moe, corpus, tmp_path, 1, 4)[0]
    loaded = run_on_ranks(2, _load_moe, corpus, tmp_path, 2, 1)[0]  # ep=4 -> tp=2, ep=1
    assert saved.keys() == loaded.keys()
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def test_checkpoint_of_another_moe_shape_is_refused(corpus, tmp_path):
    from meshtrain.checkpointing.checkpoint import CheckpointError, latest_checkpoint, read_manifest

    run_on_ranks(2, _save_moe, corpus, tmp_path, 1, 2)
    path = latest_checkpoint(tmp_path / "checkpoints")
    other = _cfg(corpus, 2).model_config(256)
    import dataclasses

    with pytest.raises(CheckpointError, match="moe_experts 4 there vs 2 here"):
        read_manifest(path, dataclasses.replace(other, moe_experts=2))
