"""ZeRO 1/2/3 against plain data parallelism: trajectories, memory, communication, offload and
checkpoints across stages and layouts."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from harness import LLAMA, raises_as_flags, run_on_ranks, worker_mesh

from meshtrain.config.run_config import build_config, validate
from meshtrain.memory import zero_formula_bytes
from meshtrain.parallel import CommRecorder
from meshtrain.parallel.runtime import zero_stage
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer, run_training


def _cfg(corpus, out="/nonexistent", *, model=None, parallel=None, **train):
    settings = {"steps": 8, "global_batch": 8, "micro_batch": 2, "seq_len": 32, "seed": 4,
                "lr": 3e-3, "warmup_steps": 2, "eval_batches": 1} | train
    return build_config({}, {"model": model or {}, "train": settings,
                             "parallel": {"device": "cpu"} | (parallel or {}),
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _rows(corpus, degrees, parallel, model=None, **train):
    cfg = _cfg(corpus, model=model, parallel=parallel, **train)
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    rows = [trainer.train_step(step) for step in range(cfg.train.steps)]
    return [(r["loss"], r["grad_norm"]) for r in rows] + [trainer.evaluate()]


def _assert_same_trajectory(rows, reference, rel=1e-4, norm_rel=None):
    assert len(rows) == len(reference)
    for (loss, norm), (ref_loss, ref_norm) in zip(rows[:-1], reference[:-1], strict=True):
        assert loss == pytest.approx(ref_loss, rel=rel)
        assert norm == pytest.approx(ref_norm, rel=norm_rel or rel)  # each gradient once
    assert rows[-1] == pytest.approx(reference[-1], rel=rel)  # evaluation


@pytest.mark.parametrize("degrees,parallel,model", [
    ({"dp": 2}, {}, None),
    # (tp2xdp2's ZeRO path is the one below with sp and recompute on: extended)
    pytest.param({"tp": 2, "dp": 2}, {}, None, marks=pytest.mark.extended),
    ({"tp": 2, "dp": 2}, {"sequence_parallel": True, "recompute": "full"}, None),
    ({"dp": 2, "ep": 2}, {"ep": 2}, {"moe_experts": 4}),
    ({"cp": 2, "dp": 1}, {"cp": 2}, None),
    # one key/value head shared by both TP ranks: pieces summed over them, counted once
    ({"tp": 2, "dp": 2}, {"offload_optimizer": "cpu"}, LLAMA | {"num_kv_heads": 1}),
    # (Llama's MoE layers are GPT's behind its blocks, whose ZeRO path the case above runs)
    pytest.param({"dp": 2, "ep": 2}, {"ep": 2}, LLAMA | {"moe_experts": 4},
                 marks=pytest.mark.extended),
], ids=["dp2", "tp2xdp2", "tp2xdp2-sp-recompute", "dp2xep2-moe", "cp2",
        "llama-tp2xdp2-shared-kv-offload", "llama-dp2xep2-moe"])
def test_zero_stages_follow_plain_data_parallelism(corpus, degrees, parallel, model):
    world = degrees.get("tp", 1) * degrees.get("cp", 1) * degrees["dp"]
    offload = {k: v for k, v in parallel.items() if k == "offload_optimizer"}  # ZeRO only
    parallel = {k: v for k, v in parallel.items() if k not in offload}
    reference = run_on_ranks(world, _rows, corpus, degrees, parallel, model, steps=4)[0]
    assert reference[-2][0] < reference[0][0] - 0.3  # it learns
    for stage in (1, 2, 3):
        parallel_zero = parallel | offload | {"zero": stage}
        rows = run_on_ranks(world, _rows, corpus, degrees, parallel_zero, model, steps=4)[0]
        _assert_same_trajectory(rows, reference)


@pytest.mark.extended  # (the dp2xep2-moe case above runs ZeRO-3's expert path at edp 1)
def test_zero3_gathers_experts_over_their_data_parallel_ranks(corpus):
    """dp 4 x ep 2: each expert on two ranks (edp 2), sharded between them and gathered
    around its block; the same run as plain data parallelism."""
    degrees, parallel, model = {"dp": 4, "ep": 2}, {"ep": 2}, {"moe_experts": 4}
    reference = run_on_ranks(4, _rows, corpus, degrees, parallel, model, steps=3)[0]
    rows = run_on_ranks(4, _rows, corpus, degrees, parallel | {"zero": 3}, model, steps=3)[0]
    _assert_same_trajectory(rows, reference)


@pytest.mark.parametrize("schedule,model", [
    ({}, None), ({"pp_schedule": "interleaved", "virtual_stages": 2}, {"num_layers": 4})],
    ids=["1f1b", "interleaved"])
def test_zero1_with_a_pipeline_keeps_the_tied_embedding(corpus, schedule, model):
    degrees = {"pp": 2, "dp": 2}
    parallel = {"pp": 2} | schedule
    reference = run_on_ranks(4, _rows, corpus, degrees, parallel, model, steps=4)[0]
    rows = run_on_ranks(4, _rows, corpus, degrees, parallel | {"zero": 1}, model, steps=4)[0]
    _assert_same_trajectory(rows, reference)


def test_zero3_in_bf16_tracks_plain_bf16(corpus):
    bf16 = run_on_ranks(2, _rows, corpus, {"dp": 2}, {}, None, precision="bf16")[0]
    zero3 = run_on_ranks(2, _rows, corpus, {"dp": 2}, {"zero": 3}, None, precision="bf16")[0]
    # bf16 gradients rounded in differently shaped buckets: the losses stay within 2e-3, the
    # gradient norm (a spiky sum of squares late in the run) within 5e-2
    _assert_same_trajectory(zero3, bf16, rel=2e-3, norm_rel=5e-2)


def _bytes_held_by_the_graph(corpus, stage):
    """Storage bytes of everything autograd saved for backward, measured after the forward."""
    cfg = _cfg(corpus, steps=2, parallel={"zero": stage})
    trainer = Trainer.build(cfg, worker_mesh(dp=2))
    trainer.train_step(0)
    batch = trainer.executor.local_slices(trainer.train_data.micro_batches(
        1, dp_rank=trainer.mesh.dp.rank, dp_size=2))[0]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = trainer.executor.cross_entropy(batch)
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in saved}
    held = sum(nbytes for _, nbytes in storages)
    loss.backward()  # the freed parameters come back for it
    return held, sum(p.numel() * 4 for p in trainer.model.parameters())


def test_zero3_frees_gathered_parameters_between_forward_and_backward(corpus):
    """Autograd keeps weights (and views of them, such as a linear layer's transpose) for
    backward: under stage 3 those must not pin the gathered buffers."""
    replicated, params = run_on_ranks(2, _bytes_held_by_the_graph, corpus, 0)[0]
    sharded, _ = run_on_ranks(2, _bytes_held_by_the_graph, corpus, 3)[0]
    assert sharded <= replicated - 0.9 * params, (sharded, replicated, params)


def _zero3_gpt(num_layers: int):
    """(mesh, model, its stage-3 ZeRO) of a small GPT on this pool's 2-rank dp mesh."""
    from meshtrain import GPTConfig
    from meshtrain.parallel.runtime.zero import ZeroDataParallel

    mesh = worker_mesh(dp=2)
    cfg = GPTConfig(num_layers=num_layers, hidden_size=64, num_heads=4, vocab_size=512,
                    max_seq_len=16)
    model = build_model(cfg, mesh, seed=0)
    units = model.roles().units
    zero = ZeroDataParallel([params for _, params in units], mesh.dp_cp, stage=3)
    zero.attach([module for module, _ in units])
    return mesh, model, zero


def _zero3_backward_memory():
    mesh, model, zero = _zero3_gpt(num_layers=3)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(mesh.dp.rank))
    logits = model(ids)
    at_head = []  # this hook runs after ZeRO's own on the logits: the head's backward is next
    logits.register_hook(lambda grad: at_head.append(zero.transient_bytes))
    zero.sync = True
    model.loss(logits, ids).backward()
    zero.wait()
    return at_head[0], zero.peak_transient_bytes, [b.padded * 4 for b in zero.buckets]


