"""The cost model: predicted step time and memory of one layout of one model on one hardware.

Step time = compute + exposed communication + pipeline bubble (the three a user can act on), on
the rank whose step is longest. Per model chunk and micro-batch (`chunk_costs`): each matmul
costs FLOPs / (peak x efficiency(its size)), a fused attention core FLOPs / (peak x the
hardware's attention efficiency), elementwise work (the family's `pointwise_bytes`, eager or
compiled) bytes / memory bandwidth, each layer a fixed host overhead (x2 in backward), each
TP/CP/EP collective its alpha-beta time (`collectives.py`); backward is twice the forward (a fused
attention core's `attention_backward_ratio` x), plus what recomputation repeats. Every
tensor-parallel scheme prices its own communication (`TPScheme.layer_comm`, `embedding_comm`,
`output_comm`, on a `collectives.TPClock`): Megatron's 1d runs a column-parallel layer's
input-gradient all-reduce behind its weight-gradient matmul; 2d/2.5d/3d charge their formula
traffic whole, none of it hidden, on links as wide as the TP block. Other overlap is charged
where meshtrain achieves it: data-parallel buckets (ZeRO 1/2: reduce-scatters) behind the
last micro-batch's backward (ZeRO 2: every micro-batch's); ZeRO-3's prefetched gathers behind
the forward and backward they feed (`zero_impl` deepspeed: DeepSpeed's, none of that
prefetch, `_deepspeed_zero3`). 2.5d's depth all-reduce of weight gradients runs once
a step, exposed. The pipeline runs meshtrain's own schedule through the simulator
(`simulator.simulate`) on those per-chunk costs; the zero-bubble schedules split each backward
into `I` and `W`, `W` the weight-gradient matmuls (`pipeline_model.split_backward`), and lose the
overlap the fused backward gave the input-gradient all-reduces. Memory is `memory_model.py`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.models.family import TransformerConfig
from meshtrain.parallel.runtime.nvme_offload import STATE_BYTES
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner import collectives as coll
from meshtrain.planner.hardware import Hardware, model_tflops
from meshtrain.planner.memory_model import (
    MemoryBreakdown,
    expert_shard_ranks,
    peak_memory,
    zero_shard,
)
from meshtrain.planner.pipeline_model import ChunkCost, rank_chunks, run_pipeline
from meshtrain.planner.workload import (
    DEEPSPEED_REDUCE_BUCKET,
    GRAD_BYTES,
    MOE_IMBALANCE,
    Workload,
)

GIB = 2**30
OPTIMIZER_BYTES_PER_PARAMETER = 80
"""torch's foreach AdamW: ~10 unfused passes over parameter, gradient and moments (measured
77 B/parameter in fp32 on the CPU host). meshtrain now steps torch's fused AdamW
(`optim.ADAMW_KERNELS`), which `benchmarks/bench_optimizer.py` measured 5.8-6.8x faster on
this host at 68M-124M parameters (one pass: 28 bytes per fp32 parameter is its traffic), yet
the term stays: the built-in profiles' efficiencies were fitted with it against published
Megatron runs (which step a fused Adam too), and 28 without a refit moves their median error
from 6.8% to 7.4% (the V100 rows from within 3% to 5.6-11.1% over): lower it together with a
refit (`benchmarks/plan_vs_published.py --fit`)."""


@dataclass(frozen=True)
class Prediction:
    layout: ParallelPlan
    step_time_s: float
    """compute_s + exposed_comm_s + bubble_s."""
    compute_s: float
    """The busiest pipeline stage's forward, backward (and recompute) time over all
    micro-batches, plus the optimizer step."""
    exposed_comm_s: float
    """Communication not hidden behind compute."""
    bubble_s: float
    """Pipeline idle time of the busiest stage, from the schedule simulator."""
    tflops_per_gpu: float
    """Model TFLOP/s per device (`hardware.model_tflops`: the family's `flops_per_token`, no
    recomputation) at the predicted step time, as a run's metrics report them."""
    mfu: float
    """tflops_per_gpu / the hardware's peak in the run's precision."""
    memory: MemoryBreakdown

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB


def predict(model: TransformerConfig, layout: ParallelPlan, hardware: Hardware, *, seq_len: int,
            global_batch: int, precision: str = "bf16",
            moe_imbalance: float = MOE_IMBALANCE) -> Prediction:
    """Predict one training step of `model` laid out as `layout` (already valid: the search
    checks layouts with `ParallelPlan.validate` first) on `hardware`; `moe_imbalance`: max/mean
    rows per expert (`Workload.moe_imbalance`)."""
    work = Workload(model, layout, seq_len, global_batch, precision, moe_imbalance)
    chunks = chunk_costs(work, hardware)
    pipe = run_pipeline(chunks, layout, work.micro_batches, hardware.oversubscription)
    totals = []
    for rank in range(layout.pp):
        own = [chunks[g] for g in pipe.chunks_of(rank)]
        sync = data_parallel_exposed(work, hardware, own) + depth_gradient_sync(work, hardware,
                                                                                 own)
        optimizer = optimizer_time(work, hardware, own)
        totals.append((pipe.makespan + sync + optimizer, rank, sync, optimizer))
    step, rank, sync, optimizer = max(totals)
    scalars = _step_scalars(layout, hardware)
    step, sync = step + scalars, sync + scalars
    own = [chunks[g] for g in pipe.chunks_of(rank)]
    in_path = pipe.micro_batches * sum(c.forward_comm + c.backward_comm for c in own)
    busy = pipe.busy[rank]
    tflops = model_tflops(model.flops_per_token(seq_len), global_batch * seq_len / step,
                          layout.world_size)
    return Prediction(layout=layout, step_time_s=step, compute_s=busy - in_path + optimizer,
                      exposed_comm_s=in_path + sync, bubble_s=pipe.makespan - busy,
                      tflops_per_gpu=tflops, mfu=tflops / hardware.peak_for(precision),
                      memory=peak_memory(work, chunks, pipe))


def _step_scalars(lay: ParallelPlan, hw: Hardware) -> float:
    """Once a step: the loss averaged over dp x cp, the stop/save request over the world, the
    gradient norm over tp and pp (ZeRO: also dp x cp) - tiny, so all latency."""
    dp_cp, world = lay.dp * lay.cp, lay.world_size
    groups = [(dp_cp, lay.tp * dp_cp), (world, world), (lay.tp, lay.tp), (lay.pp, world)]
    if lay.zero:  # the norm's squares summed over the shard group
        groups.append((lay.zero_shard_ranks, lay.tp * lay.zero_shard_ranks))
    return sum(coll.all_reduce(hw, 4, g, span) for g, span in groups)


def _matmul(hardware: Hardware, flops: float, precision: str) -> float:
    gflop = flops / 1e9
    efficiency = hardware.matmul_efficiency * gflop / (gflop + hardware.matmul_half_gflop)
    return flops / (hardware.peak_for(precision) * 1e12 * efficiency)


def _elementwise(hardware: Hardware, nbytes: float) -> float:
    return nbytes / (hardware.hbm_gbytes_per_s * 1e9 * hardware.memory_efficiency)


def chunk_costs(work: Workload, hardware: Hardware) -> list[ChunkCost]:
    """Forward and backward cost of one micro-batch through each global model chunk, with
    the activation sent to the next chunk and the gradient to the previous one where that
    chunk is on another rank (zb-v's turn, inside rank pp - 1, is handed over in memory).
    Under a split backward (zb-h1, zb-v) the first chunk runs fused at its `W` (it sends no
    input gradient: the runtime's `I` does nothing there), so its whole backward is
    `weight_grad`."""
    lay = work.layout
    ranges = lay.stage_layers(work.model.num_layers)
    split = lay.schedule.split_backward
    owner = {g: r for r in range(lay.pp)
             for g in rank_chunks(lay.pp_schedule, lay.pp, lay.chunks_per_rank, r)}
    send = coll.send(hardware, work.boundary_bytes, 2 * lay.tp * lay.cp * lay.dp)
    after = [send if owner[g] != owner[g + 1] else 0.0 for g in range(len(ranges) - 1)] + [0.0]
    costs = []
    for g, layers in enumerate(ranges):
        parts = [_layer_cost(work, hardware, i, split=split and g > 0) for i in layers]
        if g == 0:
            parts.append(_embedding_cost(work, hardware))
        if g == len(ranges) - 1:
            parts.append(_head_cost(work, hardware))
        total = ChunkCost(*(sum(p[k] for p in parts) for k in range(len(ChunkCost._fields))))
        if split and g == 0:
            total = total._replace(weight_grad=total.backward,
                                   weight_grad_comm=total.backward_comm)
        costs.append(total._replace(
            forward_comm=total.forward_comm + after[g],
            backward_comm=total.backward_comm + (after[g - 1] if g > 0 else 0.0)))
    return costs


