"""Hybrid context parallelism (`cp_mode` hybrid): all-to-all over `cp_a2a` ranks inside, the
ring over cp / cp_a2a outside. The core against a dense masked reference (causal, window,
documents) at cp 4 = 2 x 2, the mesh's two sub-axes, the bytes each part sends against the
formula, training against one process, the refusals, and the planner's price."""

import dataclasses
import math

import pytest
import torch
from harness import run_on_ranks, worker_mesh

from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.mesh import ParallelMesh
from meshtrain.models import preset
from meshtrain.parallel import CommRecorder
from meshtrain.parallel.layers.attention import AttentionCore
from meshtrain.parallel.layers.context_parallel import context_parallel_positions
from meshtrain.parallel.layers.masks import AttentionMask
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.costs import chunk_costs
from meshtrain.planner.hardware import Hardware
from meshtrain.planner.search import search
from meshtrain.planner.workload import Workload
from meshtrain.training.trainer import Trainer

S, HEADS, KV_HEADS, D = 32, 4, 2, 8


def _qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, KV_HEADS, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _documents() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    starts = torch.rand(2, S, generator=g) < 0.2
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=-1)


def _dense(q, k, v, mask: AttentionMask):
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    positions = torch.arange(S)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    scores = scores.masked_fill(~mask.allowed(positions, positions), float("-inf"))
    return scores.softmax(-1) @ v