def _zero3_block_backward_memory():
    """(tracked transient bytes, whether unit 0 is gathered) as each block's backward starts
    (last block first), and the bucket sizes."""
    mesh, model, zero = _zero3_gpt(num_layers=3)
    seen = []

    def record(_module, _args, out):  # after ZeRO's own forward hook, so its hook runs first
        out.register_hook(lambda grad: seen.append((zero.transient_bytes,
                                                    zero.buckets[0].resident)))

    for block in model.layers.values():
        block.register_forward_hook(record)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(mesh.dp.rank))
    zero.sync = True
    model.loss(model(ids), ids).backward()
    zero.wait()
    return seen, [b.padded * 4 for b in zero.buckets]


def test_zero3_frees_the_head_unit_for_the_blocks_backward():
    """Unit 0 (embedding, final norm, tied output layer) is read in backward by the output
    layer and the final norm only: it is freed once the last block's output gradient arrives,
    so no block's backward holds it beside its own unit, the one prefetched and the
    reductions in flight (bench_zero.py: 16.5 MiB off the blocks' backward, FSDP2 keeps its
    root gathered there). Unit 0's gradient bucket stays for the embedding's gradient."""
    seen, (unit0, *blocks) = run_on_ranks(2, _zero3_block_backward_memory)[0]
    block = max(blocks)
    assert len(seen) == len(blocks) and not any(resident for _, resident in seen), seen
    assert seen[0][0] <= unit0 + 2 * block, (seen, unit0, block)  # nothing in flight yet
    assert all(tracked <= unit0 + (2 + zero_stage._IN_FLIGHT_REDUCTIONS) * block
               for tracked, _ in seen), (seen, unit0, block)


