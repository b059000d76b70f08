"""Context parallelism balanced by work: the layout is a partition of the sequence with equal
token counts, its counted work is the ring's own sub-block count, it balances random, one-long
and one-token documents within `TOLERANCE`, attention under it equals the dense reference, and a
packed run with it is the one-process run (loss and gradient norm, fp32, 5 steps) at cp 2 ring
(default), all-to-all, cp 4, tp/sp, pp, dp, a window and recompute (extended)."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from harness import cp_core_errors, run_on_ranks, worker_mesh

from meshtrain.config.run_config import build_config, validate
from meshtrain.errors import Code, SettingError
from meshtrain.parallel.layers.context_parallel import ring_sub_blocks
from meshtrain.parallel.layers.cp_balance import (
    TOLERANCE,
    head_tail,
    rank_work,
    work_balanced,
)
from meshtrain.parallel.layers.masks import AttentionMask
from meshtrain.training.trainer import Trainer

EOD = 256


def _exponential_documents(seq_len: int, mean: int, seed: int, rows: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(rows, seq_len, generator=g) < 1.0 / mean
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=-1)


def _kernel_counts(layout, documents) -> list[int]:
    """Score elements each rank's ring computes, from `ring_sub_blocks` itself."""
    mask, cp = AttentionMask(documents=documents), len(layout)
    ranks = layout.ranks
    return [sum((r.stop - r.start) * (c.stop - c.start)
                for step in range(cp)
                for r, c in ring_sub_blocks(ranks[q], ranks[(q - step) % cp], mask,
                                            layout.pieces))
            for q in range(cp)]


CASES = {"exponential": lambda s: _exponential_documents(s, 64, seed=1, rows=2),
         "one document": lambda s: torch.zeros(1, s, dtype=torch.long),
         "one-token documents": lambda s: torch.arange(s)[None]}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_the_balanced_layout_splits_the_ring_s_work_evenly(case, cp):
    documents = CASES[case](1024)
    layout = work_balanced(documents, cp)
    held = torch.cat(layout.ranks)
    assert sorted(held.tolist()) == list(range(1024))
    assert {len(r) for r in layout.ranks} == {1024 // cp}
    work = rank_work(layout, documents)
    assert work == _kernel_counts(layout, documents)
    assert max(work) <= TOLERANCE * min(work)
    if case == "exponential":  # head-tail is off by a third here
        spread = rank_work(head_tail(1024, cp), documents)
        assert max(spread) > 1.2 * min(spread) and layout.pieces > 2


def _balanced_attention(cp_mode: str, window) -> float:
    """This rank's share of the output and q/k/v gradients under a balanced layout, against
    the dense reference on one process."""
    mesh = worker_mesh(cp=2)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 4, 32, 8, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(3)]  # float64: the sums differ in order only
    documents = _exponential_documents(32, 6, seed=3, rows=2)
    layout = work_balanced(documents, 2)
    assert layout.pieces > 2
    mask = AttentionMask(window, documents, layout)
    positions = torch.arange(32)
    allowed = mask.allowed(positions, positions)
    scores = full[0] @ full[1].transpose(-2, -1) / math.sqrt(8)
    reference = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ full[2]
    reference.pow(2).sum().backward()
    mine = layout.ranks[mesh.cp.rank]
    return cp_core_errors(full, reference, mine, mesh, cp_mode, mask)


@pytest.mark.parametrize("cp_mode,window", [
    ("ring", None), pytest.param("ring", 5, marks=pytest.mark.extended),
    pytest.param("all2all", None, marks=pytest.mark.extended)])
def test_attention_over_a_balanced_layout_is_the_dense_one(cp_mode, window):
    assert max(run_on_ranks(2, _balanced_attention, cp_mode, window)) < 1e-12


def test_an_unknown_cp_balance_is_refused_in_one_line():
    cfg = build_config({}, {"data": {"cp_balance": "zigzag"}})
    with pytest.raises(SettingError, match="`cp_balance` must be one of work, head-tail, got"
                                           " zigzag") as error:
        validate(cfg, 1)
    assert error.value.code is Code.CHOICE


