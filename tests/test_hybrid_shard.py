"""Hybrid sharded data parallelism (`dp_shard`): ZeRO shards over groups of dp_shard
data-parallel ranks and the groups are replicas. The same run as one process, the memory of
ZeRO at dp = dp_shard, the bytes each mesh axis carries, checkpoints across (dp, dp_shard),
and the refusals."""

import pytest
from harness import raises_as_flags, run_on_ranks, worker_mesh
from test_zero import _assert_same_trajectory, _cfg, _losses

from meshtrain.config.run_config import validate
from meshtrain.memory import zero_formula_bytes
from meshtrain.models import preset
from meshtrain.parallel import CommRecorder
from meshtrain.planner.hardware import BUILT_IN
from meshtrain.planner.search import search
from meshtrain.training.trainer import Trainer, run_training

SCALARS = 64  # bytes: the loss and the gradient norm's sums, left out of the counts


def _run(corpus, degrees, parallel, steps=3):
    """(loss, norm) per step and evaluation; the first step's traffic by (op, axis); the
    bytes of model states held; the parameter bytes."""
    cfg = _cfg(corpus, steps=steps, parallel=parallel)
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    with CommRecorder() as rec:
        rows = [trainer.train_step(0)]
    rows += [trainer.train_step(step) for step in range(1, steps)]
    traffic = {(r.op, r.axis): 0 for r in rec.records}
    for r in rec.records:
        if r.payload_bytes > SCALARS:
            traffic[r.op, r.axis] += r.payload_bytes
    psi = sum(p.numel() for p in trainer.model.parameters()) * 4
    return ([(r["loss"], r["grad_norm"]) for r in rows] + [trainer.evaluate()], traffic,
            trainer.memory_report(), psi)


def _check_hybrid(corpus, stage, degrees, parallel, world, steps=3, dp_shard=2):
    """dp 4 = 2 replicas x 2 shards at `stage` against one process (and ZeRO at dp 2's
    memory): the trajectory, and each axis's bytes against the formulas (fp32, one
    micro-batch per rank)."""
    single = run_on_ranks(1, _run, corpus, {}, {}, steps)[0][0]
    rows, traffic, memory, psi = run_on_ranks(
        world, _run, corpus, degrees | {"dp_shard": dp_shard},
        parallel | {"zero": stage, "dp_shard": dp_shard}, steps)[0]
    (loss, norm), (ref_loss, ref_norm) = rows[0], single[0]
    assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-5)
    _assert_same_trajectory(rows, single)
    return traffic, memory, psi


def _assert_traffic(traffic, stage, psi_rank):
    """Over the shard group: ZeRO at dp = 2's reduce-scatters and gathers; over the replicas
    one all-reduce of the gradient shards (half the padded buckets); nothing over dp x cp."""
    padded = traffic["reduce_scatter", "zero_shard"]  # every bucket once (one micro-batch)
    assert psi_rank <= padded < psi_rank * 1.01
    gathers = 2 if stage == 3 else 1
    assert traffic["all_gather", "zero_shard"] == gathers * padded
    assert traffic["all_reduce", "zero_replica"] == padded // 2
    assert not {key for key, nbytes in traffic.items() if key[1] == "dp_cp" and nbytes}


def test_hybrid_zero3_is_one_process_with_zero_at_dp2s_memory_and_traffic(corpus):
    traffic, memory, psi = _check_hybrid(corpus, 3, {"dp": 4}, {}, 4, steps=2)
    _assert_traffic(traffic, 3, psi)
    expected = zero_formula_bytes(psi // 4, param_bytes=4, grad_bytes=4, state_bytes=8, dp=2,
                                  stage=3)
    assert abs(memory["total"] - expected) / expected < 0.01, (memory, expected)


@pytest.mark.extended
@pytest.mark.parametrize("stage", [1, 2])
def test_hybrid_zero1_and_2_at_tp1(corpus, stage):
    traffic, memory, psi = _check_hybrid(corpus, stage, {"dp": 4}, {}, 4)
    _assert_traffic(traffic, stage, psi)
    expected = zero_formula_bytes(psi // 4, param_bytes=4, grad_bytes=4, state_bytes=8, dp=2,
                                  stage=stage)
    assert abs(memory["total"] - expected) / expected < 0.01, (memory, expected)


@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_at_tp2(corpus, stage):
    _check_hybrid(corpus, stage, {"tp": 2, "dp": 4}, {"tp": 2}, 8, steps=2)