def _zero3_gradient_bytes():
    """Bytes of gradient shards alive (ZeRO's, and any .grad autograd left) at the end of a
    step, through the next forward and at its head's backward, where activations peak; and
    after that step's reductions."""
    mesh, model, zero = _zero3_gpt(num_layers=2)
    optimizer = torch.optim.AdamW([piece for _, piece in zero.step_pieces()])

    def held() -> int:
        shards = {b.grad_shard.untyped_storage().data_ptr(): b.grad_shard.untyped_storage()
                  for b in zero.buckets if b.grad_shard is not None}
        return sum(s.nbytes() for s in shards.values()) \
            + sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(mesh.dp.rank))
    seen = {}
    for step in range(2):
        zero.zero_grad()
        zero.sync = True
        seen[f"forward {step}"] = held()
        logits = model(ids)
        logits.register_hook(lambda grad, step=step: seen.update({f"head {step}": held()}))
        model.loss(logits, ids).backward()
        zero.wait()
        seen[f"reduced {step}"] = held()
        zero.step(optimizer)
        seen[f"stepped {step}"] = held()
    return seen, sum(b.shard_size * 4 for b in zero.buckets)


def test_zero3_holds_gradient_shards_only_from_reduction_to_update():
    """Stages 2 and 3 make a bucket's gradient shard from the step's first reduction and free
    it after the update (FSDP2's sharded gradients live so too): none through the forward and
    the head's backward, where activations peak (bench_zero.py: the 33 MiB of shards held
    there were the rest of ZeRO-3's peak above FSDP2's)."""
    seen, shards = run_on_ranks(2, _zero3_gradient_bytes)[0]
    for step in range(2):
        assert seen[f"forward {step}"] == seen[f"head {step}"] == seen[f"stepped {step}"] == 0, \
            seen
        assert seen[f"reduced {step}"] == shards, (seen, shards)


def test_zero3_peak_is_bounded_by_the_units_it_gathers():
    """Stage 3's transient bytes at their peak: unit 0 (embedding, final norm) and its
    gradient bucket, the block in backward and the one prefetched, that block's gradient
    bucket and the reductions in flight. The head's backward, the step's memory peak, runs with
    unit 0 alone gathered (bench_zero.py: the prefetch there cost 12 MiB of peak)."""
    at_head, peak, (unit0, *blocks) = run_on_ranks(2, _zero3_backward_memory)[0]
    assert at_head == unit0
    block = max(blocks)
    in_flight = zero_stage._IN_FLIGHT_REDUCTIONS
    assert 0 < peak <= 2 * unit0 + (3 + in_flight) * block, (peak, unit0, block)


def _offload_run(corpus, stage, offload):
    cfg = _cfg(corpus, steps=4, parallel={"zero": stage, "offload_optimizer": offload})
    trainer = Trainer.build(cfg, worker_mesh(dp=2))
    rows = [trainer.train_step(step) for step in range(4)]
    values, _, _ = trainer.sync.export()
    return [(r["loss"], r["grad_norm"]) for r in rows], {k: v.clone() for k, v in values.items()}


