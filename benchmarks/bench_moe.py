"""Training throughput of a dense GPT against an MoE GPT with the same active parameters per
token, in one process and on two ranks with expert parallelism.

The MoE model has the dense model's shape with every `every`-th MLP replaced by E top-1 experts
of the dense MLP's size (Switch), so each token passes through as many weights as in the dense
model, plus a router of E x h. Four contenders, all stepped by meshtrain's own
`Trainer.train_step` (forward/backward, gradient reducers, clipping, AdamW, metrics):

    dense, 1 process x 2 threads          (the reference)
    MoE,   1 process x 2 threads          (every expert on this process)
    dense, dp=2: 2 gloo ranks x 1 thread  (gradients all-reduced)
    MoE,   dp=2 ep=2: 2 gloo ranks        (E/2 experts per rank, tokens moved by all-to-all;
                                           only the non-expert gradients are all-reduced)

Every contender takes the same global batch per step as the same micro-batches of b/2
sequences (the single process accumulates two of them), so expert capacity, routing and losses
are comparable across layouts. Rounds alternate between contenders (A B C D A B C D ...) so that
load from other work on the host hits all of them alike; the two ranks live in one long-lived
process group (tests/harness.py's RankPool), so process start-up is never timed.

    python benchmarks/bench_moe.py              # L=4 h=256 s=128 V=256 b=8, E=8 on 2 of 4 MLPs
    python benchmarks/bench_moe.py --quick      # tiny sizes: a smoke run of every contender
    python benchmarks/bench_moe.py --layer      # one Qwen3-MoE-shaped layer against transformers'
                                                # (bench_moe_layer.py)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from meshtrain import ParallelMesh, init_parallel
from meshtrain.config.run_config import RunConfig, build_config, validate
from meshtrain.data.corpus import synthetic_corpus
from meshtrain.parallel import CommRecorder
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.expert import MoE
from meshtrain.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool  # noqa: E402  (the one rank-spawning harness, tests' and ours)

WORLD = 2
WARMUP = 2  # untimed steps per contender, in one round before the measured ones
CALL_TIMEOUT = 3600.0  # far above any call at full sizes; a hung collective fails sooner,
# at the process-group timeout of the ranks (tests/harness.py)
CORPUS_BYTES = 400_000
LOSS_RTOL = 1e-4


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int
    experts: int
    top_k: int = 1
    every: int = 2
    capacity_factor: float = 1.25

    def __str__(self) -> str:
        return (f"GPT L={self.layers} h={self.hidden} heads={self.heads} s={self.seq} V=256"
                f" (bytes) b={self.batch} (micro-batches of {self.batch // WORLD})")

    def moe_str(self) -> str:
        moe_layers = [i for i in range(self.layers) if (i + 1) % self.every == 0]
        return (f"MoE: E={self.experts} top-{self.top_k} experts of the dense MLP's size on"
                f" layers {moe_layers} (every {self.every}), capacity factor"
                f" {self.capacity_factor} per micro-batch and rank")


FULL = Shape(layers=4, hidden=256, heads=4, seq=128, batch=8, experts=8)
QUICK = Shape(layers=2, hidden=64, heads=4, seq=32, batch=4, experts=4)


@dataclass(frozen=True)
class Contender:
    name: str
    moe: bool
    ranks: int  # 1: in the parent process with 2 threads; WORLD: one thread per rank

    def config(self, shape: Shape, data_path: str, out: str) -> RunConfig:
        moe = {"moe_experts": shape.experts, "moe_top_k": shape.top_k, "moe_every": shape.every,
               "moe_capacity_factor": shape.capacity_factor} if self.moe else {}
        return build_config({}, {
            "model": {"model": "tiny", "num_layers": shape.layers, "hidden_size": shape.hidden,
                      "num_heads": shape.heads, **moe},
            "parallel": {"device": "cpu", "tp": 1, "dp": self.ranks,
                         "ep": self.ranks if self.moe else 1},
            # `steps` only shapes the lr schedule: the benchmark stops when it has timed enough.
            "train": {"steps": 100_000, "global_batch": shape.batch,
                      "micro_batch": shape.batch // WORLD, "seq_len": shape.seq,
                      "eval_every": 0},
            "data": {"data": data_path},
            "checkpoint": {"out": out}})


CONTENDERS = [Contender("dense, 1 process", moe=False, ranks=1),
              Contender("MoE, 1 process", moe=True, ranks=1),
              Contender("dense, dp=2", moe=False, ranks=WORLD),
              Contender("MoE, dp=2 ep=2", moe=True, ranks=WORLD)]


class Runner:
    """One contender built on this process: its Trainer and the index of its next step."""

    def __init__(self, contender: Contender, shape: Shape, data_path: str, out: str):
        cfg = contender.config(shape, data_path, out)
        plan = validate(cfg, contender.ranks)
        mesh = ParallelMesh.local() if contender.ranks == 1 else init_parallel(
            **plan.degrees, device="cpu")
        self.trainer = Trainer.build(cfg, mesh)
        self.next_step = 0
        # each MoE layer's routing of its latest forward (what the all-to-alls carried)
        self.last_routing = {}
        for moe in (m for m in self.trainer.model.modules() if isinstance(m, MoE)):
            moe.register_forward_hook(lambda m, args, _out: self.last_routing.__setitem__(
                m, args[1].routing[-1]))

    def step(self) -> dict:
        row = self.trainer.train_step(self.next_step)
        self.next_step += 1
        return row

    def probe(self) -> dict:
        """One untimed step under a CommRecorder: this rank's collective bytes, its parameters
        and the all-to-all bytes expected from that step's routing."""
        with CommRecorder() as rec:
            self.step()
        model = self.trainer.model
        experts = model.roles().experts
        return {"all_to_all": rec.payload_bytes("all_to_all"),
                "all_to_all_calls": rec.count("all_to_all"),
                "all_reduce": rec.payload_bytes("all_reduce"),
                "held": sum(p.numel() for p in model.parameters()),
                "expert_held": sum(p.numel() for p in model.parameters() if id(p) in experts),
                **analytic_all_to_all(self)}


