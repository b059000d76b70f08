"""Attention masks: the mask rule (causal, sliding window, documents) against brute force; every
attention path (eager, SDPA, ring and all-to-all context parallelism, the windowed key/value
cache) against a dense masked reference; packed documents giving each token the loss it has in
its document alone at tp 2, cp 2 (ring and all-to-all) and pp 2; refusals before any rank starts.
"""

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import cp_core_errors, run_on_ranks, worker_mesh

from meshtrain.config.run_config import build_config, check_packing, validate
from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh
from meshtrain.models import preset
from meshtrain.parallel.layers.attention import AttentionCore, attention_kernel
from meshtrain.parallel.layers.context_parallel import (
    context_parallel_positions,
    ring_sub_blocks,
)
from meshtrain.parallel.layers.flex import block_mask, flex_attention_masked
from meshtrain.parallel.layers.masks import (
    CAUSAL,
    AttentionMask,
    document_ids,
    document_positions,
)
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

EOD = 256


def test_documents_end_with_their_end_of_document_token():
    ids = torch.tensor([[5, EOD, 1, 7, EOD, EOD, 3]])
    documents = document_ids(ids, EOD)
    assert documents.tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(documents).tolist() == [[0, 1, 0, 1, 2, 0, 0]]


def _random_documents(rows: int, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(rows, length, generator=g) < 0.25
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=-1)


@pytest.mark.parametrize("window", [None, 1, 3, 40])
def test_the_mask_is_the_rule_it_states(window):
    documents = _random_documents(2, 12, seed=window or 0)
    mask = AttentionMask(window, documents)
    positions = torch.arange(12)
    allowed = mask.allowed(positions, positions)
    for b in range(2):
        for i in range(12):
            for j in range(12):
                rule = j <= i and (window is None or i - j < window) \
                    and documents[b, i] == documents[b, j]
                assert bool(allowed[b, 0, i, j]) == rule
    g = torch.Generator().manual_seed(1)
    for _ in range(200):  # a block it calls invisible has no visible pair
        q, k = (torch.randperm(12, generator=g)[:4] for _ in range(2))
        assert mask.visible_span(q, k) or not mask.allowed(q, k).any()
    for q_lo, k_lo, n in itertools.product(range(12), range(12), (1, 2, 3, 5)):
        q, k = torch.arange(q_lo, min(12, q_lo + n)), torch.arange(k_lo, min(12, k_lo + n))
        assert mask.visible_span(q, k) == bool(mask.allowed(q, k).any())  # runs: exact


