"""Routing variants against hand-written references, the balancing state (global fractions,
choice bias) across ranks and checkpoints, and the fp32 router of a 16-bit model."""

import dataclasses

import pytest
import torch
import torch.utils.checkpoint
import transformers
from harness import run_on_ranks, worker_mesh
from torch.testing import assert_close
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from meshtrain import ParallelMesh, preset
from meshtrain.checkpointing.checkpoint import latest_checkpoint, load_checkpoint
from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.layers.routing import Router, RoutingRule, route
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer


def _logits(tokens=12, experts=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=gen)


def _reference_choice(scores, k, bias=None):
    """Per token, by hand: the k experts of largest (biased) score, in descending order."""
    chosen = []
    for t in range(scores.shape[0]):
        key = [float(scores[t, e]) + (0.0 if bias is None else float(bias[e]))
               for e in range(scores.shape[1])]
        chosen.append(sorted(range(len(key)), key=lambda e: -key[e])[:k])
    return torch.tensor(chosen)


def test_sigmoid_scores_renormalised_and_scaled():
    logits = _logits()
    rule = RoutingRule(top_k=3, capacity_factor=0.0, score="sigmoid", norm_topk_prob=True,
                       routed_scaling=2.5)
    r = route(logits, rule)
    scores = 1 / (1 + torch.exp(-logits))
    experts = _reference_choice(scores, 3)
    assert torch.equal(r.experts, experts)
    picked = scores.gather(1, experts)
    assert_close(r.weights, 2.5 * picked / picked.sum(1, keepdim=True))
    # the balancing loss uses the per-token normalised scores
    probs = scores / scores.sum(1, keepdim=True)
    f = torch.bincount(experts[:, 0], minlength=6).float() / 12
    assert_close(r.aux_loss, 6 * (f * probs.mean(0)).sum())


@pytest.mark.parametrize("k", [3, 4, 5, 6])
def test_top_k_up_to_every_expert(k):
    logits = _logits()
    r = route(logits, top_k=k, capacity_factor=0.0)
    probs = logits.softmax(-1)
    experts = _reference_choice(probs, k)
    assert torch.equal(r.experts, experts)
    assert_close(r.weights, probs.gather(1, experts) / probs.gather(1, experts).sum(1, True))
    assert r.kept.all()
    assert torch.equal(r.choices_per_expert, torch.bincount(experts.flatten(), minlength=6))
    unnormalised = route(logits, RoutingRule(top_k=k, capacity_factor=0.0,
                                             norm_topk_prob=False))
    assert_close(unnormalised.weights, probs.gather(1, experts))


def test_aux_loss_over_all_k_choices():
    logits = _logits()
    r = route(logits, RoutingRule(top_k=2, capacity_factor=0.0, aux_tokens="all"))
    probs = logits.softmax(-1)
    experts = _reference_choice(probs, 2)
    f = torch.bincount(experts.flatten(), minlength=6).float() / (12 * 2)
    assert_close(r.aux_loss, 6 * (f * probs.mean(0)).sum())


def test_aux_loss_weighs_given_global_fractions():
    logits = _logits()
    fractions = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    r = route(logits, top_k=2, capacity_factor=0.0, fractions=fractions)
    assert_close(r.aux_loss, 6 * (fractions * logits.softmax(-1).mean(0)).sum())
    first = route(logits, top_k=2, capacity_factor=0.0, fractions=torch.zeros(6))
    assert_close(first.aux_loss, route(logits, top_k=2, capacity_factor=0.0).aux_loss)


def test_sequence_wise_aux_loss():
    logits = _logits(tokens=12)
    r = route(logits, RoutingRule(top_k=2, capacity_factor=0.0, score="sigmoid"), sequences=3)
    scores = logits.sigmoid()
    probs = scores / scores.sum(1, keepdim=True)
    experts = _reference_choice(scores, 2)
    losses = []
    for seq in range(3):
        rows = slice(4 * seq, 4 * seq + 4)
        f = torch.bincount(experts[rows].flatten(), minlength=6).float() * 6 / (2 * 4)
        losses.append((f * probs[rows].mean(0)).sum())
    assert_close(r.seq_aux_loss, torch.stack(losses).mean())


def test_bias_changes_the_choice_not_the_weights():
    logits = _logits()
    probs = logits.softmax(-1)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # expert 5 chosen far more often
    r = route(logits, top_k=2, capacity_factor=0.0, bias=bias)
    experts = _reference_choice(probs, 2, bias)
    assert torch.equal(r.experts, experts)
    assert not torch.equal(experts, _reference_choice(probs, 2))
    picked = probs.gather(1, experts)  # unbiased scores of the biased choice
    assert_close(r.weights, picked / picked.sum(1, keepdim=True))