@pytest.mark.extended
@pytest.mark.timeout(900)
def test_hybrid_zero1_with_a_pipeline(corpus):
    _check_hybrid(corpus, 1, {"pp": 2, "dp": 4}, {"pp": 2}, 8, steps=2)


@pytest.mark.extended
@pytest.mark.parametrize("stage,target", [(2, "cpu"), (3, "nvme")])
def test_hybrid_with_offload(corpus, tmp_path, stage, target):
    offload = {"offload_optimizer": target} | (
        {"offload_dir": str(tmp_path)} if target == "nvme" else {})
    traffic, _, psi = _check_hybrid(corpus, stage, {"dp": 4}, offload, 4, steps=2)
    _assert_traffic(traffic, stage, psi)


@pytest.mark.extended
def test_hybrid_with_context_parallelism_shards_over_cp_inside_the_group(corpus):
    """dp 2 x cp 2 at dp_shard 1: each shard group is one rank's cp pair, the replicas the
    two dp ranks."""
    _check_hybrid(corpus, 3, {"dp": 2, "cp": 2}, {"cp": 2}, 4, steps=2, dp_shard=1)


def _train(corpus, out, degrees, parallel, resume=False, **train):
    cfg = _cfg(corpus, out, parallel=parallel, **train)
    cfg.checkpoint.resume = resume
    run_training(cfg)


@pytest.mark.extended
def test_checkpoints_reshard_between_dp_and_dp_shard(corpus, tmp_path):
    """Saved at dp 4 = 2 x 2 (ZeRO-3), resumed at dp 2 (ZeRO-1, shards over both) and at
    dp 4 = 4 x 1 (ZeRO-2): the continuation is the uninterrupted run."""
    whole = tmp_path / "whole"
    run_on_ranks(1, _train, corpus, str(whole), {}, {})
    for i, (world, target) in enumerate([(2, {"zero": 1}),
                                         (4, {"zero": 2, "dp_shard": 1})]):
        parts = tmp_path / f"parts-{i}"
        run_on_ranks(4, _train, corpus, str(parts), {}, {"zero": 3, "dp_shard": 2},
                     stop_at=4)
        run_on_ranks(world, _train, corpus, str(parts), {}, target, resume=True)
        a, b = _losses(parts), _losses(whole)
        assert a.keys() == b.keys() == set(range(1, 9))
        for step in a:
            assert a[step] == pytest.approx(b[step], rel=1e-5), (target, step)


@pytest.mark.parametrize("parallel,model,match", [
    ({"zero": 1, "dp_shard": 3}, {}, "--dp-shard 3 must divide --dp 4"),
    ({"dp_shard": 2}, {}, "--dp-shard 2 sets the group ZeRO shards over: add --zero 1"),
    ({"zero": 1, "dp_shard": 2, "ep": 2}, {"moe_experts": 4},
     "--dp-shard does not shard MoE experts yet"),
])
def test_bad_dp_shard(corpus, parallel, model, match):
    cfg = _cfg(corpus, model=model, parallel={"tp": 1} | parallel)
    with raises_as_flags(match):
        validate(cfg, 4)


def test_the_planner_prefers_node_sized_shard_groups_when_gathers_would_cross_nodes():
    """llama2-13b at ZeRO-3 on 64 H100s, one sequence per rank: the parameter gathers and
    gradient reduce-scatters of every micro-batch over all 64 ranks cross nodes and show; in
    groups of 8 they stay on NVLink, and only the gradient shards cross nodes, once a step.
    The search tries dp_shard itself, and ranks S = 8 first."""
    result = search(preset("llama2-13b"), BUILT_IN["h100-80g"], gpus=64, seq_len=4096,
                    global_batch=64, precision="bf16",
                    fixed={"tp": 1, "pp": 1, "zero": 3, "recompute": "full"})
    times = {p.layout.dp_shard: p.step_time_s for p in result.ranked
             if p.layout.dp == 64 and p.layout.micro_batch == 1}
    assert result.ranked[0].layout.dp_shard == 8
    assert times[8] < 0.7 * times[None], times
    # the price: the states of ZeRO at dp = 8
    memory = {p.layout.dp_shard: p.memory.optimizer_states for p in result.ranked
              if p.layout.dp == 64 and p.layout.micro_batch == 1}
    assert memory[8] == pytest.approx(8 * memory[None], rel=1e-6)