def _dense(q, k, v, mask: AttentionMask, k_start: int = 0):
    """softmax(QK^T/sqrt(d) masked)V, the reference (key/value heads repeated); the keys start
    at sequence index `k_start`, the queries are the last of their tokens."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    k_pos = torch.arange(k_start, k_start + k.shape[-2])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask.allowed(k_pos[len(k_pos) - q.shape[-2]:], k_pos),
                                float("-inf"))
    return scores.softmax(-1) @ v


def _qkv(seed: int, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, s, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


MASKS = [(None, False), (5, False), (None, True), (5, True)]


@pytest.mark.parametrize("window,documents", MASKS)
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "sdpa"])
def test_local_kernels_follow_the_mask(window, documents, eager):
    q, k, v = _qkv(0)
    mask = AttentionMask(window, _random_documents(2, 16, 3) if documents else None)
    core = AttentionCore(dropout=0.0, eager=eager, cp_axis=ParallelMesh.local().cp,
                         cp_mode="ring", recompute=False)
    assert torch.allclose(core(q, k, v, None, mask), _dense(q, k, v, mask), atol=1e-12)


FLEX_CASES = {  # (window, documents, key/value heads, queries, keys, k_start)
    "window": (5, False, 4, 16, 16, 0),
    "documents-gqa": (None, True, 2, 16, 16, 0),
    "both-gqa": (5, True, 1, 16, 16, 0),
    "tiles": (40, True, 2, 300, 300, 0),  # over 128: the block mask has empty and full tiles
    "cached-window": (5, False, 2, 6, 16, 9),
    "cached-documents": (None, True, 2, 6, 16, 9),
    "chunked-prefill": (None, False, 2, 6, 16, 0),
}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", FLEX_CASES)
def test_the_flex_path_computes_what_the_dense_mask_does(case):
    """The GPU's kernel, run here forward only (torch's flex_attention has no CPU backward)."""
    window, documents, kv_heads, s, t, k_start = FLEX_CASES[case]
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, s, 16, generator=g)
    k, v = (torch.randn(2, kv_heads, t, 16, generator=g) for _ in range(2))
    mask = AttentionMask(window, _random_documents(2, k_start + t, 6) if documents else None)
    with torch.no_grad():
        out = flex_attention_masked(q, k, v, mask, k_start)
    assert (out - _dense(q, k, v, mask, k_start)).abs().max() < 1e-5


def test_the_block_mask_marks_the_tiles_the_mask_leaves_visible():
    mask = AttentionMask(40, _random_documents(2, 300, 6))
    blocks = block_mask(mask, 300, 300, 0, torch.device("cpu"))
    positions = torch.arange(300)
    allowed = F.pad(mask.allowed(positions, positions), (0, 84, 0, 84))  # to 3 x 3 tiles
    tiles = allowed.view(2, 1, 3, 128, 3, 128).any(dim=(3, 5))
    assert torch.equal(blocks.to_dense().bool(), tiles) and not tiles.all()
    assert block_mask(mask, 300, 300, 0, torch.device("cpu")) is blocks  # built once per mask
    assert block_mask(CAUSAL, 6, 16, 0, torch.device("cpu")) is not \
        block_mask(CAUSAL, 6, 16, 0, torch.device("cpu"))  # the shared mask keeps nothing


def test_a_gpu_runs_flex_wherever_the_cpu_builds_a_dense_mask():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device name: no GPU needed
    for mask in (AttentionMask(5), AttentionMask(None, _random_documents(2, 16, 0)),
                 AttentionMask(5, _random_documents(2, 16, 0))):
        assert attention_kernel(cuda, mask, 0.0, 16, 16) == "flex"
        assert attention_kernel(cuda, mask, 0.0, 6, 16) == "flex"
        assert attention_kernel(cpu, mask, 0.0, 16, 16) == "dense"
        assert attention_kernel(cuda, mask, 0.1, 16, 16) == "dense"  # flex has no dropout
        assert attention_kernel(cuda, mask, 0.0, 1, 16) == "dense"  # one row of a mask
    for device in (cpu, cuda):
        assert attention_kernel(device, CAUSAL, 0.0, 16, 16) == "causal"
        assert attention_kernel(device, CAUSAL, 0.0, 1, 16) == "unmasked"
    assert attention_kernel(cuda, CAUSAL, 0.0, 6, 16) == "flex"  # chunked prefill
    assert attention_kernel(cpu, CAUSAL, 0.0, 6, 16) == "dense"


def _context_parallel(cp_mode: str, window, documents: bool):
    """This rank's share of the output and of q/k/v's gradients, against the dense reference."""
    mesh = worker_mesh(cp=2)
    full = [t.requires_grad_() for t in _qkv(1)]
    mask = AttentionMask(window, _random_documents(2, 16, 4) if documents else None)
    reference = _dense(*full, mask)
    reference.pow(2).sum().backward()
    mine = context_parallel_positions(16, 2, mesh.cp.rank)
    return cp_core_errors(full, reference, mine, mesh, cp_mode, mask)


@pytest.mark.parametrize("window,documents", MASKS)
@pytest.mark.parametrize("cp_mode", ["ring", "all2all"])
def test_context_parallel_attention_follows_the_mask(cp_mode, window, documents):
    assert max(run_on_ranks(2, _context_parallel, cp_mode, window, documents)) < 1e-12


def test_a_windowed_cache_keeps_the_window_and_generates_the_same_logits():
    cfg = preset("mistral-tiny", num_layers=2, sliding_window=5)
    model = build_model(cfg, ParallelMesh.local(), seed=2).eval()
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids)
        for prompt in (2, 7):  # shorter and longer than the window
            cache = model.kv_cache(20)
            steps = [model(ids[:, :prompt], cache=cache)]
            steps += [model(ids[:, i:i + 1], cache=cache) for i in range(prompt, 20)]
            assert torch.allclose(torch.cat(steps, dim=1), whole, atol=1e-5)
            assert cache.length == 20 and cache[0].keys.shape[-2] == 4  # the window less one


DOCS = [[5, 9, 3, 15], [10, 10, 12]]  # per row: document lengths, each ending with EOD


def _packed_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    rows = []
    for lengths in DOCS:
        row = []
        for n in lengths:
            row += torch.randint(0, EOD, (n - 1,), generator=g).tolist() + [EOD]
        rows.append(row)
    return torch.tensor(rows)


def _per_token_losses(family: str, degrees: dict, plan: dict):
    """Per-token losses of the packed rows at this layout (documents masked, positions reset),
    as (this rank's positions, losses `[b, s/cp]`)."""
    mesh = worker_mesh(**degrees)
    cfg = preset(family, vocab_size=EOD + 1, num_layers=2, sliding_window=None)
    model = build_model(cfg, mesh, ParallelPlan(**degrees, **plan), seed=3).eval()
    ids = _packed_ids()
    targets = torch.roll(ids, -1, dims=1)
    documents = document_ids(ids, EOD)
    mine = context_parallel_positions(ids.shape[1], mesh.cp.size, mesh.cp.rank)
    with torch.no_grad():
        logits = model(ids[:, mine], document_positions(documents)[:, mine],
                       documents=documents)
        losses = model.factory.loss(logits, targets[:, mine], ignore_index=-100)
    return mine, losses


def _alone(family: str) -> torch.Tensor:
    """Each document run alone by one process: the per-token losses `[b, s]` of the rows."""
    cfg = preset(family, vocab_size=EOD + 1, num_layers=2, sliding_window=None)
    model = build_model(cfg, ParallelMesh.local(), seed=3).eval()
    ids = _packed_ids()
    targets = torch.roll(ids, -1, dims=1)
    rows = []
    for b, lengths in enumerate(DOCS):
        ends = np.cumsum([0, *lengths])
        with torch.no_grad():
            rows.append(torch.cat([F.cross_entropy(model(ids[b:b + 1, lo:hi])[0, :, :EOD + 1],
                                                   targets[b, lo:hi], reduction="none")
                                   for lo, hi in zip(ends[:-1], ends[1:], strict=True)]))
    return torch.stack(rows)


@pytest.mark.parametrize("family", ["tiny", "llama-tiny"], ids=["gpt", "llama"])
@pytest.mark.parametrize("degrees,plan", [
    ({"tp": 2}, {}), ({"cp": 2}, {"cp_mode": "ring"}), ({"cp": 2}, {"cp_mode": "all2all"})],
    ids=["tp2", "cp2-ring", "cp2-all2all"])
def test_a_packed_batch_gives_each_token_its_loss_alone(family, degrees, plan):
    expected = _alone(family)
    packed = torch.empty_like(expected)
    for mine, losses in run_on_ranks(2, _per_token_losses, family, degrees, plan):
        packed[:, mine] = losses
    assert (packed - expected).abs().max().item() < 1e-6


PACKED = {"document_mask": True, "reset_positions": True, "eod_mask_loss": True}


def _cfg(data: str, model: str = "llama-tiny", micro_batch: int = 2, **parallel):
    return build_config({}, {"model": {"model": model, "num_layers": 2}, "train": {
        "steps": 4, "global_batch": 4, "micro_batch": micro_batch, "seq_len": 32, "seed": 5,
        "eval_every": 0, "warmup_steps": 1}, "parallel": {"device": "cpu"} | parallel,
        "data": {"data": data} | PACKED, "checkpoint": {"out": "/nonexistent"}})


def _trajectory(data: str, model: str, degrees: dict, parallel: dict) -> list[float]:
    cfg = _cfg(data, model, **parallel)  # parallel may set micro_batch
    cfg.plan = dataclasses.replace(cfg.plan, **degrees)
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    return [trainer.train_step(step)["loss"] for step in range(4)]


@pytest.mark.parametrize("model", ["tiny", "llama-tiny"], ids=["gpt", "llama"])
def test_packed_training_is_the_same_run_at_pp2_tp2_and_cp2(documents_file, model):
    reference = run_on_ranks(1, _trajectory, documents_file, model, {"dp": 1}, {})[0]
    for degrees, parallel in [({"pp": 2, "dp": 1}, {"pp": 2}), ({"tp": 2, "dp": 1}, {}),
                              ({"cp": 2, "dp": 1}, {"cp": 2})]:
        losses = run_on_ranks(2, _trajectory, documents_file, model, degrees, parallel)[-1]
        rel = max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))
        assert rel < 1e-5, (degrees, rel)