def _token_file(directory, kind: str) -> str:
    """Byte documents of random lengths, of one document longer than any sequence, or of
    one token each (the end-of-document id alone)."""
    g = np.random.default_rng(0)
    if kind == "one-token documents":
        tokens = [EOD] * 4000
    else:
        lengths = [4000] if kind == "one document" else g.integers(1, 30, 400)
        tokens = [t for n in lengths for t in [*g.integers(0, EOD, n - 1), EOD]]
    path = directory / f"{kind.replace(' ', '_')}.bin"
    np.asarray(tokens, dtype="<u2").tofile(path)
    path.with_name(path.name + ".json").write_text(json.dumps(
        {"dtype": "uint16", "vocab_size": EOD + 1, "eod_id": EOD, "tokenizer": "bytes"}))
    return str(path)


def _run(data: str, degrees: dict, parallel: dict, model: dict, balance: str) -> list:
    """(loss, gradient norm) of 5 fp32 steps of a packed run at this layout."""
    packed = {"document_mask": True, "reset_positions": True, "cp_balance": balance}
    cfg = build_config({}, {"model": {"model": "llama-tiny", "num_layers": 2} | model,
                            "train": {"steps": 5, "global_batch": 4, "micro_batch": 2,
                                      "seq_len": 32, "seed": 5, "eval_every": 0,
                                      "warmup_steps": 1},
                            "parallel": {"device": "cpu"} | parallel,
                            "data": {"data": data} | packed,
                            "checkpoint": {"out": "/nonexistent"}})
    cfg.plan = dataclasses.replace(cfg.plan, **degrees)
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    return [(row["loss"], row["grad_norm"]) for row in map(trainer.train_step, range(5))]


def _assert_same_run(data: str, degrees: dict, parallel: dict, model: dict) -> None:
    reference = run_on_ranks(1, _run, data, {"dp": 1}, {}, model, "work")[0]
    ranks = math.prod(n for axis, n in degrees.items() if axis != "cp_a2a")  # a part of cp
    got = run_on_ranks(ranks, _run, data, degrees, parallel, model, "work")[-1]
    for (loss, norm), (loss_1, norm_1) in zip(got, reference, strict=True):
        assert abs(loss - loss_1) / loss_1 < 1e-5 and abs(norm - norm_1) / norm_1 < 1e-5


def test_a_balanced_packed_run_is_the_one_process_run(tmp_path):
    _assert_same_run(_token_file(tmp_path, "random"), {"cp": 2, "dp": 1}, {"cp": 2}, {})


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["random", "one document", "one-token documents"])
@pytest.mark.parametrize("degrees,parallel,model", [
    ({"cp": 2, "dp": 1}, {"cp": 2, "cp_mode": "all2all"}, {}),
    ({"cp": 4, "dp": 1}, {"cp": 4}, {}),
    ({"cp": 2, "tp": 2, "dp": 1}, {"cp": 2, "tp": 2, "sequence_parallel": True}, {}),
    ({"cp": 2, "pp": 2, "dp": 1}, {"cp": 2, "pp": 2}, {}),
    ({"cp": 2, "dp": 2}, {"cp": 2}, {}),
    ({"cp": 2, "dp": 1}, {"cp": 2, "recompute": "full"}, {"model": "mistral-tiny",
                                                           "model_arg": ["sliding_window=6"]}),
    ({"cp": 4, "dp": 1, "cp_a2a": 2}, {"cp": 4, "cp_mode": "hybrid"}, {}),
], ids=["all2all", "cp4", "tp2-sp", "pp2", "dp2", "window-recompute", "hybrid-2x2"])
def test_a_balanced_packed_run_is_the_one_process_run_at_every_layout(tmp_path, kind, degrees,
                                                                      parallel, model):
    _assert_same_run(_token_file(tmp_path, kind), degrees, parallel, model)
