"""Context parallelism on packed documents: head-tail against the work-balanced layout, in one run.

Documents come from a real prepared corpus (this interpreter's standard library sources, each file
a document, through `meshtrain prepare` with the byte tokenizer) and from long-tailed synthetic
lengths (log-normal, median 128 tokens, sigma 1.5). For each source and cp, SEQUENCES windows of
the token stream (as training samples them) are laid out both ways; per rank it prints, summed
over the windows: the visible query-key pairs (what the mask allows), the score elements the ring
computes (its sub-blocks, `rank_work`, which the tests hold equal to `ring_sub_blocks`' count)
and its own attention forward + backward time; then the slowest rank's step time, the max/min of
the computed elements and the fraction of them that is masked inside the computed sub-blocks.
The two layouts alternate (A B A B ...) on the same ranks; medians of the rounds. Then whole
training steps (llama-tiny, 2 layers, one sequence a step, `--document-mask`) of two trainers on
the long-tailed documents, one per `cp_balance`, alternating. The ranks are a RankPool of
tests/harness.py, one thread each.

    python benchmarks/bench_cp_balance.py                 # s 4096, cp 2 and 4
    python benchmarks/bench_cp_balance.py --quick         # s 1024, 1 round: a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from meshtrain.config.run_config import build_config
from meshtrain.data.prepare import prepare
from meshtrain.parallel.layers.context_parallel import ring_attention
from meshtrain.parallel.layers.cp_balance import head_tail, rank_work, work_balanced
from meshtrain.parallel.layers.masks import AttentionMask, document_ids
from meshtrain.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool, worker_mesh  # noqa: E402  (the one rank-spawning harness)

HEADS, HEAD_DIM, SEQUENCES, STDLIB_FILES = 4, 32, 4, 300


def stdlib_tokens() -> tuple[np.ndarray, int]:
    """The first STDLIB_FILES standard library sources prepared as one byte-token file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:STDLIB_FILES]
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "stdlib.bin"
        prepare([str(f) for f in files], out=out, progress=False)
        meta = json.loads(out.with_name("stdlib.bin.json").read_text())
        return np.fromfile(out, dtype=meta["dtype"]), meta["eod_id"]


def long_tailed_tokens(count: int) -> tuple[np.ndarray, int]:
    """Documents of log-normal lengths (median 128, sigma 1.5) as a token stream, eod 1."""
    g = np.random.default_rng(0)
    tokens: list[int] = []
    while len(tokens) < count:
        n = max(1, int(g.lognormal(np.log(128), 1.5)))
        tokens += [0] * (n - 1) + [1]
    return np.asarray(tokens[:count]), 1


def windows(tokens: np.ndarray, eod_id: int, seq_len: int) -> list[torch.Tensor]:
    """SEQUENCES evenly spaced windows' document ids `[1, s]`."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, SEQUENCES).astype(int)
    return [document_ids(torch.as_tensor(tokens[s:s + seq_len].astype(np.int64))[None], eod_id)
            for s in starts]


def _visible_pairs(layout, documents) -> list[int]:
    mask, every = AttentionMask(documents=documents), torch.arange(documents.shape[-1])
    return [int(mask.allowed(r, every).sum()) for r in layout.ranks]


def _time(seq_len: int, cp: int, rounds: int, layouts: dict) -> dict[str, list]:
    """Per layout name: per round (this rank's own time, the step time after a barrier)."""
    mesh = worker_mesh(cp=cp)
    torch.manual_seed(mesh.cp.rank)
    n = seq_len // mesh.cp.size
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM, requires_grad=True) for _ in range(3))
    times: dict[str, list] = {name: [] for name in layouts}
    for _ in range(rounds + 1):  # the first round warms up
        for name, pairs in layouts.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            for layout, documents in pairs:  # a fresh mask per window, as per forward
                ring_attention(q, k, v, mesh.cp, seq_len,
                               AttentionMask(documents=documents, layout=layout)).sum().backward()
            own = time.perf_counter() - start
            torch.distributed.barrier()
            times[name].append((own, time.perf_counter() - start))
    return {name: values[1:] for name, values in times.items()}