def test_bias_update_moves_toward_the_mean_load():
    router = Router(torch.nn.Linear(4, 4, bias=False), bias_rate=0.1, global_fractions=True,
                    aux_tokens="all")
    counts = torch.tensor([[0, 0, 0, 0], [9, 3, 2, 2], [5, 1, 1, 1]])  # kept, chosen, first
    router.update(counts)
    router.update(counts)
    assert router.expert_bias.tolist() == pytest.approx([-0.2, 0.2, 0.2, 0.2])
    assert router.load_fractions.tolist() == pytest.approx([9 / 16, 3 / 16, 2 / 16, 2 / 16])
    balanced = Router(torch.nn.Linear(4, 2, bias=False), bias_rate=0.1)
    balanced.update(torch.tensor([[0, 0], [3, 3], [0, 0]]))
    assert balanced.expert_bias.tolist() == [0.0, 0.0]  # sign(0): no move


def test_router_stays_fp32_in_a_bf16_model():
    cfg = preset("tiny", vocab_size=64, moe_experts=4, moe_every=2, moe_bias_rate=0.01,
                 moe_aux_loss_scope="global")
    model = build_model(cfg, ParallelMesh.local(), seed=5).to(torch.bfloat16)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.router.weight.dtype == torch.float32
    assert moe.router.expert_bias.dtype == moe.router.load_fractions.dtype == torch.float32
    assert next(moe.experts.parameters()).dtype == torch.bfloat16
    x = torch.randn(2, 5, cfg.hidden_size, dtype=torch.bfloat16)
    out = moe(x, AuxiliaryOutputs())
    assert out.dtype == torch.bfloat16
    assert moe.router(x.reshape(10, -1)).dtype == torch.float32  # fp32 scores, fp32 matmul
    assert_close(moe.router(x.reshape(10, -1)), x.reshape(10, -1).float() @ moe.router.weight.T)


BALANCED = {"moe_experts": 4, "moe_top_k": 2, "moe_every": 2, "moe_capacity_factor": 0.0,
            "moe_aux_loss_scope": "global", "moe_aux_loss_tokens": "all", "moe_bias_rate": 0.01}


def _balanced_cfg(corpus, out, model=None):
    return build_config({}, {
        "model": BALANCED | (model or {}),
        "train": {"steps": 2, "global_batch": 4, "micro_batch": 1, "seq_len": 8, "seed": 3,
                  "clip_grad": 0.0},
        "parallel": {"device": "cpu"}, "data": {"data": corpus},
        "checkpoint": {"out": str(out)}})


def _routers(model) -> dict[str, list]:
    return {n: [m.expert_bias.tolist(), m.load_fractions.tolist()]
            for n, m in model.named_modules() if isinstance(m, Router)}


def _train_balanced(corpus, out, degrees, steps, model=None):
    """`steps` steps at `degrees`, saved; the rows and every router's balancing state."""
    trainer = Trainer.build(_balanced_cfg(corpus, out, model), worker_mesh(**degrees))
    rows = [trainer.train_step(step) for step in range(steps)]
    trainer.save(out, steps)
    return rows, _routers(trainer.model)


def _check_against_one_process(corpus, tmp_path, degrees, world, model=None):
    got = run_on_ranks(world, _train_balanced, corpus, tmp_path / "run", degrees, 2, model)
    trainer = Trainer.build(_balanced_cfg(corpus, tmp_path / "one", model), ParallelMesh.local())
    rows = [trainer.train_step(step) for step in range(2)]
    routers = _routers(trainer.model)
    assert set(routers) == {name for _, rank_routers in got for name in rank_routers}
    for rank_rows, rank_routers in got:  # every replica's state the one process's
        for row, ref in zip(rank_rows, rows, strict=True):
            for key in ("loss", "moe_aux_loss", "moe_load_max_over_mean"):
                assert row[key] == pytest.approx(ref[key], rel=1e-5), key
        for name, (bias, fractions) in rank_routers.items():
            assert bias == routers[name][0], name  # the same signs: exactly equal
            assert fractions == pytest.approx(routers[name][1], abs=1e-7), name
    assert any(b != 0 for bias, _ in routers.values() for b in bias)
    return routers