def _layer_cost(work: Workload, hw: Hardware, index: int, *, split: bool = False) -> ChunkCost:
    """One layer; its weight half (`weight_grad`): one matmul per weight matmul of the
    forward, and one layer's host overhead of the backward's two. `split`: the layer defers
    its weight gradients (the scheme's `layer_comm` says what that exposes)."""
    lay = work.layout
    w = work.layer(index)
    weights = [_matmul(hw, f, p)
               for f, p in zip(w.weight_matmuls, _matmul_precisions(work, index), strict=True)]
    core, ratio = _attention_core(work, hw, w.core_matmuls)
    forward = sum(weights) + core + _elementwise(hw, w.elementwise_bytes) + hw.layer_overhead_s
    backward = 2 * (forward - hw.layer_overhead_s - core) + ratio * core \
        + 2 * hw.layer_overhead_s
    tp_forward, tp_backward, tp_weight = lay.scheme.layer_comm(
        lay, work.model, work.local_tokens, work.element_bytes, coll.TPClock(hw, lay.tp),
        weights=weights, split=split)
    cp_forward, cp_backward = _context_parallel_comm(work, hw, core)
    ep_forward, ep_backward = _expert_comm(work, hw, index)
    xf, xb = _expert_tp_comm(work, hw, index, (tp_forward, tp_backward))
    forward_comm = tp_forward + cp_forward + ep_forward + xf
    backward_comm = tp_backward + cp_backward + ep_backward + xb
    if lay.recompute == "selective":
        backward += core
    elif lay.recompute == "full":
        backward += forward
        backward_comm += forward_comm
    return ChunkCost(forward, forward_comm, backward, backward_comm, w.parameters,
                     sum(weights) + hw.layer_overhead_s, tp_weight, w.expert_parameters)


def _matmul_precisions(work: Workload, index: int) -> tuple[str, ...]:
    """Each weight matmul's rate: an `fp8` layout's float8 ones (`parallel/layers/fp8.py`: the
    attention projections and a dense layer's MLP; never an MoE layer's experts, router or
    shared expert, the output layer or the attention core) at the FP8 peak, the rest in the
    run's precision. Same efficiency as 16 bits (assumed, not fitted)."""
    p = work.precision
    if work.layout.fp8 == "none":
        return (p,) * 4
    return ("fp8", "fp8") + ((p, p) if work.model.is_moe_layer(index) else ("fp8", "fp8"))


def _attention_core(work: Workload, hw: Hardware, flops: float) -> tuple[float, float]:
    """The attention core's forward time and its backward / forward ratio. A fused kernel in
    16 bits runs at the hardware's `attention_efficiency` where it has one (GPUs: flash
    attention), else as the two matmuls it computes; eager attention and the ring's
    hand-written blocks backpropagate through their two matmuls (ratio 2), a fused kernel at
    `attention_backward_ratio`."""
    if not work.fused_attention:
        return 2 * _matmul(hw, flops / 2, work.precision), 2.0
    if hw.attention_efficiency and work.element_bytes == 2:
        peak = hw.peak_for(work.precision) * 1e12
        return flops / (peak * hw.attention_efficiency), hw.attention_backward_ratio
    return 2 * _matmul(hw, flops / 2, work.precision), hw.attention_backward_ratio


