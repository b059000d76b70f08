"""One GPT training step under tensor and sequence parallelism, with and without overlapped
tensor-parallel communication (`--tp-overlap`), side by side in one run.

Both contenders train the same model (meshtrain's GPT at seed 0, the same batch on every TP rank,
plain AdamW, fp32) on `--tp` gloo ranks with sequence parallelism; they differ only in whether
the sequence-parallel linears run their all-gather and reduce-scatter as one collective around
one matmul or as ring steps behind per-chunk matmuls. A third contender runs the overlapped
layers with every ring step waited for as soon as it is started (the same point-to-point calls
and chunked matmuls, nothing overlapped): it separates what overlap gains from what gloo's
point-to-point ring costs against its own all-gather and reduce-scatter. Repetitions alternate
(A B C A B C ...) so load from other work on the host hits all alike (the machinery of
bench_tp.py). Gradients of the parameters every rank applies to its own tokens (norms, biases,
positions) are summed over TP, as a run's gradient sync does. Each contender's communication of
one step is counted (`CommRecorder`) and printed: overlap must not change it.

    python benchmarks/bench_tp_overlap.py              # hidden 512, 4 layers, s=256, V=8192, b=8
    python benchmarks/bench_tp_overlap.py --tp 4       # four ranks (on 2 cores: oversubscribed)
    python benchmarks/bench_tp_overlap.py --quick      # tiny sizes: a smoke run
    python benchmarks/bench_tp_overlap.py --only sp,overlap    # without the serial ring
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch
from bench_tp import (
    FULL,
    QUICK,
    Contender,
    Shape,
    Step,
    make_batch,
    matmul_peak,
    measure,
    parse_args,
    training_step,
)

import meshtrain
from meshtrain.parallel import CommRecorder
from meshtrain.parallel.communication import comm
from meshtrain.parallel.communication.comm import all_reduce
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schemes.registry import layer_factory
from meshtrain.parallelize import build_model

MODES = {"sp": "sp", "overlap": "sp tp-overlap", "ring": "sp tp-overlap, ring serial"}
"""Contender key -> its name after `meshtrain tp=N`."""


class _Waited:
    """A ring step already waited for."""

    def wait(self) -> bool:
        return True


@contextlib.contextmanager
def _serial_ring():
    """Every ring step waited for as soon as it is started: nothing overlaps it."""
    overlapped = comm.ring_exchange

    def serial(sends, recvs, axis):
        overlapped(sends, recvs, axis).wait()
        return _Waited()  # (a gloo work waited twice never returns)

    comm.ring_exchange = serial
    try:
        yield
    finally:
        comm.ring_exchange = overlapped


class MeshtrainSP(Contender):
    """meshtrain at tp `ranks` with sequence parallelism: `mode` a key of MODES."""

    def __init__(self, mode: str, tp: int):
        self.mode, self.ranks, self.key = mode, tp, mode
        self.name = f"meshtrain tp={tp} {MODES[mode]}"

    def build(self, shape: Shape) -> Step:
        mesh = meshtrain.init_parallel(tp=self.ranks, device="cpu")
        plan = ParallelPlan(tp=self.ranks, sequence_parallel=True,
                            tp_overlap=self.mode != "sp")
        model = build_model(shape.config(), mesh, plan, seed=0)
        partial = layer_factory(plan, mesh).partial_gradients(model, set())
        ids, targets = make_batch(shape)

        def forward_backward() -> torch.Tensor:
            loss = model.loss(model(ids), targets)
            loss.backward()
            for axis, params in partial:  # one flat all-reduce per axis, as a bucket would
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                all_reduce(flat, axis)
                for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                    p.grad.copy_(g.view_as(p))
            return loss.detach()

        step = training_step(model.parameters(), forward_backward)
        if self.mode == "ring":
            overlapped_step = step

            def step() -> torch.Tensor:
                with _serial_ring():
                    return overlapped_step()

        with CommRecorder() as rec:  # one untimed step: what a step sends
            step()
        counted = {}
        for r in rec.records:
            calls, nbytes = counted.get((r.op, r.axis), (0, 0))
            counted[r.op, r.axis] = (calls + 1, nbytes + r.payload_bytes)
        step.trace = counted  # (measure collects `step.trace` from every rank)
        return step


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2, choices=(2, 4),
                        help="tensor-parallel degree (ranks)")


def main(argv: list[str] | None = None) -> int:
    keys = [MeshtrainSP(mode, 2) for mode in MODES]
    args, chosen = parse_args(argv, keys, __doc__, _flags)
    contenders = [MeshtrainSP(c.mode, args.tp) for c in chosen]
    shape = QUICK if args.quick else FULL
    peak = matmul_peak(256 if args.quick else 2048, 1)  # before any rank competes for cores
    results, unavailable = measure(args, shape, contenders, world=args.tp)
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"model: {shape}, fp32, dropout 0; step = zero_grad + forward + backward + TP sum of"
          f" the sequence-parallel partial gradients + AdamW")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.tp} gloo processes x 1"
          f" thread; fp32 matmul peak 1 thread {peak / 1e9:.1f} GFLOP/s")
    print(f"schedule: {args.warmup} warmup steps, then {args.rounds} rounds x {args.steps} steps"
          f" per contender, contenders alternating; time = median step (slowest rank)")
    head = (f"{'contender':42} {'median ms':>10} {'round medians ms':>18} {'GFLOP/s':>8}"
            f"  loss first -> last")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        medians = [statistics.median(ts) for ts in r.rounds]
        spread = f"{min(medians) * 1e3:.0f}-{max(medians) * 1e3:.0f}"
        print(f"{r.contender.name:42} {r.median * 1e3:10.1f} {spread:>18}"
              f" {shape.flops() / r.median / 1e9:8.1f}  {r.losses[0]:.6f} -> {r.losses[-1]:.6f}")
    for name, why in unavailable.items():
        print(f"{name:42} not run: {why}")
    by_key = {r.contender.key: r for r in results}
    plain = by_key.get("sp")
    print()
    for key in ("overlap", "ring"):
        if plain is None or key not in by_key:
            continue
        other = by_key[key]
        ratio = other.median / plain.median
        print(f"step time {MODES[key]} / sp: {ratio:.3f}"
              f" ({'faster' if ratio < 1 else 'slower'} by {abs(1 - ratio) * 100:.1f}%)")
        pairs = zip(other.losses, plain.losses, strict=True)
        worst = max(abs(a - b) / abs(b) for a, b in pairs)
        print(f"  losses of every step {'equal bit for bit' if worst == 0 else 'differ'}"
              f" (max relative difference {worst:.1e}); counted communication per step"
              f" {'equal' if other.trace == plain.trace else 'DIFFERS'}")
    if "overlap" in by_key and "ring" in by_key:
        print(f"step time overlapped / serial ring: "
              f"{by_key['overlap'].median / by_key['ring'].median:.3f}")
    for r in results[:1]:
        counted = ", ".join(f"{op}/{axis} {calls} calls {nbytes / 2**20:.2f} MiB"
                            for (op, axis), (calls, nbytes) in sorted(r.trace[0].items()))
        print(f"counted per step (payload, as the recorder counts): {counted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