def analytic_all_to_all(runner: Runner) -> dict:
    """All-to-all payload of the last step from its routing, per MoE layer and micro-batch:
    the E int64 counts, then forward the kept rows this rank sends and the rows its experts
    serve back, and backward the same two reversed: E x 8 + 2 x (sent + served) x h x 4 bytes.
    `cross_bytes` is the part that leaves the rank (the rest are rows a rank sends itself)."""
    trainer = runner.trainer
    mesh, model = trainer.mesh, trainer.model
    if mesh.ep.size == 1:
        return {"analytic": 0, "cross_bytes": 0, "sent": [], "served": []}
    t = trainer.cfg.train
    if t.global_batch != trainer.plan.micro_batch * mesh.dp.size:
        raise ValueError("the routing kept is the last micro-batch's: use one per rank and step")
    h = model.cfg.hidden_size
    total = cross = 0
    sent_rows, served_rows = [], []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        mine = runner.last_routing[moe]["tokens_per_expert"].clone()  # rows it sends, [E]
        everyone = mine.clone()
        comm.all_reduce(everyone, mesh.ep)  # kept rows sent to each expert by the whole group
        local = slice(moe.first_local, moe.first_local + moe.num_local)
        sent, served = int(mine.sum()), int(everyone[local].sum())
        sent_away = sent - int(mine[local].sum())
        served_others = served - int(mine[local].sum())
        total += moe.num_experts * 8 + 2 * (sent + served) * h * 4
        cross += (moe.num_experts - moe.num_local) * 8 + 2 * (sent_away + served_others) * h * 4
        sent_rows.append(sent)
        served_rows.append(served)
    return {"analytic": total, "cross_bytes": cross, "sent": sent_rows, "served": served_rows}