def test_the_eod_masked_loss_is_the_batch_s_per_token_mean_however_it_is_split(
        documents_file):
    """Micro-batches and dp ranks hold different numbers of loss tokens: each token weighs the
    same whatever the split, as in one micro-batch on one process (not each micro-batch's
    mean averaged, which moved micro-batch 1 by 2e-4 from micro-batch 4 here)."""
    whole = run_on_ranks(1, _trajectory, documents_file, "tiny", {"dp": 1},
                         {"micro_batch": 4})[0]
    for degrees, parallel in [({"dp": 1}, {"micro_batch": 1}),
                              ({"dp": 2}, {"micro_batch": 1}),
                              ({"pp": 2, "dp": 1}, {"pp": 2, "micro_batch": 1}),
                              ({"cp": 2, "dp": 2}, {"cp": 2, "micro_batch": 1})]:
        ranks = math.prod(degrees.values())
        losses = run_on_ranks(ranks, _trajectory, documents_file, "tiny", degrees, parallel)[-1]
        rel = max(abs(a - b) / b for a, b in zip(losses, whole, strict=True))
        assert rel < 2e-6, (degrees, parallel, rel)


def test_packing_settings_are_refused_where_they_cannot_run(corpus, documents_file):
    cfg = _cfg(corpus)
    with pytest.raises(SettingError, match="`document_mask` needs documents, and `data` .*"
                                           " marks none") as error:
        check_packing(cfg, None)
    assert error.value.code is Code.DOCUMENTS_WITHOUT_EOD
    check_packing(_cfg(documents_file), EOD)
    cfg.data.document_mask = False
    with pytest.raises(SettingError, match="`reset_positions` restarts positions") as error:
        validate(cfg, 1)
    assert error.value.code is Code.RESET_POSITIONS_MASK
    cfg = _cfg(documents_file, tp=4, tp_scheme="2d", nproc=4)
    with pytest.raises(SettingError, match="`tp_scheme` 2d splits them 2 ways") as error:
        validate(cfg, 4)
    assert error.value.code is Code.DOCUMENT_MASK_SPLIT