@pytest.mark.parametrize("stage", [1, 3])
def test_cpu_offload_is_bitwise_the_same_run_on_this_machine(corpus, stage):
    plain = run_on_ranks(2, _offload_run, corpus, stage, "none")[0]
    offloaded = run_on_ranks(2, _offload_run, corpus, stage, "cpu")[0]
    assert offloaded[0] == plain[0]
    assert all(torch.equal(offloaded[1][k], v) for k, v in plain[1].items())


def _memory(corpus, stage, **train):
    trainer = Trainer.build(_cfg(corpus, steps=2, parallel={"zero": stage}, **train),
                            worker_mesh(dp=2))
    trainer.train_step(0)
    return trainer.memory_report()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("train,p,g,k", [({}, 4, 4, 8),
                                         ({"precision": "bf16", "grad_dtype": "bf16"}, 2, 2, 12)],
                         ids=["fp32", "bf16"])
def test_model_state_bytes_match_the_zero_paper(corpus, stage, train, p, g, k):
    report = run_on_ranks(2, _memory, corpus, stage, **train)[0]
    psi = report["num_parameters"]
    expected = zero_formula_bytes(psi, param_bytes=p, grad_bytes=g, state_bytes=k, dp=2,
                                  stage=stage)
    # only the padding of each bucket to a multiple of dp separates them
    assert abs(report["total"] - expected) / expected < 0.01, (report, expected)
    if stage == 2:  # full gradient buckets live only while a micro-batch is reduced
        assert 0 < report["peak_transient"] <= g * psi + 4096
    if stage == 3:  # a few units' parameters and gradients at a time, never the whole model
        assert report["parameters"] == pytest.approx(p * psi / 2, rel=0.01)
        assert 0 < report["peak_transient"] < (p + g) * psi


def _traffic(corpus, stage, micro_batch):
    cfg = _cfg(corpus, steps=2, global_batch=8, micro_batch=micro_batch,
               parallel={"zero": stage})
    trainer = Trainer.build(cfg, worker_mesh(dp=2))
    with CommRecorder() as rec:
        trainer.train_step(0)
    psi = sum(p.numel() for p in trainer.model.parameters()) * 4
    gradients = sum(r.ring_bytes for r in rec.select(axis="dp_cp") if r.payload_bytes > 64)
    return {op: [r.payload_bytes for r in rec.select(op, "dp_cp") if r.payload_bytes > 64]
            for op in ("all_reduce", "reduce_scatter", "all_gather")}, gradients, psi


@pytest.mark.parametrize("micro_batch,m", [(4, 1), (2, 2)])
def test_communication_per_stage(corpus, micro_batch, m):
    """Ring bytes per rank over dp = 2 (scalars for the loss and norm excluded): with one
    micro-batch ZeRO-1 and 2 send what the all-reduce sends, ZeRO-3 1.5 times that; with m
    micro-batches ZeRO-2 reduce-scatters m times and ZeRO-3 gathers 2m and reduce-scatters m."""
    traffic = {stage: run_on_ranks(2, _traffic, corpus, stage, micro_batch)[0]
               for stage in (0, 1, 2, 3)}
    (ops0, ring0, psi) = traffic[0]
    assert sum(ops0["all_reduce"]) == psi and ring0 == psi  # 2(N-1)/N x psi at N = 2
    for stage, (gathers, scatters) in {1: (1, 1), 2: (1, m), 3: (2 * m, m)}.items():
        ops, ring, _ = traffic[stage]
        assert not ops["all_reduce"]
        padded = sum(ops["reduce_scatter"]) / scatters  # every bucket once, padded to dp
        assert psi <= padded < psi * 1.01
        assert sum(ops["all_gather"]) == pytest.approx(gathers * padded, rel=1e-12)
        assert ring == pytest.approx((gathers + scatters) / 2 * padded, rel=1e-12)
    assert traffic[1][1] / ring0 == pytest.approx(1.0, rel=0.01)
    if m == 1:
        assert traffic[2][1] / ring0 == pytest.approx(1.0, rel=0.01)
        assert traffic[3][1] / ring0 == pytest.approx(1.5, rel=0.01)


def _train(corpus, out, degrees, zero, resume=False, **train):
    cfg = _cfg(corpus, out, parallel={"zero": zero}, **train)
    cfg.checkpoint.resume = resume
    cfg.plan = dataclasses.replace(cfg.plan, **degrees)
    run_training(cfg)