def test_global_balancing_and_bias_equal_one_process(corpus, tmp_path):
    """dp 2: the global aux loss and the bias update see the whole batch, like one process;
    the saved state loads in one process (another layout)."""
    routers = _check_against_one_process(corpus, tmp_path, {"dp": 2}, 2)
    model = build_model(_balanced_cfg(corpus, tmp_path).model_config(256),
                        ParallelMesh.local(), seed=0)
    load_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"), model=model,
                    mesh=ParallelMesh.local())
    assert _routers(model) == routers


def test_a_recomputed_layer_is_counted_once(corpus, tmp_path):
    """`recompute` full replays each MoE layer in the backward: its routing is counted at the
    forward only, so the step's statistics equal a run without recomputation. torch's early
    stop would end the replay before the layer records anything, so it is turned off here:
    the whole layer replays, as a checkpoint without early stop does."""
    rows = {}
    for recompute in ("none", "full"):
        cfg = _balanced_cfg(corpus, tmp_path / recompute)
        cfg.plan = dataclasses.replace(cfg.plan, recompute=recompute)
        trainer = Trainer.build(cfg, ParallelMesh.local())
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            rows[recompute] = trainer.train_step(0)
    for key in ("moe_tokens_per_expert_mean", "moe_tokens_per_expert_max", "loss"):
        assert float(rows["full"][key]) == float(rows["none"][key]), key


@pytest.mark.extended
@pytest.mark.parametrize("degrees,world,model", [
    ({"dp": 2, "ep": 2}, 2, {"moe_score": "sigmoid", "moe_seq_aux_loss_coef": 0.01}),
    ({"tp": 2, "dp": 2, "ep": 2}, 4, None), ({"pp": 2}, 2, {"moe_every": 1})], ids=str)
def test_balancing_state_at_other_layouts(corpus, tmp_path, degrees, world, model):
    _check_against_one_process(corpus, tmp_path, degrees, world, model)


def test_cli_refuses_top_k_above_the_experts(corpus, tmp_path, capsys):
    code = main(["train", "--device", "cpu", "--moe-experts", "4", "--moe-top-k", "5",
                 "--data", corpus, "--out", str(tmp_path / "run"), "--steps", "1"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--moe-top-k 5 exceeds --moe-experts 4: use more experts or a smaller k")
    assert not (tmp_path / "run").exists()


def test_group_limited_routing_equals_transformers_deepseek_v3_router():
    """DeepSeek-V3's group-limited choice with a correction bias, sigmoid scores, renormalised
    and scaled weights: the same experts and weights as transformers' router (fp32)."""
    config = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5)
    gate = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(1)
    gate.weight.data = torch.randn(16, 16, generator=gen)
    gate.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
    x = torch.randn(64, 16, generator=gen)
    with torch.no_grad():
        logits, hf_weights, hf_experts = gate(x)
    rule = RoutingRule(top_k=4, capacity_factor=0.0, score="sigmoid", norm_topk_prob=True,
                       routed_scaling=2.5, groups=4, topk_groups=2)
    r = route(logits, rule, bias=gate.e_score_correction_bias)
    order, hf_order = r.experts.argsort(dim=-1), hf_experts.argsort(dim=-1)  # hf: unsorted
    assert torch.equal(r.experts.gather(1, order), hf_experts.gather(1, hf_order))
    assert_close(r.weights.gather(1, order), hf_weights.gather(1, hf_order))
    ungrouped = route(logits, dataclasses.replace(rule, groups=1, topk_groups=1),
                      bias=gate.e_score_correction_bias)
    assert not torch.equal(ungrouped.experts, r.experts)  # the group limit moved choices
    every_group = route(logits, dataclasses.replace(rule, topk_groups=4),
                        bias=gate.e_score_correction_bias)
    assert torch.equal(every_group.experts, ungrouped.experts)


@pytest.mark.parametrize("flags,message", [
    (["--moe-groups", "2", "--moe-topk-groups", "3"],
     "--moe-topk-groups 3 must be 1 .. --moe-groups 2"),
    (["--moe-groups", "3"], "--moe-groups 3 must divide --moe-experts 8 into groups"),
    (["--moe-groups", "4", "--moe-top-k", "3"],
     "--moe-top-k 3 exceeds the 2 experts of --moe-topk-groups 1 of 4 groups")], ids=str)
def test_cli_refuses_groups_that_cannot_route(corpus, tmp_path, capsys, flags, message):
    code = main(["train", "--device", "cpu", "--moe-experts", "8", *flags,
                 "--data", corpus, "--out", str(tmp_path / "run"), "--steps", "1"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()