def _hybrid_core(a2a: int, window, documents: bool):
    """This rank's output and q/k/v gradients against the dense reference (largest error)."""
    mesh = worker_mesh(cp=4, cp_a2a=a2a)
    inner, outer = mesh.axis("cp_a2a"), mesh.axis("cp_ring")
    assert mesh.cp.rank == outer.rank * a2a + inner.rank  # the all-to-all innermost
    mask = AttentionMask(window, _documents() if documents else None)
    full = [t.requires_grad_() for t in _qkv()]
    reference = _dense(*full, mask)
    reference.pow(2).sum().backward()
    mine = context_parallel_positions(S, 4, mesh.cp.rank)
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in full]
    core = AttentionCore(dropout=0.0, eager=False, cp_axis=mesh.cp, cp_mode="hybrid",
                         recompute=False, cp_split=(inner, outer))
    with CommRecorder() as sent:
        out = core(*local, None, mask)
        out.pow(2).sum().backward()
    _assert_sent_bytes(sent, a2a, 4 // a2a, local[0])
    errors = [(out - reference[:, :, mine]).abs().max().item()]
    errors += [(t.grad - f.grad[:, :, mine]).abs().max().item()
               for t, f in zip(local, full, strict=True)]
    return max(errors)


def _assert_sent_bytes(sent: CommRecorder, a2a: int, ring: int, q: torch.Tensor) -> None:
    """Per rank, with P the bytes of this rank's queries (key/value heads repeated to as many):
    8 all-to-alls over cp_a2a (q, k, v and the output, forward and backward), each sending
    (a2a - 1) / a2a P; over cp_ring, ring - 1 key/value blocks of 2P forward, ring - 1 again
    and ring gradient blocks backward (the last returning them home)."""
    p = q.numel() * q.element_size()
    exchanges = sent.select("all_to_all", "cp_a2a")
    assert len(exchanges) == (8 if a2a > 1 else 0)
    assert sent.ring_bytes("all_to_all", "cp_a2a") == 8 * (a2a - 1) / a2a * p * (a2a > 1)
    sends = 3 * ring - 2 if ring > 1 else 0
    assert sent.count("send", "cp_ring") == sends
    assert sent.ring_bytes("send", "cp_ring") == sends * 2 * p
    assert len(sent.records) == len(exchanges) + sends  # nothing else


def test_hybrid_attention_follows_the_mask():
    """cp 4 = 2 all-to-all x 2 ring, under a window over documents (the hardest mask)."""
    assert max(run_on_ranks(4, _hybrid_core, 2, 5, True)) < 1e-12


@pytest.mark.extended
@pytest.mark.parametrize("a2a,window,documents", [
    (2, None, False), (2, 5, False), (2, None, True), (4, 5, True), (1, 5, True)])
def test_hybrid_attention_follows_every_mask(a2a, window, documents):
    assert max(run_on_ranks(4, _hybrid_core, a2a, window, documents)) < 1e-12


EOD = 256
TRAIN = {"steps": 5, "global_batch": 2, "micro_batch": 2, "seq_len": 32, "seed": 5,
         "eval_every": 0, "warmup_steps": 1, "clip_grad": 0.0}
PACKED = {"document_mask": True, "reset_positions": True, "eod_mask_loss": True}
FEW_HEADS = {"model": "llama-tiny", "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
"""Two query heads, one key/value head: cp 4 exceeds the heads a rank holds."""


def _trajectory(data: str, model: dict, degrees: dict, parallel: dict, packed: bool):
    """Loss and gradient norm of 5 fp32 steps."""
    cfg = build_config({}, {"model": model, "train": TRAIN,
                            "parallel": {"device": "cpu", **degrees, **parallel},
                            "data": {"data": data} | (PACKED if packed else {}),
                            "checkpoint": {"out": "/nonexistent"}})
    mesh = worker_mesh(**degrees, cp_a2a=parallel.get("cp_a2a")) if degrees \
        else ParallelMesh.local()
    trainer = Trainer.build(cfg, mesh)
    rows = [trainer.train_step(step) for step in range(TRAIN["steps"])]
    return [(row["loss"], row["grad_norm"]) for row in rows]


def _assert_same_run(data, model, degrees, parallel, packed=True):
    reference = run_on_ranks(1, _trajectory, data, model, {}, {}, packed)[0]
    ranks = math.prod(degrees.values())
    rows = run_on_ranks(ranks, _trajectory, data, model, degrees, parallel, packed)[-1]
    for step, (got, want) in enumerate(zip(rows, reference, strict=True)):
        assert got == pytest.approx(want, rel=1e-5), (step, got, want)


HYBRID = {"cp_mode": "hybrid", "cp_a2a": 2}


def test_hybrid_trains_packed_documents_as_one_process(documents_file):
    """cp 4 = 2 all-to-all x 2 ring with 2 query heads (cp past the heads), documents masked."""
    _assert_same_run(documents_file, FEW_HEADS, {"cp": 4, "dp": 1}, HYBRID)


@pytest.mark.extended
@pytest.mark.parametrize("model,degrees,packed", [
    ({"model": "tiny"}, {"cp": 4, "dp": 1}, False),
    ({"model": "mistral-tiny"}, {"cp": 4, "dp": 1}, True),  # a window of 16
    ({"model": "tiny"}, {"tp": 2, "cp": 2, "dp": 1}, True),
    ({"model": "tiny"}, {"tp": 2, "cp": 4, "dp": 1}, True),  # 2 heads a tp rank, cp 4
    ({"model": "tiny"}, {"pp": 2, "cp": 2, "dp": 1}, True),
], ids=str)
def test_hybrid_trains_as_one_process_at_every_layout(corpus, documents_file, model, degrees,
                                                      packed):
    _assert_same_run(documents_file if packed else corpus, model, degrees, HYBRID, packed)


@pytest.mark.parametrize("flags,needle", [
    (["--nproc", "4", "--cp", "4", "--cp-mode", "hybrid", "--cp-a2a", "3"],
     "--cp-mode hybrid needs --cp-a2a dividing --cp 4, got 3"),
    (["--nproc", "4", "--cp", "4", "--cp-mode", "hybrid"],
     "--cp-mode hybrid needs --cp-a2a dividing --cp 4, got None"),
    (["--nproc", "8", "--tp", "2", "--cp", "4", "--cp-mode", "hybrid", "--cp-a2a", "4"],
     "--cp-a2a 4 must divide the heads per TP rank (2)"),
    (["--cp-mode", "hybrid", "--cp-a2a", "2"], "--cp-mode hybrid splits the context-parallel"
                                               " ranks: add --cp > 1"),
    (["--nproc", "2", "--cp", "2", "--cp-a2a", "2"],
     "--cp-a2a 2 sets --cp-mode hybrid's all-to-all group: add --cp-mode hybrid"),
])
def test_bad_hybrid_settings_are_one_line_before_any_rank_starts(capsys, corpus, tmp_path,
                                                                 flags, needle):
    argv = ["train", "--device", "cpu", "--data", corpus, "--out", str(tmp_path / "run"),
            *(["--tp", "1"] if "--tp" not in flags else []), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and needle in err, err


LINKS = Hardware(name="links", peak_tflops=100.0, hbm_gib=80, gpus_per_node=8,
                 intra_node_gbytes_per_s=400.0, inter_node_gbytes_per_s=25.0,
                 network_efficiency=0.5, collective_latency_s=1e-5, overlap_efficiency=0.0)
"""Two links 16x apart; nothing hidden behind compute, so each transfer shows whole."""
LONG_GPT = dataclasses.replace(preset("gpt2"), num_layers=2, max_seq_len=16384)


def test_the_planner_prices_hybrid_on_the_links_of_its_two_axes():
    """cp 16 = 4 all-to-all (inside a node of 8) x 4 ring (across two nodes), per layer: 4
    all-to-alls each way of a rank's queries Q over the node's link, 3 ring steps of 2Q
    forward and 3 + 4 backward over the network's."""
    plan = ParallelPlan(cp=16, dp=1, cp_mode="hybrid", cp_a2a=4, micro_batch=1)
    chunk = chunk_costs(Workload(LONG_GPT, plan, 16384, 1, "bf16"), LINKS)[0]
    q = 1 * 16384 // 16 * LONG_GPT.hidden_size * 2  # tokens x heads x head size, bf16
    exchange = 3 * 1e-5 + 3 / 4 * q / (400e9 * 0.5)
    step = 1e-5 + 2 * q / (25e9 * 0.5)
    layers = LONG_GPT.num_layers
    assert chunk.forward_comm == pytest.approx(layers * (4 * exchange + 3 * step))
    assert chunk.backward_comm == pytest.approx(layers * (4 * exchange + 7 * step))


def test_the_search_tries_each_all_to_all_group_inside_a_node():
    result = search(LONG_GPT, LINKS, gpus=16, seq_len=16384, global_batch=1, precision="bf16",
                    fixed={"tp": 1, "pp": 1, "cp": 16, "mb": 1, "zero": 0})
    tried = {p.layout.cp_a2a for p in result.ranked}
    assert tried == {None, 2, 4}  # 16 would leave the node, 8 does not divide the 12 heads
    best = result.best().layout
    assert (best.cp_mode, best.cp_a2a) == ("hybrid", 4)  # the least over the slow link