def _counted(seq_len: int, cp: int, mask: AttentionMask) -> list[int]:
    """Score elements each rank's ring computes over its steps (`ring_sub_blocks`)."""
    positions = [context_parallel_positions(seq_len, cp, r) for r in range(cp)]
    return [sum(len(positions[r][rows]) * len(positions[(r - step) % cp][cols])
                for step in range(cp)
                for rows, cols in ring_sub_blocks(positions[r], positions[(r - step) % cp], mask))
            for r in range(cp)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_attention_computes_only_the_sub_blocks_the_mask_leaves(cp):
    """Under the causal mask a rank computes 3/4 of its own block and half of each other one
    (whole blocks: cp of them), the same on every rank; a window skips more."""
    s = 64 * cp
    n = s // cp
    counts = _counted(s, cp, AttentionMask())
    assert counts == [n * n * (3 / 4 + (cp - 1) / 2)] * cp
    windowed = _counted(s, cp, AttentionMask(window=n // 2))
    assert max(windowed) < min(counts)


def test_ring_attention_skips_the_chunk_pairs_no_document_spans():
    """Documents shorter than a chunk leave most pairs of chunks empty: the ring computes a
    (query chunk, key chunk) pair exactly when some token of one attends some of the other."""
    cp, s = 4, 256
    g = torch.Generator().manual_seed(3)
    starts = torch.rand(2, s, generator=g) < 1 / 16  # documents of ~16 tokens; chunks of 32
    mask = AttentionMask(documents=torch.cumsum(starts.int(), dim=-1))
    positions = [context_parallel_positions(s, cp, r) for r in range(cp)]
    for r, source in itertools.product(range(cp), range(cp)):
        q_pos, k_pos = positions[r], positions[source]
        computed = torch.zeros(len(q_pos), len(k_pos), dtype=torch.bool)
        for rows, cols in ring_sub_blocks(q_pos, k_pos, mask):
            computed[rows, cols] = True
        visible = mask.allowed(q_pos, k_pos).any(dim=0)[0]
        half = len(q_pos) // 2
        for a, b in itertools.product((slice(0, half), slice(half, None)), repeat=2):
            assert computed[a, b].all() == computed[a, b].any() == visible[a, b].any()
    assert sum(_counted(s, cp, mask)) < sum(_counted(s, cp, AttentionMask())) / 2
