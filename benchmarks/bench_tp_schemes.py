"""Tensor-parallel schemes side by side: 1D (Megatron) against 2D (SUMMA), 2.5D (Tesseract)
and 3D on the same model, same data and same global batch, against one process.

    python benchmarks/bench_tp_schemes.py --ranks 4    # 1d tp=4 vs 2d (q=2)
    python benchmarks/bench_tp_schemes.py --ranks 8    # 1d tp=8 vs 2.5d (q=2, d=2) vs 3d (q=2)
    python benchmarks/bench_tp_schemes.py --quick      # tiny sizes: a smoke run

Every contender is a meshtrain `Trainer` step (forward, backward, gradient sums, AdamW) of a
GPT on one long-lived gloo group of `--ranks` processes (one thread each), so process start-up
is never timed; the one-process reference (one thread) runs in this process while the ranks
wait. Repetitions alternate between contenders (A B C A B C ...) so that load on the host hits
all alike. Reported per contender: the median step time and its ratio to the single process,
the bytes each rank sends per step (CommRecorder's ring bytes, the mean over ranks), model-state
bytes per rank (parameters, gradients, optimizer states) and the bytes autograd saves for one
micro-batch's backward per rank, each also as a fraction of the single process's. The losses
of the first step must agree (fp32) - a contender that trains another model is not timed.
The ranks are a RankPool of tests/harness.py, the harness the tests run ranks with.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool  # noqa: E402  (the one rank-spawning harness, tests' and ours)

CALL_TIMEOUT = 3600.0  # far above any call at full sizes; a hung collective fails sooner,
# at the process-group timeout of the ranks (tests/harness.py)

SCHEMES = {4: [("1d", None), ("2d", None)], 8: [("1d", None), ("2.5d", 2), ("3d", None)]}
LOSS_RTOL = 1e-4


def _config(args, corpus: str, out: str, *, tp: int = 1, scheme: str = "1d",
            depth: int | None = None):
    from meshtrain.config.run_config import build_config

    return build_config({}, {
        "model": {"model": "tiny", "num_layers": args.layers, "hidden_size": args.hidden,
                  "num_heads": args.heads, "max_seq_len": args.seq},
        "train": {"steps": 1000, "global_batch": args.micro_batch, "micro_batch": args.micro_batch,
                  "seq_len": args.seq, "seed": 0, "eval_every": 0},
        "parallel": {"device": "cpu", "tp": tp, "tp_scheme": scheme, "tp_depth": depth},
        "data": {"data": corpus}, "checkpoint": {"out": out}})


def _measure(trainer, step: int) -> dict:
    """One timed training step, then the bytes it sent and the memory it holds."""
    from meshtrain.memory import saved_activation_bytes
    from meshtrain.parallel.communication.comm import CommRecorder

    start = time.perf_counter()
    with CommRecorder() as recorder:
        row = trainer.train_step(step)
    seconds = time.perf_counter() - start
    inputs, targets = trainer.train_data.micro_batches(step, dp_rank=0, dp_size=1)[0]
    model = trainer.model
    saved, _ = saved_activation_bytes(lambda: model.loss(model(inputs), targets),
                                      model.parameters())
    states = trainer.sync.memory_report()
    return {"seconds": seconds, "loss": row["loss"], "sent": recorder.ring_bytes(),
            "states": sum(states.values()), "activations": saved}


_rank_state: dict = {}  # in the rank processes only: "trainers" by scheme, their "out" folder


def _build_schemes(args, corpus: str) -> None:
    """On every rank: a Trainer per scheme of this world size, over one tp group each."""
    from meshtrain.parallel.runtime.process_groups import init_parallel
    from meshtrain.training.trainer import Trainer

    world = args.ranks
    out = _rank_state["out"] = tempfile.TemporaryDirectory()  # removed when the rank exits
    trainers = _rank_state["trainers"] = {}
    for scheme, depth in SCHEMES[world]:
        cfg = _config(args, corpus, out.name, tp=world, scheme=scheme, depth=depth)
        mesh = init_parallel(tp=world, tp_scheme=scheme, tp_depth=depth, device="cpu")
        trainers[scheme] = Trainer.build(cfg, mesh)


def _measure_scheme(scheme: str, step: int) -> dict:
    """On every rank: `_measure` of this scheme's trainer."""
    return _measure(_rank_state["trainers"][scheme], step)


def _single(args, corpus: str):
    from meshtrain.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        return Trainer.build(_config(args, corpus, out), ParallelMesh.local())


def _summary(name: str, rows: list[dict], single: dict) -> str:
    seconds = statistics.median(r["seconds"] for r in rows)
    return (f"| {name} | {seconds * 1000:.0f} | {single['seconds'] / seconds:.2f} |"
            f" {rows[0]['sent'] / 2**20:.2f} | {rows[0]['states'] / 2**20:.2f}"
            f" ({rows[0]['states'] / single['states']:.3f}) |"
            f" {rows[0]['activations'] / 2**20:.2f}"
            f" ({rows[0]['activations'] / single['activations']:.3f}) |")


def _mean_over_ranks(rows: list[dict]) -> dict:
    return {key: max(r[key] for r in rows) if key == "seconds" else
            statistics.mean(r[key] for r in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, choices=sorted(SCHEMES), default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden, args.heads, args.seq, args.repeats = 1, 32, 4, 16, 2
    from meshtrain.data.corpus import synthetic_corpus

    with tempfile.TemporaryDirectory() as data_dir:
        corpus = str(Path(data_dir) / "corpus.txt")
        Path(corpus).write_bytes(synthetic_corpus(200_000, seed=0).tobytes())
        run(args, corpus)


def run(args, corpus: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = args.ranks
    with RankPool(world) as pool:
        torch.set_num_threads(1)
        single_trainer = _single(args, corpus)
        pool.run(_build_schemes, args, corpus, timeout=CALL_TIMEOUT)
        schemes = [s for s, _ in SCHEMES[world]]
        rows: dict[str, list[dict]] = {name: [] for name in ["single", *schemes]}
        for step in range(args.repeats + 1):  # step 0 warms up and checks the losses
            rows["single"].append(_measure(single_trainer, step))
            for scheme in schemes:
                rows[scheme].append(_mean_over_ranks(
                    pool.run(_measure_scheme, scheme, step, timeout=CALL_TIMEOUT)))
    _report(args, world, rows)


def _report(args, world: int, rows: dict[str, list[dict]]) -> None:
    reference = rows["single"][0]["loss"]
    for name, measured in rows.items():
        loss = measured[0]["loss"]
        if abs(loss - reference) > LOSS_RTOL * abs(reference):
            sys.exit(f"{name}: first-step loss {loss} differs from one process's {reference}")
    single = {k: statistics.median(r[k] for r in rows["single"][1:]) for k in ("seconds",)}
    single |= {k: rows["single"][1][k] for k in ("states", "activations")}
    print(f"GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq},"
          f" micro-batch {args.micro_batch}; {world} gloo ranks on {os.cpu_count()} cores,"
          f" {args.repeats} alternating repeats (medians)")
    print("| layout | step ms | speed vs 1 process | MiB sent per rank | model states MiB per"
          " rank (x 1 process) | saved activations MiB per rank (x 1 process) |")
    print("|---|---|---|---|---|---|")
    names = {"single": "1 process", "1d": f"1d tp={world}", "2d": "2d q=2",
             "2.5d": "2.5d q=2 d=2", "3d": "3d q=2"}
    for name, measured in rows.items():
        print(_summary(names[name], measured[1:], single))


if __name__ == "__main__":
    main()