def _context_parallel_comm(work: Workload, hw: Hardware, core: float) -> tuple[float, float]:
    """Ring attention (the layouts' context-parallel mode): cp - 1 K/V blocks pass each way
    behind the attention blocks; backward sends their gradients too, and returns them home.
    `cp_mode` hybrid: `_hybrid_comm`."""
    lay, m = work.layout, work.model
    c, span = lay.cp, lay.tp * lay.cp
    if c == 1:
        return 0.0, 0.0
    if lay.cp_mode == "hybrid":
        return _hybrid_comm(work, hw, core)
    block = 2 * work.local_tokens * m.kv_width(lay.tp) * work.element_bytes
    step = coll.send(hw, block, span)
    forward = (c - 1) * coll.behind(hw, step, core / c)
    return forward, (c - 1) * coll.behind(hw, 2 * step, 2 * core / c) + step


def _hybrid_comm(work: Workload, hw: Hardware, core: float) -> tuple[float, float]:
    """Hybrid context parallelism, each part on the links its axis crosses: 4 all-to-alls of
    a rank's queries' size each way (q, k, v and the output; k and v repeated to the query
    heads first) over cp_a2a ranks inside tp x cp_a2a consecutive ones, exposed (attention
    waits on them); then the ring over cp / cp_a2a ranks spread over tp x cp, its blocks
    (cp_a2a x the tokens, 1/cp_a2a of the heads: twice the queries' bytes) behind the core's
    steps as the ring's are."""
    lay, m = work.layout, work.model
    a, r = lay.cp_a2a, lay.cp // lay.cp_a2a
    queries = work.local_tokens * (m.num_heads // lay.tp) * m.head_dim * work.element_bytes
    exchanges = 4 * coll.all_to_all(hw, queries, a, lay.tp * a)
    if r == 1:
        return exchanges, exchanges
    step = coll.send(hw, 2 * queries, lay.tp * lay.cp)
    forward = (r - 1) * coll.behind(hw, step, core / r)
    backward = (r - 1) * coll.behind(hw, 2 * step, 2 * core / r) + step
    return exchanges + forward, exchanges + backward


def _expert_comm(work: Workload, hw: Hardware, index: int) -> tuple[float, float]:
    """An MoE layer under expert parallelism: its forward sends the kept (token, choice) rows
    to their experts' ranks and the results back (two all-to-alls, after a tiny one of the
    per-expert counts), its backward the same two in reverse; every choice priced as kept, the
    busiest rank's rows `expert_load` x the mean's."""
    lay, m = work.layout, work.model
    if lay.ep == 1 or not m.is_moe_layer(index):
        return 0.0, 0.0
    # whole experts (etp 1): each tp rank sends its s/tp tokens' rows to ep consecutive ranks
    whole = lay.tp if lay.whole_experts else 1
    span = lay.ep if lay.whole_experts else lay.tp * lay.cp * lay.ep
    rows = work.local_tokens / whole * m.moe_top_k * work.expert_load * m.hidden_size \
        * work.element_bytes
    exchange = coll.all_to_all(hw, rows, lay.ep, span)
    return 2 * exchange + coll.all_to_all(hw, 8 * m.moe_experts, lay.ep, span), 2 * exchange


def _expert_tp_comm(work: Workload, hw: Hardware, index: int,
                    scheme: tuple[float, float]) -> tuple[float, float]:
    """An MoE layer's tensor-parallel communication beyond what the scheme priced for its MLP
    (`scheme`: the layer's, half of it the MLP's; kept where a shared expert, split over tp
    like a dense MLP, still spends it). Experts split over tp (etp = tp) all-reduce their
    k x `expert_load` rows per token each way, and under sp the layer's tokens are gathered
    forward and their gradient backward; whole experts (etp 1) all-gather the layer's output
    forward and its input's gradient backward without sp, and spend nothing with sp (each
    rank dispatches the tokens it holds)."""
    lay, m = work.layout, work.model
    if lay.tp == 1 or not m.is_moe_layer(index):
        return 0.0, 0.0
    tokens = work.activation_bytes  # [b, s/cp, h]
    gather = coll.all_gather(hw, tokens, lay.tp, lay.tp)
    if lay.whole_experts:
        spent = 0.0 if lay.sequence_parallel else gather
    else:
        rows = tokens * m.moe_top_k * work.expert_load
        spent = coll.all_reduce(hw, rows, lay.tp, lay.tp) + \
            (gather if lay.sequence_parallel else 0.0)
    kept = 0.0 if m.moe_shared_ffn_size else 0.5
    return spent - kept * scheme[0], spent - kept * scheme[1]


def _embedding_cost(work: Workload, hw: Hardware) -> ChunkCost:
    """The scheme's lookup: what it writes and sends (`TPScheme.embedding_comm`)."""
    lay = work.layout
    written, comm = lay.scheme.embedding_comm(lay, work.model, work.local_tokens,
                                              work.element_bytes, coll.TPClock(hw, lay.tp))
    moved = _elementwise(hw, written)
    return ChunkCost(moved, comm, moved, 0.0, work.embedding_parameters(), moved)


def _head_cost(work: Workload, hw: Hardware) -> ChunkCost:
    """Final norm, the vocab-parallel output matmul and cross-entropy, with the scheme's
    communication (`TPScheme.output_comm`); an untied (or, in a pipeline, tied copy of the)
    embedding."""
    lay, m = work.layout, work.model
    matmul = _matmul(hw, work.head_matmul(), work.precision)
    hidden, comm = lay.scheme.output_comm(lay, m, work.local_tokens, work.element_bytes,
                                          coll.TPClock(hw, lay.tp))
    forward = matmul + _elementwise(hw, 3 * work.logits_bytes() + 2 * hidden)
    backward = 2 * matmul + _elementwise(hw, 2 * work.logits_bytes())
    held = 0.0 if m.tie_embeddings and lay.pp == 1 else work.embedding_parameters()
    return ChunkCost(forward, comm.forward, backward, comm.backward, held, matmul)


def data_parallel_exposed(work: Workload, hw: Hardware, own: list[ChunkCost]) -> float:
    """Gradient sync over dp x cp (ZeRO: reduce-scatter, then all-gather the updated
    parameters; stage 3 gathers each unit before its forward and backward instead; the routed
    experts' inside their edp groups, dp x cp / ep ranks, beside the dense ones'). Hybrid
    sharding (`dp_shard`): those inside the shard group, on the links its tp x cp x dp_shard
    consecutive ranks span, then the step's gradient shards all-reduced over the replicas,
    whose ranks span all of dp, exposed (the runtime reduces them once, after the backward)."""
    lay = work.layout
    if lay.dp * lay.cp == 1:
        return 0.0
    params = sum(c.parameters for c in own)
    g = lay.zero_shard_ranks if lay.zero else lay.dp * lay.cp
    replicas = lay.dp * lay.cp // g
    across = coll.all_reduce(hw, params * GRAD_BYTES / g, replicas, lay.tp * lay.cp * lay.dp) \
        if replicas > 1 else 0.0
    experts = sum(c.expert_parameters for c in own) if lay.zero else 0.0
    groups = [(params - experts, g, lay.tp * g)]
    if experts:  # (edp: every ep-th rank of dp x cp, spanning it all)
        groups.append((experts, expert_shard_ranks(lay), lay.tp * lay.dp * lay.cp))
    return across + _sharded_exposed(work, hw, own, groups)


def _sharded_exposed(work: Workload, hw: Hardware, own: list[ChunkCost],
                     groups: list[tuple[float, int, int]]) -> float:
    """The gradient sync of (parameters, inside a group of that many ranks, spanning that
    many) - ZeRO's shard group, or all of dp x cp; experts' edp - the groups' collectives
    back to back behind the same compute."""
    lay = work.layout

    def each(collective, per_parameter: float, parts: int = 1) -> float:
        return sum(parts * collective(hw, params * per_parameter / parts, g, span)
                   for params, g, span in groups)

    params = sum(p for p, _, _ in groups)
    forward = sum(c.forward for c in own)
    backward = sum(c.backward for c in own)
    last_bucket = min(1.0, 25 * 2**20 / max(params * GRAD_BYTES, 1.0))
    units = work.model.num_layers // lay.pp + 1  # ZeRO-3 gathers: each layer, then the rest
    if lay.zero == 3 and lay.zero_impl == "deepspeed":
        return work.micro_batches * sum(
            _deepspeed_zero3(work, hw, p, units, backward, (g, span)) for p, g, span in groups)
    if lay.zero == 3:  # one gather per unit before forward and backward
        gather = each(coll.all_gather, work.element_bytes, units)
        scatter = each(coll.reduce_scatter, GRAD_BYTES, units)
        per_micro = max(coll.behind(hw, gather, forward), gather / units) \
            + max(coll.behind(hw, gather + scatter, backward), scatter / units)
        return work.micro_batches * per_micro
    reduce = each(coll.all_reduce if lay.zero == 0 else coll.reduce_scatter, GRAD_BYTES)
    exposed = max(coll.behind(hw, reduce, backward), reduce * last_bucket)
    if lay.zero == 2:
        exposed *= work.micro_batches
    return exposed + (each(coll.all_gather, work.element_bytes) if lay.zero else 0.0)


def _deepspeed_zero3(work: Workload, hw: Hardware, params: float, units: int,
                     backward: float, group: tuple[int, int]) -> float:
    """One micro-batch of DeepSpeed's ZeRO-3 as its published runs show it: each unit's
    parameters gathered when it runs, forward and backward, the compute waiting (none of
    meshtrain's prefetch overlap); the gradients reduce-scattered in the precision's dtype
    in DEEPSPEED_REDUCE_BUCKET buckets behind the backward (`overlap_comm`, stage 3's
    default), each bucket a collective of its own. `group`: the shard group's size, span."""
    g, span = group
    gather = units * coll.all_gather(hw, params * work.element_bytes / units, g, span)
    buckets = max(1, math.ceil(params / DEEPSPEED_REDUCE_BUCKET))
    scatter = buckets * coll.reduce_scatter(hw, params * work.element_bytes / buckets, g, span)
    return 2 * gather + max(coll.behind(hw, scatter, backward), scatter / buckets)


def depth_gradient_sync(work: Workload, hw: Hardware, own: list[ChunkCost]) -> float:
    """The scheme's traffic once a step after the data-parallel reduction (2.5d: the weight
    gradients all-reduced over depth; ZeRO: this rank's shard of them), exposed."""
    lay = work.layout
    weights = zero_shard(lay, own) if lay.zero else sum(c.parameters for c in own)
    traffic = lay.scheme.step_traffic(lay.tp_grid, weights, GRAD_BYTES)
    if not traffic.total_bytes:
        return 0.0
    return coll.sequence(hw, steps=traffic.forward_steps + traffic.backward_steps,
                         moved=traffic.total_bytes, span=lay.tp)


def optimizer_time(work: Workload, hw: Hardware, own: list[ChunkCost]) -> float:
    """Adam over this rank's parameters (its shard under ZeRO), bound by memory bandwidth.
    Offloaded: the gradient shard goes to the host and the parameters come back over the
    host link, Adam runs at host memory bandwidth, and under nvme each state is read and
    written once, overlapping the update (the slower of the two counts)."""
    lay = work.layout
    shard = zero_shard(lay, own) if lay.zero else sum(c.parameters for c in own)
    if lay.offload_optimizer == "none":
        return _elementwise(hw, shard * OPTIMIZER_BYTES_PER_PARAMETER)
    link = shard * (GRAD_BYTES + work.element_bytes) / (hw.host_link_gbytes_per_s * 1e9)
    update = shard * OPTIMIZER_BYTES_PER_PARAMETER / (hw.host_memory_gbytes_per_s * 1e9)
    disk = 2 * shard * STATE_BYTES / (hw.disk_gbytes_per_s * 1e9) \
        if lay.offload_optimizer == "nvme" else 0.0
    return link + max(update, disk)
