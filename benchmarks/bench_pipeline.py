"""One GPT training step with pipeline parallelism on two ranks: meshtrain's flush schedules
(GPipe, 1F1B) against torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B and
ScheduleInterleaved1F1B with two stages per rank), against one process running the same
micro-batches one after another.

Every contender trains the same GPT-2 style model (same weights, same batch cut into the same
m micro-batches, plain AdamW) for the same steps, so their losses must agree; the tied word
embedding's two copies (first and last stage) get their gradients summed, as in meshtrain.
Repetitions alternate between contenders and ranked contenders run in one long-lived
two-process gloo group (one thread per rank), as in bench_tp.py; the single process (two
threads) runs in this process.

    python benchmarks/bench_pipeline.py            # 5 layers, hidden 512, s=256, V=8192, b=8, m=8
    python benchmarks/bench_pipeline.py --quick    # tiny sizes: a smoke run of every contender
    python benchmarks/bench_pipeline.py --only meshtrain-1f1b,single-2t

Five layers split 3 + 2: the last stage's LM head (V=8192) costs about one layer, so the two
stages are nearly equal. To see where meshtrain's time goes, trace the same shape with
`meshtrain train --pp 2 --trace DIR` (docs/benchmarks.md has the command).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_tp import (
    WORLD,
    Contender,
    DenseGPT,
    Result,
    Shape,
    Step,
    dense_weights,
    make_batch,
    measure,
    parse_args,
    report_loss_agreement,
    training_step,
)
from torch import nn

import meshtrain
from meshtrain.contracts import StageSpec
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.pipeline import run_schedule, stage_layers
from meshtrain.parallel.runtime.schedules import gpipe, interleaved, model_chunk, one_f_one_b

MICRO_BATCHES = 8
FULL = Shape(layers=5, hidden=512, heads=8, seq=256, vocab=8192, batch=8)
QUICK = Shape(layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=8)


def micro_batches(shape: Shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids, targets = make_batch(shape)
    return list(zip(ids.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES), strict=True))


class SingleProcess(Contender):
    """The same micro-batches one after another, with `threads` threads (2: the reference, the
    host's two cores; 1: what one pipeline rank gets, so half of it is a perfect pp=2 step)."""

    ranks = 1

    def __init__(self, threads: int):
        self.threads, self.reference = threads, threads == 2
        self.name = f"single process, {threads} thread{'s' if threads > 1 else ''}"
        self.key = f"single-{threads}t"

    def build(self, shape: Shape) -> Step:
        model = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
        batches = micro_batches(shape)

        def forward_backward() -> torch.Tensor:
            total = torch.zeros(())
            for ids, targets in batches:
                loss = model.loss(model(ids), targets) / len(batches)
                loss.backward()
                total += loss.detach()
            return total

        return training_step(model.parameters(), forward_backward)


class MeshtrainPipeline(Contender):
    ranks = WORLD

    def __init__(self, schedule: str):
        self.schedule = schedule
        self.name = f"meshtrain pp=2 {schedule}" + (" v=2" if schedule == "interleaved" else "")
        self.key = f"meshtrain-{schedule}"

    def build(self, shape: Shape) -> Step:
        mesh = meshtrain.init_parallel(pp=WORLD, device="cpu")
        s = mesh.pp.rank
        v = 2 if self.schedule == "interleaved" else 1  # chunks per rank
        chunks = stage_layers(shape.layers, WORLD * v)
        stage = StageSpec(tuple(chunks[model_chunk(s, c, WORLD)] for c in range(v)),
                          has_embedding=s == 0, has_head=s == WORLD - 1)
        model = meshtrain.build_model(shape.config(), mesh, seed=0, stage=stage)
        actions = interleaved(WORLD, MICRO_BATCHES, v)[s] if v > 1 else \
            {"gpipe": gpipe, "1f1b": one_f_one_b}[self.schedule](WORLD, MICRO_BATCHES)[s]
        batches = micro_batches(shape)
        activation = (shape.batch // MICRO_BATCHES, shape.seq, shape.hidden)
        word = model.embedding.word.weight

        def forward_backward() -> torch.Tensor:
            losses = run_schedule(actions,
                                  stage=lambda x, chunk, batch: (model(x, chunk=chunk), 0.0),
                                  loss_fn=lambda logits, batch: model.cross_entropy(logits,
                                                                                    batch[1]),
                                  micro_batches=batches, mesh=mesh,
                                  activation_shape=activation, dtype=torch.float32,
                                  num_chunks=v).losses
            comm.all_reduce(word.grad, mesh.axis("embed"))  # the tied embedding's two copies
            return _last_stage_loss(losses)

        return training_step(model.parameters(), forward_backward)


def _last_stage_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The step's loss (a sum of per-micro-batch means / m, held by the last stage) on every
    rank, as Trainer.train_step reports it."""
    loss = torch.stack(losses).sum() if losses else torch.zeros(())
    dist.all_reduce(loss)
    return loss


class Chunk(nn.Module):
    """Consecutive layers of DenseGPT, with the embedding (first chunk) or the head (last)."""

    def __init__(self, gpt: DenseGPT, layers: range, *, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[i] for i in layers)
        if last:  # tied to wte in DenseGPT; wte lives on another rank, so this is its copy
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class TorchPipelining(Contender):
    ranks = WORLD

    def __init__(self, schedule: str, stages_per_rank: int = 1):
        self.schedule, self.v = schedule, stages_per_rank
        self.name = f"torch {schedule}" + (f" v={self.v}" if self.v > 1 else "")
        self.key = f"torch-{schedule.lower()}"

    def build(self, shape: Shape) -> Step:
        from torch.distributed import pipelining

        rank, chunks = dist.get_rank(), WORLD * self.v
        gpt = DenseGPT(shape)
        gpt.load_meshtrain_(dense_weights(shape))
        layers = stage_layers(shape.layers, chunks)
        # Rank r holds chunks r, r + WORLD, ... (the interleaved layout; one chunk when v = 1).
        stages = [pipelining.PipelineStage(
            Chunk(gpt, layers[c], first=c == 0, last=c == chunks - 1), c, chunks,
            torch.device("cpu")) for c in range(rank, chunks, WORLD)]
        make = getattr(pipelining, self.schedule)
        schedule = make(stages if self.v > 1 else stages[0], n_microbatches=MICRO_BATCHES,
                        loss_fn=_cross_entropy)
        modules = [stage.submod for stage in stages]
        tied = gpt.wte.weight  # the first chunk's embedding or the last chunk's head
        params = list({id(p): p for m in modules for p in m.parameters()}.values())
        ids, targets = make_batch(shape)

        def forward_backward() -> torch.Tensor:
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(ids)
            else:
                schedule.step(target=targets, losses=losses)
            dist.all_reduce(tied.grad)  # the tied embedding's two copies
            return _last_stage_loss([loss.detach() / MICRO_BATCHES for loss in losses])

        return training_step(params, forward_backward)


CONTENDERS: list[Contender] = [
    MeshtrainPipeline("gpipe"), MeshtrainPipeline("1f1b"), MeshtrainPipeline("interleaved"),
    TorchPipelining("ScheduleGPipe"),
    TorchPipelining("Schedule1F1B"), TorchPipelining("ScheduleInterleaved1F1B", 2),
    SingleProcess(2), SingleProcess(1)]


def main(argv: list[str] | None = None) -> int:
    args, contenders = parse_args(argv, CONTENDERS, __doc__)
    shape = QUICK if args.quick else FULL
    load_before = os.getloadavg()[0]
    results, unavailable = measure(args, shape, contenders)
    assert not unavailable, unavailable
    report(args, shape, results, (load_before, os.getloadavg()[0]))
    return 0


def report(args, shape: Shape, results: list[Result], load: tuple[float, float]) -> None:
    p, m = WORLD, MICRO_BATCHES
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"model: {shape} in m={m} micro-batches of {shape.batch // m}, fp32, dropout 0;"
          " step = zero_grad + forward/backward of every micro-batch + AdamW")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1-minute load average"
          f" {load[0]:.2f} before and {load[1]:.2f} after the run (other work on the host);"
          f" ranked contenders: {p} gloo processes x 1 thread")
    print(f"schedule: {args.warmup} warmup steps, then {args.rounds} rounds x {args.steps} steps"
          " per contender, contenders alternating; time = median step (ranked: slowest rank)")
    print(f"bubble of a flush schedule on equal stages: (p-1)/(m+p-1) = {(p - 1) / (m + p - 1):.1%}"
          f" of the makespan, i.e. (m+p-1)/m = {(m + p - 1) / m:.3f} x one stage's work")
    reference = next((r for r in results if r.contender.reference), None)
    head = (f"{'contender':40} {'median ms':>10} {'round medians ms':>18} {'t/t_single':>10}"
            f" {'best/best':>9}  loss first -> last")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        round_medians = [statistics.median(ts) for ts in r.rounds]
        spread = f"{min(round_medians) * 1e3:.0f}-{max(round_medians) * 1e3:.0f}"
        ratio = r.median / reference.median if reference else float("nan")
        best = min(round_medians) / min(map(statistics.median, reference.rounds)) \
            if reference else float("nan")
        print(f"{r.contender.name:40} {r.median * 1e3:10.1f} {spread:>18} {ratio:10.2f}"
              f" {best:9.2f}  {r.losses[0]:.6f} -> {r.losses[-1]:.6f}")
    print("t/t_single: median step over the single process's (2 threads); best/best: the same"
          " with each contender's fastest round median, less sensitive to other jobs' load")
    report_loss_agreement(results, reference)


if __name__ == "__main__":
    sys.exit(main())
