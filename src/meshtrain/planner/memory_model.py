"""Peak memory per device: the ZeRO paper's model states and the tested activation formula.

Per pipeline rank (the busiest is reported): parameters p, gradients g = 4 (fp32 accumulation) and
optimizer states K = 8 (Adam moments) + 4 (fp32 master weights, 16-bit runs only) bytes per
parameter (none on the device under `offload_optimizer`; PipeDream-2BW: + 4 for the previous weight
version, + 4 more in fp32 for the weights the optimizer steps apart from the model's), divided over
dp x cp by ZeRO (stage 1: K; 2: g + K; 3: everything: `memory.zero_formula_bytes`; the routed
experts' over their own data-parallel ranks, dp x cp / ep, as the runtime's expert reducer shards
them: `zero_shard`), of the parameters a rank holds (1/tp of a layer's, 1/q^2 under 2.5d's
replication over depth: `Workload.weight_parts`; the first stage also GPT's position table); stages
2 and 3 hold no gradient shard at the peak of a one-micro-batch step (it is made after the
backward). The gradients are the data-parallel buckets themselves (each `.grad` is a view into
one), so a bucket costs nothing more.
Activations = the family's per-layer bytes (1d; a 2d/2.5d/3d grid: the dense layer's / tp; an
MoE layer's expert rows besides: `Workload.layers_activation_bytes`) of the layers of each
(micro-batch, chunk) the schedule keeps in flight (the simulator's peak, a split backward's
counted until its `W`: ZB-H1 and ZB-V hold p stages' worth on every rank, 1F1B's on its first;
what a pending `W` keeps, its linear layers' inputs and output gradients, is taken as the
activations it replaces), chunks where the schedule places them (zb-v: rank 0 holds the
embedding and the output layer). Buffers (`_buffers`): the larger of the loss's and the
backward's working sets, ZeRO-3's two gathered layers (and a tied embedding's gathered tables)
and the pipeline's boundary tensors (`held_boundaries`: outputs, received gradients and sends
not yet waited, bounded by pp and the schedule).
Measured against `train --peak-memory` on every layout of `benchmarks/plan_memory_vs_measured.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshtrain.memory import zero_formula_bytes
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.pipeline_model import ChunkCost, PipelineRun, held_boundaries
from meshtrain.planner.workload import DEEPSPEED_REDUCE_BUCKET, GRAD_BYTES, Workload

GIB = 2**30
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per device, by kind (the busiest pipeline rank)."""

    parameters: float
    gradients: float
    optimizer_states: float
    """Adam moments and fp32 master weights (ZeRO's K)."""
    activations: float
    """Saved for backward, at the schedule's peak of micro-batches in flight."""
    buffers: float
    """Logits, communication buckets, gathered ZeRO-3 layers, pipeline buffers."""

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer_states + self.activations
                + self.buffers)

    def gib(self) -> dict[str, float]:
        return {"parameters": self.parameters / GIB, "gradients": self.gradients / GIB,
                "optimizer_states": self.optimizer_states / GIB,
                "activations": self.activations / GIB, "buffers": self.buffers / GIB,
                "total": self.total / GIB}


def peak_memory(work: Workload, chunks: list[ChunkCost], pipe: PipelineRun) -> MemoryBreakdown:
    ranks = [_rank_memory(work, chunks, pipe, r) for r in range(pipe.pp)]
    return max(ranks, key=lambda m: m.total)


def _rank_memory(work: Workload, chunks: list[ChunkCost], pipe: PipelineRun,
                 rank: int) -> MemoryBreakdown:
    lay = work.layout
    own = pipe.chunks_of(rank)
    ranges = lay.stage_layers(work.model.num_layers)
    first, last = 0 in own, len(ranges) - 1 in own
    params = sum(chunks[g].parameters for g in own) + (work.position_parameters() if first
                                                       else 0.0)
    e, n = work.element_bytes, lay.zero_shard_ranks
    # offloaded (cpu, nvme): master and moments leave the device
    k = 0 if lay.offload_optimizer != "none" else 8 + (4 if e < 4 else 0)
    if lay.pp > 1:  # what the schedule keeps beyond the optimizer (2BW: weight versions)
        k += lay.schedule.state_bytes(e)
    # ZeRO 2/3 make the gradient shard at the step's first reduction: with one micro-batch
    # that is after the backward, where the peak is
    g = 0 if lay.zero >= 2 and work.micro_batches == 1 else GRAD_BYTES
    experts = sum(chunks[c].expert_parameters for c in own)
    parts = [zero_formula_bytes(params - experts, param_bytes=pb, grad_bytes=gb, state_bytes=sb,
                                dp=n, stage=lay.zero)
             + zero_formula_bytes(experts, param_bytes=pb, grad_bytes=gb, state_bytes=sb,
                                  dp=expert_shard_ranks(lay), stage=lay.zero)
             for pb, gb, sb in ((e, 0, 0), (0, g, 0), (0, 0, k))]
    in_flight = pipe.peak_in_flight[rank]  # (micro-batch, chunk) pairs: each chunk's mean
    activations = in_flight * sum(work.layers_activation_bytes(ranges[c]) for c in own) \
        / len(own)
    # the boundary tensors the runtime holds at once: forward outputs until their backward, a
    # received gradient until used, each send until the schedule proves it taken (bounded by
    # pp and the schedule, not by the micro-batches, but for GPipe's outputs)
    held = held_boundaries(pipe.schedule, pipe.pp, pipe.chunks_per_rank,
                           pipe.micro_batches)[rank]
    heads = in_flight / len(own) if last else 0.0  # micro-batches in the last chunk
    buffers = _buffers(work, params, first, heads) + held * work.boundary_bytes
    return MemoryBreakdown(*parts, activations, buffers)


