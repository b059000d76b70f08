"""Peak memory per device: the ZeRO paper's model states and the tested activation formula.

Per pipeline rank (the busiest is reported): parameters p, gradients g = 4 (fp32 accumulation)
and optimizer states K = 8 (Adam moments) + 4 (fp32 master weights, 16-bit runs only) bytes per
parameter (none on the device under `offload_optimizer`), divided over dp x cp by ZeRO (stage 1:
K; 2: g + K; 3: everything: `memory.zero_formula_bytes`), of the parameters a rank holds (1/tp
of a layer's, 1/q^2 under 2.5d's replication over depth: `Workload.weight_parts`); activations =
the family's per-layer bytes (1d; a 2d/2.5d/3d grid: the dense layer's / tp,
`Workload.layer_activation_bytes`) x the layers of each (micro-batch, chunk) the schedule keeps
in flight (the simulator's peak, a split backward's counted until its `W`: ZB-H1 and ZB-V hold p
stages' worth on every rank, 1F1B's on its first; what a pending `W` keeps, its linear layers'
inputs and output gradients, is taken as the activations it replaces), chunks where the schedule
places them (zb-v: rank 0 holds the embedding and the output layer);
buffers = fp32 logits and their gradient on the last stage, the gradient bucket being reduced,
ZeRO-3's two gathered layers, pipeline send/receive buffers and, under full recomputation, one
layer's recomputed activations.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshtrain.memory import zero_formula_bytes
from meshtrain.planner.pipeline_model import ChunkCost, PipelineRun
from meshtrain.planner.workload import GRAD_BYTES, Workload

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
    params = sum(chunks[g].parameters for g in own)
    e, n = work.element_bytes, lay.dp * lay.cp
    # offloaded (cpu, nvme): master and moments leave the device
    k = 0 if lay.offload_optimizer != "none" else 8 + (4 if e < 4 else 0)
    parts = [zero_formula_bytes(params, param_bytes=pb, grad_bytes=gb, state_bytes=sb, dp=n,
                                stage=lay.zero)
             for pb, gb, sb in ((e, 0, 0), (0, GRAD_BYTES, 0), (0, 0, k))]
    ranges = lay.stage_layers(work.model.num_layers)
    layers_per_chunk = sum(len(ranges[g]) for g in own) / len(own)
    activations = pipe.peak_in_flight[rank] * layers_per_chunk * work.layer_activation_bytes()
    last = len(ranges) - 1 in own
    buffers = 2 * work.logits_bytes() if last else 0.0
    buffers += BUCKET_BYTES * (2 if lay.zero in (1, 2) else 1) if n > 1 else 0.0
    if lay.zero == 3:
        buffers += 2 * max(c.parameters for c in chunks) / max(len(r) for r in ranges) * e
    if lay.pp > 1:
        buffers += 2 * work.boundary_bytes
    if lay.recompute == "full":
        full = replace(work, layout=replace(lay, recompute="none"))
        buffers += full.layer_activation_bytes()
    return MemoryBreakdown(*parts, activations, buffers)