def _losses(out):
    rows = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_zero3_checkpoint_resumes_at_zero1_and_at_tp2(corpus, tmp_path):
    whole = tmp_path / "whole"
    run_on_ranks(1, _train, corpus, str(whole), {}, 0)
    for i, target in enumerate(({"dp": 2}, {"tp": 2, "dp": 2})):
        parts = tmp_path / f"parts-{i}"
        run_on_ranks(4, _train, corpus, str(parts), {"dp": 4}, 3, stop_at=4)
        world = target.get("tp", 1) * target["dp"]
        run_on_ranks(world, _train, corpus, str(parts), target, 1, resume=True)
        a, b = _losses(parts), _losses(whole)
        assert a.keys() == b.keys() == set(range(1, 9))
        for step in a:  # moments and masters came through: the continuation is the same run
            assert a[step] == pytest.approx(b[step], rel=1e-5), (target, step)


@pytest.mark.parametrize("parallel,model,match", [
    ({"zero": 4}, {}, "--zero must be 0, 1, 2 or 3"),
    ({"offload_optimizer": "cpu"}, {}, "--offload-optimizer cpu .* add --zero 1"),
    ({"offload_optimizer": "disk"}, {}, "--offload-optimizer must be none, cpu or nvme"),
    ({"offload_optimizer": "nvme", "zero": 1}, {},
     "--offload-optimizer nvme keeps its files in --offload-dir: set both"),
    ({"zero": 2, "pp": 2}, {}, "--zero 2 does not combine with --pp 2"),
    ({"zero": 1, "pp": 2, "pp_schedule": "2bw"}, {}, "--zero with --pp-schedule 2bw"),
])
def test_bad_zero_settings(corpus, parallel, model, match):
    cfg = _cfg(corpus, model=model, parallel={"tp": 1} | parallel)
    with raises_as_flags(match):
        validate(cfg, 4)


def test_zero1_refuses_gradients_that_left_their_bucket():
    from meshtrain import ParallelMesh, preset
    from meshtrain.parallel.runtime.zero import ZeroDataParallel

    model = build_model(preset("tiny"), ParallelMesh.local(), seed=0)
    zero = ZeroDataParallel([params for _, params in model.roles().units],
                            ParallelMesh.local().dp_cp, stage=1)
    zero.wait()  # views intact: fine
    model.zero_grad()  # sets every .grad to None: backward would make fresh, unreduced ones
    with pytest.raises(RuntimeError, match="zero gradients with the reducer's zero_grad"):
        zero.wait()


def _router_dtypes_and_rows(corpus, parallel):
    cfg = _cfg(corpus, steps=3, model={"moe_experts": 4, "moe_capacity_factor": 0},
               parallel={"ep": 2} | parallel, precision="bf16")
    trainer = Trainer.build(cfg, worker_mesh(dp=2, ep=2))
    routers = [m for m in trainer.model.modules() if type(m).__name__ == "Router"]
    seen = []
    for r in routers:
        r.register_forward_pre_hook(lambda m, _a: seen.append(m.weight.dtype))
    rows = [trainer.train_step(step) for step in range(cfg.train.steps)]
    weights = {id(r.weight) for r in routers}
    # an fp32 bucket steps its parameter shard itself: the master is no rounded copy
    masters = {(b.dtype, b.master is b.param_shard) for reducer in trainer.sync.reducers
               for b in reducer.buckets if any(id(p) in weights for p in b.params)}
    return (len(routers), set(seen), masters,
            [(r["loss"], r["grad_norm"]) for r in rows] + [trainer.evaluate()])


def test_zero3_keeps_the_fp32_router_of_a_bf16_moe_model(corpus):
    """A unit's parameters are bucketed by dtype: the router scores in fp32 under ZeRO-3 as
    under ZeRO-1, whose run this one tracks (bf16 tolerance, as above)."""
    zero1 = run_on_ranks(2, _router_dtypes_and_rows, corpus, {"zero": 1})[0]
    zero3 = run_on_ranks(2, _router_dtypes_and_rows, corpus, {"zero": 3})[0]
    for routers, seen, masters, _ in (zero1, zero3):
        assert routers > 0 and seen == {torch.float32} and masters == {(torch.float32, True)}
    _assert_same_trajectory(zero3[3], zero1[3], rel=2e-3, norm_rel=5e-2)
