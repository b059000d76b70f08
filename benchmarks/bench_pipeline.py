"""One GPT training step with pipeline parallelism on p ranks (`--pp`, 2 or 4): meshtrain's flush
schedules (GPipe, 1F1B, interleaved 1F1B) and zero-bubble schedules (ZB-H1, ZB-V) against
torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B with two
stages per rank; ScheduleInterleavedZeroBubble with one stage per rank, torch's ZB1P, which is
ZB-H1 there; ScheduleZBVZeroBubble with two stages per rank in a V), against one process
running the same micro-batches one after another.

Every contender trains the same GPT-2 style model (same weights, same batch cut into the same
m micro-batches, plain AdamW) for the same steps, so their losses must agree; the tied word
embedding's two copies (first and last rank) get their gradients summed, as in meshtrain (under
ZB-V rank 0 holds both ends: one copy, used by two chunks). Repetitions alternate between
contenders (every other round in reverse), each meshtrain schedule next to its torch twin, and
the report gives each pair's ratio round by round; ranked contenders run in one long-lived
p-process gloo group (one thread per rank), as in bench_tp.py; the single process (two
threads) runs in this process. Every
pipeline contender also records each compute action's start and end (meshtrain's executor:
`run_schedule(timeline=...)`; torch's: its stages' forward/backward/weight calls, the loss in
the last forward): the report gives every rank's measured idle fraction next to the
simulator's (`pipeline_trace.idle_report`) and the mean time of each kind of action.

    python benchmarks/bench_pipeline.py            # 5 layers, hidden 512, s=256, V=6784, b=8, m=8
    python benchmarks/bench_pipeline.py --pp 4     # the same with 11 layers on 4 ranks
    python benchmarks/bench_pipeline.py --quick    # tiny sizes: a smoke run of every contender
    python benchmarks/bench_pipeline.py --only meshtrain-zb-v,torch-zb-v,meshtrain-1f1b,single-2t

Layers per model chunk: of all splits, the one that balances the ranks best when the LM head
with its loss and the embedding count as the layers `end_layers` gives them; meshtrain and torch
get the same split for a schedule, and the report prints it (pp 2: 3 + 2 for one chunk per rank,
the head on the lighter stage). The vocabulary (`--vocab`, default 6784) makes the head and the
embedding together about one layer, so ZB-V's rank 0, which holds both ends, can balance the
others (at 8192, the earlier runs' size, they are 1.2 layers and no split of whole layers
balances the V). To see where meshtrain's time goes, trace the same shape with `meshtrain train
--pp 2 --trace DIR` (docs/benchmarks.md has the command).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_tp import (
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
from meshtrain.parallel.layers.weight_grads import defer_weight_gradients
from meshtrain.parallel.runtime.pipeline import run_schedule, stage_layers
from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    WEIGHT_GRAD,
    Placement,
    model_chunk,
    v_shape_chunk,
)
from meshtrain.parallel.schedules.catalog import SCHEDULES
from meshtrain.parallel.schedules.releases import send_releases
from meshtrain.parallel.schedules.schedule import PipelineSchedule
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.parallel.schedules.zero_bubble import estimated_costs
from meshtrain.training.pipeline_trace import idle_report

MICRO_BATCHES = 8
PP_CHOICES = (2, 4)
# (full, quick) per pp: at pp 4 every schedule with two chunks per rank needs 8 chunks of at
# least one layer, and 11 layers + the head balance 4 ranks (12.5 layer-units, 3.5 at most each)
VOCAB = 6784
SHAPES = {2: (Shape(layers=5, hidden=512, heads=8, seq=256, vocab=VOCAB, batch=8),
              Shape(layers=4, hidden=64, heads=4, seq=32, vocab=256, batch=8)),
          4: (Shape(layers=11, hidden=512, heads=8, seq=256, vocab=VOCAB, batch=8),
              Shape(layers=11, hidden=64, heads=4, seq=32, vocab=256, batch=8))}


def end_layers(vocab: int) -> tuple[float, float]:
    """The embedding and the LM head with its loss, in layers of forward + backward work, both
    in proportion to the vocabulary. At h=512, s=256, V=5632 meshtrain's ZB-V measured rank 0
    (2 layers and both ends) at 200 ms a micro-batch and rank 1 (3 layers) at 212: the ends
    are 0.83 layers there, 1.2 at V=8192, of which the head (one V x h matmul each way and the
    loss) is most and the embedding (a dense V x h gradient) the rest."""
    return 0.2 * vocab / 8192, 1.0 * vocab / 8192

COMPUTE = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


def micro_batches(shape: Shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids, targets = make_batch(shape)
    return list(zip(ids.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES), strict=True))


def layer_split(num_layers: int, p: int, v: int, placement: Placement,
                vocab: int) -> list[range]:
    """Layers of each global chunk (p x v of them, at least one layer each): the split whose
    busiest rank has the least work, counting the ends as `end_layers` (then the most even
    ranks; then earlier chunks the larger, as `stage_layers` gives the remainder)."""
    n = p * v
    embedding, head = end_layers(vocab)

    def rank_work(split: tuple[int, ...]) -> list[float]:
        work = [0.0] * p
        for r, c in itertools.product(range(p), range(v)):
            g = placement(r, c, p)
            work[r] += split[g] + (head if g == n - 1 else 0.0) + (embedding if g == 0 else 0.0)
        return work

    def key(split: tuple[int, ...]):
        work = rank_work(split)
        return max(work), sum(w * w for w in work), [-k for k in split]

    splits = (tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_layers), strict=True))
              for cuts in itertools.combinations(range(1, num_layers), n - 1))
    return stage_layers(num_layers, n, list(min(splits, key=key)))


def split_text(chunks: list[range], p: int, v: int, placement: Placement) -> str:
    """'rank 0: 1+1, rank 1: 2+1' (layers of each local chunk; + head where it is)."""
    last = p * v - 1
    return ", ".join(
        f"{r}: " + "+".join(f"{len(chunks[g])}{'h' if g == last else ''}"
                            for g in (placement(r, c, p) for c in range(v)))
        for r in range(p))


class SingleProcess(Contender):
    """The same micro-batches one after another, with `threads` threads (2: the reference, the
    host's two cores; 1: what one pipeline rank gets, so 1/p of it is a perfect pp step)."""

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


class PipelineContender(Contender):
    """A ranked contender on `p` pipeline ranks (main sets it from --pp), `v` model chunks per
    rank placed by `placement` (rank, local chunk, p) -> global chunk."""

    p = 2
    v = 1
    placement: Placement = staticmethod(model_chunk)

    @property
    def ranks(self) -> int:
        return self.p

    def chunks(self, shape: Shape) -> list[range]:
        return layer_split(shape.layers, self.p, self.v, self.placement, shape.vocab)

    def describe_split(self, shape: Shape) -> str:
        return split_text(self.chunks(shape), self.p, self.v, self.placement)


MESHTRAIN_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
"""The meshtrain schedules with a torch twin (interleaved at two chunks per rank, as torch's)."""


def chunks_per_rank(schedule: PipelineSchedule) -> int:
    """At any pp > 1 (the benchmark's 2 or 4): interleaved's two, as torch's, and zb-v's V."""
    return schedule.chunks_per_rank(2, 2 if schedule.takes_virtual_stages else 1)


class MeshtrainPipeline(PipelineContender):
    def __init__(self, schedule: str):
        self.schedule, self.kind = schedule, SCHEDULES[schedule]
        self.v, self.placement = chunks_per_rank(self.kind), self.kind.placement
        self.key = f"meshtrain-{schedule}"

    @property
    def name(self) -> str:
        return f"meshtrain pp={self.p} {self.schedule}" + (
            f" v={self.v}" if self.kind.takes_virtual_stages else "")

    def build(self, shape: Shape) -> Step:
        p, v, place = self.p, self.v, self.placement
        mesh = meshtrain.init_parallel(pp=p, device="cpu")
        s, last = mesh.pp.rank, p * v - 1
        chunks = self.chunks(shape)
        mine = [place(s, c, p) for c in range(v)]  # as parallelize.pipeline_stage places them
        stage = StageSpec(tuple(chunks[g] for g in mine), has_embedding=mine[0] == 0,
                          has_head=mine[-1] == last)
        model = meshtrain.build_model(shape.config(), mesh, seed=0, stage=stage)
        # as PipelineExecutor: zb-v's order chosen on estimated costs, the split backward only
        # under the zero-bubble schedules
        costs = estimated_costs(tuple(len(layers) for layers in chunks), *shape.config(
        ).pipeline_work_shares(shape.seq)) if self.kind.orders_on_costs else None
        lists = self.kind.action_lists(p, MICRO_BATCHES, v=v, chunk_costs=costs)
        actions, releases = lists[s], send_releases(lists, place)[s]
        weight_grads = defer_weight_gradients(model) if self.kind.split_backward else None
        params = list(model.parameters())
        batches = micro_batches(shape)
        activation = (shape.batch // MICRO_BATCHES, shape.seq, shape.hidden)
        # the tied embedding's copies on the first and the last rank; none to sum where one
        # rank holds both ends (ZB-V's rank 0), and none on the ranks in between
        tied = model.embedding.word.weight if model.embedding is not None \
            and not (stage.has_embedding and stage.has_head) else None
        timelines: list[list] = []  # one list of (kind, micro, chunk, start, end) per step

        def forward_backward() -> torch.Tensor:
            events: list = []
            losses = run_schedule(actions,
                                  stage=lambda x, chunk, batch: (model(x, chunk=chunk), 0.0),
                                  loss_fn=lambda logits, batch: model.cross_entropy(logits,
                                                                                    batch[1]),
                                  micro_batches=batches, mesh=mesh,
                                  activation_shape=activation, dtype=torch.float32,
                                  num_chunks=v, timeline=events, placement=place,
                                  weight_grads=weight_grads, params=params,
                                  releases=releases).losses
            timelines.append(events)
            if tied is not None:
                comm.all_reduce(tied.grad, mesh.axis("embed"))
            return _last_stage_loss(losses)

        step = training_step(params, forward_backward)
        step.trace = {"timelines": timelines}
        return step


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
        if last:  # tied to wte in DenseGPT: a copy of it where wte lives on another rank
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _mean_share(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One micro-batch's share of the step's mean loss (torch then scales no gradients)."""
    return _cross_entropy(logits, targets) / MICRO_BATCHES


@functools.cache
def _ends_group(p: int):
    """The first and the last rank (their copies of the tied embedding), made once per process;
    every rank builds the same contenders in the same order, so all of them create it alike."""
    return dist.new_group([0, p - 1])


# torch's schedule -> the meshtrain schedule it is measured against (and, where torch keeps a
# per-rank order, whose compute order it should have)
TWIN = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved",
        "ScheduleInterleavedZeroBubble": "zb-h1", "ScheduleZBVZeroBubble": "zb-v"}


class TorchPipelining(PipelineContender):
    def __init__(self, schedule: str, stages_per_rank: int = 1,
                 placement: Placement = model_chunk, key: str | None = None):
        self.schedule, self.v, self.placement = schedule, stages_per_rank, placement
        self.key = key or f"torch-{schedule.lower()}"

    @property
    def name(self) -> str:
        return f"torch {self.schedule}" + (f" v={self.v}" if self.v > 1 else "") + (
            " (1 stage/rank)" if self.schedule == "ScheduleInterleavedZeroBubble" else "")

    def build(self, shape: Shape) -> Step:
        from torch.distributed import pipelining

        p, v, place = self.p, self.v, self.placement
        rank, n = dist.get_rank(), p * v
        gpt = DenseGPT(shape)
        gpt.load_meshtrain_(dense_weights(shape))
        layers = self.chunks(shape)
        mine = [place(rank, c, p) for c in range(v)]  # rank r: r, r + p (looped) or 2p-1-r (V)
        first, last = 0 in mine, n - 1 in mine
        stages = [pipelining.PipelineStage(
            Chunk(gpt, layers[g], first=g == 0, last=g == n - 1), g, n, torch.device("cpu"))
            for g in mine]
        make = getattr(pipelining, self.schedule)
        multi = issubclass(make, pipelining.schedules.PipelineScheduleMulti)
        # Where one rank holds the first and the last stage (the V), both use the tied
        # embedding: torch's scaling of each stage's gradients by 1/m after its last backward
        # would divide that one twice, so the loss is divided instead, and then no rank may
        # scale (the loss's 1/m reaches every stage's gradients).
        divide_loss = any({0, n - 1} <= {place(r, c, p) for c in range(v)} for r in range(p))
        schedule = make(stages if multi else stages[0], n_microbatches=MICRO_BATCHES,
                        loss_fn=_mean_share if divide_loss else _cross_entropy,
                        scale_grads=not divide_loss)
        ends = _ends_group(p)
        tied = gpt.wte.weight if first != last else None  # this end's copy
        params = list({id(q): q for s in stages for q in s.submod.parameters()}.values())
        ids, targets = make_batch(shape)
        per_loss = 1 if divide_loss else MICRO_BATCHES
        timelines: list[list] = []  # as meshtrain's: (kind, micro, chunk, start, end) per step
        for chunk, stage in enumerate(stages):
            _time_actions(stage, chunk, timelines)
        _time_loss(schedule, timelines)

        def forward_backward() -> torch.Tensor:
            losses: list[torch.Tensor] = []
            timelines.append([])
            schedule.step(*[ids] if first else [],
                          **dict(target=targets, losses=losses) if last else {})
            if tied is not None:
                dist.all_reduce(tied.grad, group=ends)
            return _last_stage_loss([loss.detach() / per_loss for loss in losses])

        step = training_step(params, forward_backward)
        # every rank's compute actions, where they drive the run: a single-stage schedule
        # (GPipe, 1F1B) runs a loop of its own, and its `pipeline_order` only describes it (in
        # torch 2.13 1F1B's last rank is listed starting at micro-batch 1)
        order = schedule.pipeline_order if multi else None
        step.trace = {"timelines": timelines, "order": None if order is None else {
            r: [(a.computation_type.value, a.microbatch_index, a.stage_index)
                for a in acts if a is not None and a.computation_type.value in COMPUTE]
            for r, acts in order.items()}}
        return step


def _time_actions(stage, chunk: int, timelines: list[list]) -> None:
    """Record a torch `PipelineStage`'s compute actions into the step's timeline as meshtrain's
    executor does (F; B, or I when the schedule splits it; W), so torch's idle is measured the
    same way. Local chunk `chunk`: the stage's place among this rank's."""
    def timed(method, kind_of):
        def run(micro, *args, **kwargs):
            start = time.perf_counter()
            out = method(micro, *args, **kwargs)
            timelines[-1].append((kind_of(kwargs), micro, chunk, start, time.perf_counter()))
            return out
        return run

    stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda kw: FORWARD)
    stage.backward_one_chunk = timed(
        stage.backward_one_chunk,
        lambda kw: BACKWARD if kw.get("full_backward", True) else INPUT_GRAD)
    stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk,
                                            lambda kw: WEIGHT_GRAD)


def _time_loss(schedule, timelines: list[list]) -> None:
    """torch computes the last stage's loss after its forward, outside the stage: count it in
    that forward, as meshtrain's forward of the last chunk includes the loss."""
    compute = schedule._maybe_compute_loss

    def run(stage, *args, **kwargs):
        out = compute(stage, *args, **kwargs)
        if stage.is_last:
            kind, micro, chunk, start, _ = timelines[-1][-1]
            timelines[-1][-1] = (kind, micro, chunk, start, time.perf_counter())
        return out

    schedule._maybe_compute_loss = run


# each meshtrain schedule next to its torch twin, so the two run back to back in every round
CONTENDERS: list[Contender] = [
    MeshtrainPipeline("gpipe"), TorchPipelining("ScheduleGPipe"),
    MeshtrainPipeline("1f1b"), TorchPipelining("Schedule1F1B"),
    MeshtrainPipeline("interleaved"), TorchPipelining("ScheduleInterleaved1F1B", 2),
    MeshtrainPipeline("zb-h1"), TorchPipelining("ScheduleInterleavedZeroBubble", key="torch-zb-h1"),
    MeshtrainPipeline("zb-v"),
    TorchPipelining("ScheduleZBVZeroBubble", 2, v_shape_chunk, key="torch-zb-v"),
    SingleProcess(2), SingleProcess(1)]


def main(argv: list[str] | None = None) -> int:
    def pp_flags(parser) -> None:
        parser.add_argument("--pp", type=int, choices=PP_CHOICES, default=2,
                            help="pipeline ranks (default 2; 4 runs 4 processes on this host)")
        parser.add_argument("--vocab", type=int, default=VOCAB,
                            help=f"vocabulary (default {VOCAB}; 8192: the runs before 2026-11-27"
                                 " afternoon)")
        parser.add_argument("--chunks", action="store_true",
                            help="also print each chunk's mean F/B/I/W ms")

    args, contenders = parse_args(argv, CONTENDERS, __doc__, pp_flags)
    for c in contenders:
        if isinstance(c, PipelineContender):
            c.p = args.pp
    full, quick = SHAPES[args.pp]
    shape = quick if args.quick else dataclasses.replace(full, vocab=args.vocab)
    load_before = os.getloadavg()[0]
    results, unavailable = measure(args, shape, contenders, world=args.pp)
    assert not unavailable, unavailable
    report(args, shape, results, (load_before, os.getloadavg()[0]))
    return 0


def report(args, shape: Shape, results: list[Result], load: tuple[float, float]) -> None:
    p, m = args.pp, MICRO_BATCHES
    print(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    print(f"model: {shape} in m={m} micro-batches of {shape.batch // m}, fp32, dropout 0;"
          " step = zero_grad + forward/backward of every micro-batch + AdamW")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 1-minute load average"
          f" {load[0]:.2f} before and {load[1]:.2f} after the run (other work on the host);"
          f" ranked contenders: {p} gloo processes x 1 thread")
    print(f"schedule: {args.warmup} warmup steps, then {args.rounds} rounds x {args.steps} steps"
          " per contender, contenders alternating (every other round reversed);"
          " time = median step (ranked: slowest rank)")
    print(f"bubble on equal stages (simulated, F = I = W = 1, B = 2; communication free):"
          f" {equal_cost_bubbles(p, m)}")
    reference = next((r for r in results if r.contender.reference), None)
    head = (f"{'contender':50} {'median ms':>10} {'round medians ms':>18} {'t/t_single':>10}"
            f" {'best/best':>9}  loss first -> last")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        round_medians = [statistics.median(ts) for ts in r.rounds]
        spread = f"{min(round_medians) * 1e3:.0f}-{max(round_medians) * 1e3:.0f}"
        ratio = r.median / reference.median if reference else float("nan")
        best = min(round_medians) / min(map(statistics.median, reference.rounds)) \
            if reference else float("nan")
        print(f"{r.contender.name:50} {r.median * 1e3:10.1f} {spread:>18} {ratio:10.2f}"
              f" {best:9.2f}  {r.losses[0]:.6f} -> {r.losses[-1]:.6f}")
    print("t/t_single: median step over the single process's (2 threads); best/best: the same"
          " with each contender's fastest round median, less sensitive to other jobs' load")
    pipelines = [r for r in results if isinstance(r.contender, PipelineContender)]
    print("\nlayers per chunk, by rank (h: the head's chunk): " + "; ".join(
        sorted({f"{name}: {split}" for name, split in
                ((_placement_name(r.contender), r.contender.describe_split(shape))
                 for r in pipelines)})))
    report_pairs(results)
    report_idle(args, results)
    if args.chunks:
        report_chunk_costs(args, results)
    report_orders(results, p)
    report_loss_agreement(results, reference)


def report_pairs(results: list[Result]) -> None:
    """Per round, each meshtrain schedule's median step over its torch twin's, which ran right
    before or after it: the median of these ratios and their range. Load from other work that
    comes and goes over a round weighs on both sides of a pair alike, so this ratio moves less
    from run to run than the ratio of the whole run's medians."""
    by_key = {r.contender.key: r for r in results}
    pairs = [(by_key[f"meshtrain-{TWIN[r.contender.schedule]}"], r) for r in results
             if isinstance(r.contender, TorchPipelining)
             and f"meshtrain-{TWIN[r.contender.schedule]}" in by_key]
    if not pairs:
        return
    print("\nmeshtrain / torch, round by round (each pair ran back to back): median of the"
          " rounds' ratios of median steps, their range, rounds with meshtrain at or ahead")
    for ours, theirs in pairs:
        ratios = [statistics.median(a) / statistics.median(b)
                  for a, b in zip(ours.rounds, theirs.rounds, strict=True)]
        print(f"{ours.contender.schedule:12} {statistics.median(ratios):.3f}"
              f"  ({min(ratios):.3f}-{max(ratios):.3f}; at or ahead in"
              f" {sum(x <= 1 for x in ratios)} of {len(ratios)}; rounds:"
              f" {' '.join(f'{x:.3f}' for x in ratios)})")


def equal_cost_bubbles(p: int, m: int) -> str:
    """Each meshtrain schedule's mean idle fraction over ranks, simulated at equal costs."""
    parts = []
    for name in MESHTRAIN_SCHEDULES:
        schedule, v = SCHEDULES[name], chunks_per_rank(SCHEDULES[name])
        sim = simulate(schedule.action_lists(p, m, v=v), forward_cost=1.0, backward_cost=2.0,
                       v=v, placement=schedule.placement)
        parts.append(f"{name} {statistics.fmean(map(sim.idle_fraction, range(p))):.1%}")
    return ", ".join(parts)


def _placement_name(c: PipelineContender) -> str:
    return "V" if c.placement is v_shape_chunk else f"{c.v} per rank"


def idle_summary(r: Result, warmup: int) -> dict:
    """`pipeline_trace.idle_report` of each measured step of a traced contender, every figure
    the median over those steps: per rank the measured and simulated idle fraction and the mean
    ms of each kind of compute action; each global chunk's mean ms of each kind; the measured
    and simulated makespan."""
    c = r.contender
    steps = list(zip(*(rank["timelines"] for rank in r.trace), strict=True))[warmup:]
    reports = [idle_report([list(events) for events in step], c.placement) for step in steps]
    stages = [[rep["stages"][s] for rep in reports] for s in range(c.p)]
    per_rank = [{key: statistics.median(row[key] for row in rows) for key in rows[0]}
                for rows in stages]
    chunks = {kind: [statistics.median(rep["chunk_ms"][kind][g] for rep in reports)
                     for g in range(c.p * c.v)] for kind in reports[0]["chunk_ms"]}
    return {"ranks": per_rank, "steps": len(reports), "chunks": chunks,
            **{f"makespan_{k}": statistics.median(rep["makespan_ms"][k] for rep in reports)
               for k in ("measured", "simulated")}}


def report_idle(args, results: list[Result]) -> None:
    """Each contender's measured idle per rank (meshtrain's and torch's) next to the
    simulator's with each chunk's measured mean costs, and the mean time of each kind of
    compute action per rank."""
    traced = [r for r in results if r.trace and r.trace[0].get("timelines")]
    if not traced:
        return
    print(f"\nmeasured idle per rank (1 - compute / makespan, median over the"
          f" {args.rounds * args.steps} measured steps; torch's stages timed as meshtrain's"
          " executor times its actions, the loss in the last forward) vs the simulator with each"
          " chunk's measured mean F/B/I/W times (communication free); per rank the mean ms of F"
          " and of B, or of F and I + W (I, W)")
    width = max(14, 6 * args.pp)  # "12.3% " per rank
    head = (f"{'contender':50} {'idle measured':>{width}} {'idle simulated':>{width}}"
            f" {'makespan ms meas/sim':>21}  F/B or F/I+W (I, W) ms per rank")
    print(head + "\n" + "-" * len(head))
    mean_idle = {}
    for r in traced:
        summary = idle_summary(r, args.warmup)
        ranks = summary["ranks"]
        measured = [row["idle_measured"] for row in ranks]
        mean_idle[r.contender.schedule] = statistics.fmean(measured)
        kinds = [f"{_ms(row['forward_ms'])}/{_ms(row['backward_ms'])}"
                 if not row["input_grad_ms"] else
                 f"{_ms(row['forward_ms'])}/{_ms(row['input_grad_ms'] + row['weight_grad_ms'])}"
                 f" ({_ms(row['input_grad_ms'])}, {_ms(row['weight_grad_ms'])})"
                 for row in ranks]
        makespan = f"{summary['makespan_measured']:.0f}/{summary['makespan_simulated']:.0f}"
        print(f"{r.contender.name:50} {_percents(measured):>{width}}"
              f" {_percents([row['idle_simulated'] for row in ranks]):>{width}} {makespan:>21}"
              f"  {'; '.join(kinds)}")
    for one, zero_bubble in (("1f1b", "zb-h1"), ("1f1b", "zb-v"),
                             ("Schedule1F1B", "ScheduleInterleavedZeroBubble"),
                             ("Schedule1F1B", "ScheduleZBVZeroBubble")):
        if one in mean_idle and zero_bubble in mean_idle:
            print(f"{zero_bubble}: mean measured idle {mean_idle[zero_bubble]:.1%} ="
                  f" {mean_idle[zero_bubble] / mean_idle[one]:.2f} x {one}'s"
                  f" {mean_idle[one]:.1%}" + (" (goal: at most 1/3)" if zero_bubble == "zb-v"
                                               else ""))


def report_chunk_costs(args, results: list[Result]) -> None:
    """Each traced contender's mean ms of each kind of compute action per global chunk (median
    over the measured steps): where two runtimes' per-rank means agree, whether their chunks
    do."""
    print("\nmean ms per global chunk (F0: forward of chunk 0)")
    letters = {"forward": "F", "backward": "B", "input_grad": "I", "weight_grad": "W"}
    for r in (r for r in results if r.trace and r.trace[0].get("timelines")):
        chunks = idle_summary(r, args.warmup)["chunks"]
        print(f"{r.contender.name:50} " + " ".join(
            f"{letters[kind]}{g} {_ms(ms)}" for kind, per_chunk in chunks.items()
            for g, ms in enumerate(per_chunk) if ms))


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _percents(values: list[float]) -> str:
    return " ".join(f"{x:.1%}" for x in values)


def report_orders(results: list[Result], p: int) -> None:
    """Whether torch's schedules run each rank's computations in the order of meshtrain's
    counterpart (then the two differ only in how they run them)."""
    for r in results:
        order = r.trace[0].get("order") if r.trace else None
        twin = TWIN.get(getattr(r.contender, "schedule", ""))
        if order is None or twin is None:
            continue
        schedule = SCHEDULES[twin]  # zb-v: the handcrafted order (no costs)
        lists = schedule.action_lists(p, MICRO_BATCHES, v=chunks_per_rank(schedule))
        ours = {s: [(a.kind, a.micro, schedule.placement(s, a.chunk, p)) for a in actions
                    if a.kind in COMPUTE] for s, actions in enumerate(lists)}
        differ = [s for s in range(p) if [tuple(a) for a in order[s]] != ours[s]]
        verdict = "the same" if not differ else f"different on ranks {differ}"
        print(f"{r.contender.name}: per-rank compute order (F/I/W or F/B, micro-batch, global"
              f" chunk) {verdict} as meshtrain's {twin}"
              + (" handcrafted order (meshtrain runs it or a greedy one, whichever the"
                 " simulator finishes first on the estimated chunk costs)" if twin == "zb-v"
                 else ""))


if __name__ == "__main__":
    sys.exit(main())