def expert_shard_ranks(lay: ParallelPlan) -> int:
    """The ranks ZeRO shards routed experts over: those holding the same experts (edp; at
    `etp` 1 the ep group spans tp too)."""
    return lay.dp * lay.cp * (lay.tp if lay.whole_experts else 1) // lay.ep


def zero_shard(lay: ParallelPlan, own: list[ChunkCost]) -> float:
    """This rank's ZeRO shard of its chunks' parameters: the dense ones over the shard group,
    the routed experts over edp."""
    experts = sum(c.expert_parameters for c in own)
    dense = sum(c.parameters for c in own) - experts
    return dense / lay.zero_shard_ranks + experts / expert_shard_ranks(lay)


def _buffers(work: Workload, params: float, first: bool, heads: float) -> float:
    """What lives besides the model states, the layers' saved activations and pipeline sends:
    what the output layer saves for each of its `heads` micro-batches in flight (the final
    norm's input and output, the loss's fp32 log-softmax), and the larger of the step's two
    working sets: the loss's (the fp32 logits) and the backward's (the output layer's: the
    logits' gradient in the log-softmax's place; or a layer's, `_layer_backward`; with ZeRO
    2/3's fresh gradient buckets and, under full recomputation, one layer's recomputed
    activations); throughout, ZeRO-3's two gathered layers and, with tied embeddings, the
    gathered embedding tables, which the output layer's backward and the lookup's both need
    (measured live at the peak of a layer's backward)."""
    lay = work.layout
    saved = heads * (2 * work.boundary_bytes + work.logits_bytes())
    forward = saved + (work.logits_bytes() if heads else 0.0)
    backward = max(saved, _layer_backward(work)) + _fresh_gradients(work, params, first)
    if lay.recompute == "full":
        backward += replace(work, layout=replace(lay, recompute="none")
                            ).largest_layer_activation_bytes()
    buffers = max(forward, backward)
    if lay.zero == 3:
        buffers += 2 * _largest_layer(work) * work.element_bytes
        if work.model.tie_embeddings:
            tables = work.embedding_parameters() + work.position_parameters()
            buffers += tables * work.element_bytes
    return buffers


def _layer_backward(work: Workload) -> float:
    """A layer's backward working set: the gradient of its MLP's hidden activation, the output
    gradient it started from and a weight's gradient before it is added into the bucket."""
    m, e = work.model, work.element_bytes
    hidden = work.local_tokens * m.ffn_size / work.layout.tp * e
    return hidden + work.boundary_bytes + m.hidden_size * m.ffn_size / work.weight_parts * e


def _fresh_gradients(work: Workload, params: float, first: bool) -> float:
    """ZeRO 2/3 gather each micro-batch's gradients in a fresh full bucket until it is
    reduce-scattered: at the output layer's backward stage 2's first bucket (at most
    `BUCKET_BYTES`, of the last parameters) is filling; stage 3 (a bucket per unit) fills the
    embedding unit's (with an untied output layer) and the last layer's; DeepSpeed's
    (`zero_impl` deepspeed) fills `DEEPSPEED_REDUCE_BUCKET` elements in the parameters'
    dtype. Stages 0 and 1 accumulate into the gradients themselves."""
    lay = work.layout
    if lay.zero == 3 and lay.zero_impl == "deepspeed":
        return min(DEEPSPEED_REDUCE_BUCKET, params) * work.element_bytes
    if lay.zero == 2:
        return min(BUCKET_BYTES, params * GRAD_BYTES)
    if lay.zero != 3:
        return 0.0
    embedding = work.embedding_parameters() * (1 if work.model.tie_embeddings else 2) \
        + (work.position_parameters() if first else 0.0)
    return (embedding + _largest_layer(work)) * GRAD_BYTES


def _largest_layer(work: Workload) -> float:
    return max(work.layer(i).parameters for i in range(work.model.num_layers))