def report(source: str, docs: list[torch.Tensor], cp: int, seq_len: int, rounds: int) -> None:
    layouts = {"head-tail": [(head_tail(seq_len, cp), d) for d in docs],
               "work": [(work_balanced(d, cp), d) for d in docs]}
    with RankPool(cp) as pool:
        timed = pool.run(_time, seq_len, cp, rounds, layouts, timeout=3600.0)
    for name, pairs in layouts.items():
        computed = np.sum([rank_work(layout, d) for layout, d in pairs], axis=0)
        visible = np.sum([_visible_pairs(layout, d) for layout, d in pairs], axis=0)
        own = [statistics.median(t[0] for t in rank[name]) for rank in timed]
        step = statistics.median(max(rank[name][i][1] for rank in timed)
                                 for i in range(rounds))
        print(f"{source}, cp {cp}, {name}: visible pairs {_per_rank(visible)}; computed"
              f" {_per_rank(computed)} (max/min {computed.max() / computed.min():.3f}, masked"
              f" inside {1 - visible.sum() / computed.sum():.3f}); own time ms"
              f" {', '.join(f'{t * 1e3:.0f}' for t in own)}; step {step * 1e3:.0f} ms")


def _per_rank(values) -> str:
    return ", ".join(f"{v:,}" for v in values)


def long_tailed_file(folder: Path, count: int) -> str:
    """The long-tailed documents as a byte-token file (end-of-document 256) for training."""
    tokens, eod = long_tailed_tokens(count)
    ids = np.where(tokens == eod, 256, np.arange(len(tokens)) % 200).astype("<u2")
    path = folder / "long_tailed.bin"
    ids.tofile(path)
    path.with_name("long_tailed.bin.json").write_text(json.dumps(
        {"dtype": "uint16", "vocab_size": 257, "eod_id": 256, "tokenizer": "bytes"}))
    return str(path)


def _train_times(data: str, seq_len: int, cp: int, rounds: int) -> dict[str, list[float]]:
    """Per `cp_balance`: the step times of its trainer, the two alternating."""
    mesh = worker_mesh(cp=cp)
    trainers = {}
    for balance in ("head-tail", "work"):
        cfg = build_config({}, {"model": {"model": "llama-tiny", "num_layers": 2},
                                "train": {"steps": rounds + 1, "global_batch": 1,
                                          "micro_batch": 1, "seq_len": seq_len,
                                          "eval_every": 0, "warmup_steps": 1},
                                "parallel": {"device": "cpu", "cp": cp},
                                "data": {"data": data, "document_mask": True,
                                         "cp_balance": balance},
                                "checkpoint": {"out": "/nonexistent"}})
        cfg.plan = dataclasses.replace(cfg.plan, cp=cp)
        trainers[balance] = Trainer.build(cfg, mesh)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for step in range(rounds + 1):  # the first step warms up
        for name, trainer in trainers.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            trainer.train_step(step)
            torch.distributed.barrier()
            times[name].append(time.perf_counter() - start)
    return {name: values[1:] for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seq_len, rounds = (1024, 1) if args.quick else (args.seq_len, args.rounds)
    print(f"ring attention forward + backward over {SEQUENCES} windows of s {seq_len}, {HEADS}"
          f" heads x {HEAD_DIM}, median of {rounds} alternating rounds")
    sources = {"stdlib": windows(*stdlib_tokens(), seq_len),
               "long-tailed": windows(*long_tailed_tokens(SEQUENCES * seq_len * 4), seq_len)}
    cps = [int(c) for c in args.cp.split(",")]
    for cp in cps:
        for source, docs in sources.items():
            report(source, docs, cp, seq_len, rounds)
    with tempfile.TemporaryDirectory() as folder:
        data = long_tailed_file(Path(folder), 64 * seq_len)
        for cp in cps:
            with RankPool(cp) as pool:
                times = pool.run(_train_times, data, seq_len, cp, rounds, timeout=3600.0)[0]
            print(f"long-tailed, cp {cp}, training step: " + ", ".join(
                f"{name} {statistics.median(t) * 1e3:.0f} ms" for name, t in times.items()))


if __name__ == "__main__":
    main()