def time_steps(step: Callable[[], dict], n: int,
               sync: Callable[[], None] | None) -> tuple[list[float], list[dict]]:
    """Wall time of each of `n` steps (each started after `sync`) and their metrics."""
    times, rows = [], []
    for _ in range(n):
        if sync is not None:
            sync()
        start = time.perf_counter()
        rows.append(step())
        times.append(time.perf_counter() - start)
    return times, rows


_ranked_runners: list[Runner] = []  # in the rank processes only: the ranked contenders


def _build_ranked(shape: Shape, data_path: str, out: str, contenders: list[Contender]) -> None:
    """On every rank: build every ranked contender (in list order, so both ranks create the
    same process groups in the same order)."""
    _ranked_runners[:] = [Runner(c, shape, data_path, out) for c in contenders]


def _time_ranked(index: int, n: int) -> tuple[list[float], list[dict]]:
    """On every rank: `n` steps of ranked contender `index`, each started after a barrier."""
    return time_steps(_ranked_runners[index].step, n, dist.barrier)


def _probe_ranked(index: int) -> dict:
    """On every rank: ranked contender `index`'s probe step."""
    return _ranked_runners[index].probe()


@dataclass
class Result:
    contender: Contender
    rounds: list[list[float]] = field(default_factory=list)  # measured step times per round
    rows: list[dict] = field(default_factory=list)  # every step's metrics (rank 0), warmup too
    measured_rows: list[dict] = field(default_factory=list)
    probes: list[dict] = field(default_factory=list)  # one per rank

    @property
    def median(self) -> float:
        return statistics.median(t for r in self.rounds for t in r)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--layer", action="store_true",
                        help="one Qwen3-MoE-shaped layer against transformers' (bench_moe_layer)")
    args = parser.parse_args(argv)
    if args.layer:
        from bench_moe_layer import main as layer_main
        return layer_main(args.rounds, args.steps, quick=args.quick)
    for flag in ("steps", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    shape = QUICK if args.quick else FULL
    results = [Result(c) for c in CONTENDERS]
    ranked = [c for c in CONTENDERS if c.ranks == WORLD]

    with tempfile.TemporaryDirectory(prefix="bench_moe-") as tmp:
        data_path = str(Path(tmp, "corpus.txt"))
        Path(data_path).write_bytes(synthetic_corpus(CORPUS_BYTES).tobytes())
        with RankPool(WORLD) as pool:
            torch.set_num_threads(2)
            local = {c: Runner(c, shape, data_path, tmp) for c in CONTENDERS if c.ranks == 1}
            pool.run(_build_ranked, shape, data_path, tmp, ranked, timeout=CALL_TIMEOUT)

            def run(c: Contender, n: int) -> tuple[list[float], list[dict]]:
                if c.ranks == 1:
                    return time_steps(local[c].step, n, None)
                per_rank = pool.run(_time_ranked, ranked.index(c), n, timeout=CALL_TIMEOUT)
                times = [max(ts) for ts in zip(*(t for t, _ in per_rank), strict=True)]
                return times, per_rank[0][1]  # the step ends when every rank has finished

            for measured in [False] + [True] * args.rounds:
                for r in results:
                    times, rows = run(r.contender, args.steps if measured else WARMUP)
                    r.rows += rows
                    if measured:
                        r.rounds.append(times)
                        r.measured_rows += rows
            for r in results:  # after timing: the recorder and the checks stay out of it
                c = r.contender
                r.probes = [local[c].probe()] if c.ranks == 1 else \
                    pool.run(_probe_ranked, ranked.index(c), timeout=CALL_TIMEOUT)
    report(args, shape, results)
    return 0


def report(args, shape: Shape, results: list[Result]) -> None:
    reference = results[0]
    tokens_per_step = shape.batch * shape.seq
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"model: {shape}, fp32, dropout 0")
    print(shape.moe_str())
    print("step = Trainer.train_step: forward/backward per micro-batch, gradient reducers"
          " (dense: over dp; experts: over their edp replicas), clipping, AdamW, metrics")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; 1 process: 2 threads; dp=2: {WORLD}"
          f" gloo processes x 1 thread (b/{WORLD} per rank)")
    print(f"schedule: {WARMUP} warmup steps, then {args.rounds} rounds x {args.steps} steps per"
          " contender, contenders alternating; time = median step (2 ranks: slowest rank);"
          f" tokens/s = {tokens_per_step} tokens per step / median")
    print("loss = Trainer.train_step's, which for MoE includes aux_loss_coef x the Switch"
          " load-balancing loss of every MoE layer; drop % = dropped / assigned expert choices"
          " over the measured steps")

    head = (f"{'contender':18} {'median ms':>10} {'round medians ms':>17} {'t/t_dense1':>10}"
            f" {'tokens/s':>9} {'drop %':>7}  loss first -> last ({len(reference.rows)} steps)")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        round_medians = [statistics.median(ts) for ts in r.rounds]
        spread = f"{min(round_medians) * 1e3:.0f}-{max(round_medians) * 1e3:.0f}"
        drops = [row["moe_drop_rate"] for row in r.measured_rows if "moe_drop_rate" in row]
        drop = f"{100 * statistics.mean(drops):.1f}" if drops else "-"
        print(f"{r.contender.name:18} {r.median * 1e3:10.1f} {spread:>17}"
              f" {r.median / reference.median:10.2f} {tokens_per_step / r.median:9.0f}"
              f" {drop:>7}  {r.rows[0]['loss']:.6f} -> {r.rows[-1]['loss']:.6f}")

    print("\nparameters: total = the whole model (tied embedding once); active per token ="
          " word + position embeddings + attention + LayerNorms + dense MLPs + router + top-k"
          " experts of each MoE layer (all but the E - k experts a token skips); held = on one"
          " rank. Bytes: one step after timing, per rank, payload as CommRecorder counts it"
          " (all-reduce: gradients + metrics).")
    head = (f"{'contender':18} {'total':>10} {'active/token':>13} {'held/rank':>10}"
            f" {'all-to-all B/step':>18} {'calls':>6} {'all-reduce B/step':>18}")
    print(head + "\n" + "-" * len(head))
    for r in results:
        p = r.probes[0]
        ep = r.contender.ranks if r.contender.moe else 1
        expert_total = p["expert_held"] * ep
        dense = p["held"] - p["expert_held"]
        active = dense + expert_total * shape.top_k // shape.experts if r.contender.moe \
            else dense
        print(f"{r.contender.name:18} {dense + expert_total:10,} {active:13,} {p['held']:10,}"
              f" {p['all_to_all']:18,} {p['all_to_all_calls']:6} {p['all_reduce']:18,}")

    for r in results:
        if r.contender.moe and r.contender.ranks > 1:
            print(f"\n{r.contender.name}, all-to-all of the probe step: measured vs analytic"
                  " (per MoE layer and micro-batch: E x 8 counts + 2 x (sent + served) x h x 4"
                  " for forward + backward)")
            for rank, p in enumerate(r.probes):
                verdict = "equal" if p["all_to_all"] == p["analytic"] else "DIFFERENT"
                print(f"  rank {rank}: measured {p['all_to_all']:,} B, analytic"
                      f" {p['analytic']:,} B ({verdict}); rows sent per layer {p['sent']},"
                      f" served {p['served']}; {p['cross_bytes']:,} B of it leave the rank")

    print()
    for single, ranked in ((results[0], results[2]), (results[1], results[3])):
        last = single.rows[-1]["loss"]
        diff = abs(ranked.rows[-1]["loss"] - last) / abs(last)
        verdict = "agree" if diff <= LOSS_RTOL else "DISAGREE"
        print(f"last losses {verdict}: {ranked.contender.name} vs {single.contender.name}:"
              f" relative difference {diff:.1e} (tolerance {LOSS_RTOL:.0e})")


if __name__ == "__main__":
    sys.exit(main())
