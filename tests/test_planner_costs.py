"""The planner's cost model: FLOP accounting against the family's formula, the bubble against
the closed formulas, the capped simulation against the full one, memory against ZeRO's formula."""

import dataclasses

import pytest

from meshtrain.memory import zero_formula_bytes
from meshtrain.models import preset
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schedules.catalog import pipeline_schedule
from meshtrain.parallel.schedules.interleaved import interleaved
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.planner.costs import _head_cost, _layer_cost, _matmul, chunk_costs, predict
from meshtrain.planner.hardware import BUILT_IN, Hardware
from meshtrain.planner.pipeline_model import ChunkCost, held_boundaries, run_pipeline
from meshtrain.planner.search import search
from meshtrain.planner.workload import Workload

IDEAL = Hardware(name="ideal", peak_tflops=100.0, hbm_gib=80, gpus_per_node=8,
                 intra_node_gbytes_per_s=1e12, inter_node_gbytes_per_s=1e12,
                 fp32_peak_tflops=50.0, hbm_gbytes_per_s=1e15, matmul_efficiency=1.0,
                 matmul_half_gflop=0.0, memory_efficiency=1.0, network_efficiency=1.0,
                 collective_latency_s=0.0)
"""Matmuls at peak, free memory traffic and communication: time is FLOPs / peak."""

GPT = dataclasses.replace(preset("gpt2"), num_layers=8, max_seq_len=1024)


def test_compute_is_the_family_flops_with_the_causal_half_skipped():
    s, batch = 1024, 8
    p = predict(GPT, ParallelPlan(dp=1, micro_batch=2), IDEAL, seq_len=s, global_batch=batch)
    m = GPT
    core = 12 * m.num_layers * s * m.hidden_size  # per token, counted whole by the family
    flops = (m.flops_per_token(s) - core / 2) * batch * s
    assert p.compute_s == pytest.approx(flops / 100e12, rel=1e-9)
    assert p.exposed_comm_s == 0 and p.bubble_s == 0
    assert p.step_time_s == pytest.approx(p.compute_s + p.exposed_comm_s + p.bubble_s)


def test_recompute_adds_the_forward_it_repeats():
    s, batch = 1024, 8
    base = predict(GPT, ParallelPlan(dp=1, micro_batch=2), IDEAL, seq_len=s, global_batch=batch)
    full = predict(GPT, ParallelPlan(dp=1, micro_batch=2, recompute="full"), IDEAL, seq_len=s,
                   global_batch=batch)
    head = 2 * s * batch * GPT.hidden_size * GPT.vocab_size / 100e12  # not recomputed
    assert full.compute_s == pytest.approx(base.compute_s + (base.compute_s - 3 * head) / 3)
    assert full.tflops_per_gpu < base.tflops_per_gpu  # model FLOPs exclude recomputation


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                        ("interleaved", 4)])
def test_simulated_bubble_matches_the_closed_formula_on_even_stages(schedule, v):
    p, m, f, b = 4, 8, 1.0, 2.0
    chunks = [ChunkCost(f / v, 0.0, b / v, 0.0, 1.0)] * (p * v)
    run = run_pipeline(chunks, ParallelPlan(dp=1, pp=p, virtual_stages=v, pp_schedule=schedule), m)
    bubble = (p - 1) * (f + b) / v  # Narayanan et al. 2021: (p - 1)/v of a stage's work
    assert run.makespan == pytest.approx(m * (f + b) + bubble)


@pytest.mark.parametrize("oversubscription", [1.0, 2.0])
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_capped_simulation_equals_the_full_one_on_uneven_stages(schedule, v, oversubscription):
    p, m = 3, 60  # cap is p x max(8, 2v + 2) = 24 < m
    chunks = [ChunkCost(1.0 + 0.3 * g, 0.1, 2.0 + 0.5 * g, 0.0, 1.0) for g in range(p * v)]
    run = run_pipeline(chunks, ParallelPlan(dp=1, pp=p, virtual_stages=v, pp_schedule=schedule), m,
                       oversubscription)
    lists = pipeline_schedule(schedule).action_lists(p, m, v=v)
    full = simulate(lists, forward_cost=[c.forward + c.forward_comm for c in chunks],
                    backward_cost=[c.backward for c in chunks], v=v,
                    oversubscription=oversubscription)
    assert run.makespan == pytest.approx(full.makespan)
    assert run.busy == pytest.approx(full.busy)


def test_per_chunk_costs_equal_the_scalar_form_when_even():
    lists = interleaved(2, 4, 2)
    scalar = simulate(lists, forward_cost=1.0, backward_cost=2.0, v=2)
    listed = simulate(lists, forward_cost=[0.5] * 4, backward_cost=[1.0] * 4, v=2)
    assert listed.makespan == scalar.makespan and listed.busy == scalar.busy


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_follow_the_zero_formula(zero):
    """Two micro-batches a step: ZeRO 2/3's gradient shard, made at the first one's reduction,
    is held through the second's forward; with one micro-batch it is made after the backward,
    past the peak."""
    lay = ParallelPlan(dp=8, micro_batch=1, zero=zero)
    hw = BUILT_IN["a100-80g-selene"]
    p = predict(GPT, lay, hw, seq_len=1024, global_batch=16)
    psi = GPT.num_parameters()
    states = p.memory.parameters + p.memory.gradients + p.memory.optimizer_states
    expected = zero_formula_bytes(psi, param_bytes=2, grad_bytes=4, state_bytes=12, dp=8,
                                  stage=zero)
    assert states == pytest.approx(expected, rel=0.01)  # norms and biases: counted per layer
    one = predict(GPT, lay, hw, seq_len=1024, global_batch=8).memory
    assert one.gradients == (0.0 if zero >= 2 else p.memory.gradients)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_shards_experts_over_their_own_data_parallel_ranks(zero):
    """dp 8 x ep 4: each rank holds 2 of the 8 experts of every MoE layer, as do the edp =
    8 / 4 = 2 ranks it shards them with (the runtime's expert reducer), the rest over all 8."""
    moe = dataclasses.replace(GPT, moe_experts=8)
    lay = ParallelPlan(dp=8, ep=4, micro_batch=1, zero=zero)
    hw = BUILT_IN["a100-80g-selene"]
    p = predict(moe, lay, hw, seq_len=1024, global_batch=8).memory
    experts = moe.num_moe_layers() * 2 * moe.mlp_parameters(width=moe.expert_ffn_size)
    dense = moe.num_parameters() - moe.num_moe_layers() * 8 * \
        moe.mlp_parameters(width=moe.expert_ffn_size)
    # bf16 parameters, no gradient shard at a one-micro-batch peak (stage 3), fp32 K = 12
    per = {1: lambda n: 2 + 4 + 12 / n, 3: lambda n: (2 + 12) / n}[zero]
    expected = dense * per(8) + experts * per(2)
    states = p.parameters + p.gradients + p.optimizer_states
    assert states == pytest.approx(expected, rel=0.01)  # norms and biases: counted per layer


@pytest.mark.parametrize("precision,extra", [("fp32", 8), ("bf16", 4)])
def test_2bw_holds_two_more_weight_versions(precision, extra):
    """PipeDream-2BW's optimizer steps fp32 weights apart from the model's (a bf16 run's masters
    already are) and keeps their previous version: measured 21.4 MiB where 1F1B's states
    predicted 16.9 (`plan_memory_vs_measured.py`'s small GPT at pp 2, dp 2)."""
    hw = BUILT_IN["a100-80g-selene"]
    states = {s: predict(GPT, ParallelPlan(dp=2, pp=2, micro_batch=1, pp_schedule=s), hw,
                         seq_len=1024, global_batch=8, precision=precision).memory
              for s in ("1f1b", "2bw")}
    params_per_rank = states["2bw"].parameters / (4 if precision == "fp32" else 2)
    assert states["2bw"].optimizer_states - states["1f1b"].optimizer_states == \
        pytest.approx(extra * params_per_rank)


def test_zero3_holds_a_tied_embedding_gathered_through_the_step():
    """The output layer's backward and the lookup's both need a tied embedding: measured live
    (gathered word and position tables) at the peak of a layer's backward. Under ZeRO-3 tying
    adds that gathered table (bf16) and drops the untied output layer's fresh fp32 gradient
    bucket; under ZeRO-2 neither."""
    hw = BUILT_IN["a100-80g-selene"]
    untied = dataclasses.replace(preset("llama2-7b"), num_layers=4)
    tied = dataclasses.replace(untied, tie_word_embeddings=True)

    def tying(zero: int) -> float:
        lay = ParallelPlan(dp=8, micro_batch=1, zero=zero)
        return (predict(tied, lay, hw, seq_len=1024, global_batch=8).memory.buffers
                - predict(untied, lay, hw, seq_len=1024, global_batch=8).memory.buffers)
    table = tied.vocab_size * tied.hidden_size
    assert tying(3) - tying(2) == pytest.approx(table * 2 - table * 4)


def test_offloading_moves_the_optimizer_states_off_the_device_and_charges_the_transfers():
    hw = dataclasses.replace(BUILT_IN["a100-80g-selene"], host_link_gbytes_per_s=20.0,
                             host_memory_gbytes_per_s=80.0, disk_gbytes_per_s=2.0)
    runs = {target: predict(GPT, ParallelPlan(dp=8, micro_batch=1, zero=1,
                                              offload_optimizer=target), hw,
                            seq_len=1024, global_batch=8)
            for target in ("none", "cpu", "nvme")}
    assert runs["none"].memory.optimizer_states > 0
    assert runs["cpu"].memory.optimizer_states == runs["nvme"].memory.optimizer_states == 0
    assert runs["cpu"].memory.parameters == runs["none"].memory.parameters
    shard = GPT.num_parameters() / 8
    # nvme: each fp32 master and moment read and written once at 2 GB/s, slower than the host
    # update (80 bytes at 80 GB/s), after the gradient out and bf16 parameters back at 20 GB/s
    link = shard * (4 + 2) / 20e9
    extra = runs["nvme"].step_time_s - runs["cpu"].step_time_s
    assert extra == pytest.approx(2 * 12 * shard / 2e9 - shard * 80 / 80e9, rel=0.02)
    assert runs["cpu"].step_time_s - runs["none"].step_time_s > link


def test_activations_are_the_formula_times_what_1f1b_keeps_in_flight():
    lay = ParallelPlan(dp=1, pp=4, micro_batch=1)
    small_vocab = dataclasses.replace(GPT, vocab_size=512)
    work = Workload(small_vocab, lay, 1024, 16, "bf16")
    p = predict(small_vocab, lay, BUILT_IN["a100-80g-selene"], seq_len=1024, global_batch=16)
    # the first stage, the busiest, holds p micro-batches of its num_layers / p layers
    assert p.memory.activations == pytest.approx(4 * 2 * work.layer_activation_bytes(0))


def test_pipeline_buffers_do_not_grow_with_the_micro_batches_but_gpipes_outputs_do():
    """`run_schedule` waits each send once the schedule proves it taken, so 1F1B's first
    stage holds its p outputs and a received gradient however many micro-batches a step has
    (measured: `--peak-memory`, bench_pipeline_memory.py); GPipe holds every output."""
    small_vocab = dataclasses.replace(GPT, vocab_size=512)

    def memory(schedule, global_batch):
        lay = ParallelPlan(dp=1, pp=4, micro_batch=1, pp_schedule=schedule)
        return predict(small_vocab, lay, BUILT_IN["a100-80g-selene"], seq_len=1024,
                       global_batch=global_batch).memory

    few, many = memory("1f1b", 8), memory("1f1b", 512)
    assert many.activations == few.activations and many.buffers == few.buffers
    assert held_boundaries("1f1b", 4, 1, 512) == (5, 5, 4, 2)
    # past the simulation's cap (32 here) the count extends at its last p micro-batches' rate:
    # as counted on the whole list, every output and a received gradient (the last stage:
    # every sent gradient, which nothing proves taken before the step's end)
    assert held_boundaries("gpipe", 4, 1, 8) == (9, 9, 9, 8)
    assert held_boundaries("gpipe", 4, 1, 64) == (65, 65, 65, 64)


def test_tensor_parallel_communication_is_charged_and_hidden_where_meshtrain_hides_it():
    hw = BUILT_IN["a100-80g-selene"]
    one = predict(GPT, ParallelPlan(dp=1, tp=1, micro_batch=4), hw, seq_len=1024, global_batch=4)
    four = predict(GPT, ParallelPlan(dp=1, tp=4, micro_batch=4), hw, seq_len=1024, global_batch=4)
    slow = predict(GPT, ParallelPlan(dp=1, tp=4, micro_batch=4),
                   dataclasses.replace(hw, intra_node_gbytes_per_s=30), seq_len=1024,
                   global_batch=4)
    assert one.exposed_comm_s == 0 < four.exposed_comm_s < slow.exposed_comm_s
    assert four.compute_s < one.compute_s / 2  # the matmuls split four ways, eager norms not


def test_gradient_sync_overlaps_the_backward_and_grows_across_nodes():
    hw = BUILT_IN["a100-80g-selene"]
    inside = predict(GPT, ParallelPlan(dp=8, micro_batch=1), hw, seq_len=1024, global_batch=8)
    across = predict(GPT, ParallelPlan(dp=16, micro_batch=1), hw, seq_len=1024, global_batch=16)
    assert 0 < inside.exposed_comm_s < across.exposed_comm_s


@pytest.mark.parametrize("name,gpus", [("llama3-8b", 8), ("llama3-8b", 16), ("llama3-8b", 64),
                                       ("llama3-70b", 64)])
def test_dense_llama3_on_h100s_at_8k_tokens_predicts_a_published_class_mfu(name, gpus):
    # Published bf16 runs of this class reach 33-50% MFU (torchtitan's 8B on 8 H100s 33-39%,
    # Megatron-LM up to 47%); before attention, norms and positions were priced: 75.7%.
    best = search(preset(name), BUILT_IN["h100-80g"], gpus=gpus, seq_len=8192, global_batch=128,
                  precision="bf16").best()
    assert 0.25 <= best.mfu <= 0.60


def test_flash_attention_runs_at_its_own_efficiency_on_gpus_and_as_matmuls_elsewhere():
    lay = ParallelPlan(dp=1, micro_batch=1)
    sdpa, eager = GPT, dataclasses.replace(GPT, attention="eager")
    hw = BUILT_IN["h100-80g"]
    slow = dataclasses.replace(hw, attention_efficiency=hw.attention_efficiency / 2)

    def step(model, profile, precision="bf16"):
        return predict(model, lay, profile, seq_len=1024, global_batch=1,
                       precision=precision).compute_s
    assert step(sdpa, slow) > step(sdpa, hw)
    assert step(eager, slow) == step(eager, hw)  # eager attention: matmuls and a softmax
    assert step(sdpa, slow, "fp32") == step(sdpa, hw, "fp32")  # no flash kernel in fp32
    core = Workload(sdpa, lay, 1024, 1, "bf16").layer(0).core_matmuls
    gap = step(sdpa, slow) - step(sdpa, hw)  # the core's forward and backward, every layer
    forward = core / (hw.peak_tflops * 1e12 * hw.attention_efficiency)
    assert gap == pytest.approx(GPT.num_layers * forward * (1 + hw.attention_backward_ratio))


@pytest.mark.parametrize("name", ["gpt2", "llama3-8b"])
def test_eager_blocks_move_more_bytes_than_compiled_ones(name):
    m = preset(name)
    eager, fused = (m.pointwise_bytes(hidden=m.hidden_size, tp=1, element_size=2, fused=f)
                    for f in (False, True))
    assert fused < eager < 6 * fused
    lay = ParallelPlan(dp=1, micro_batch=1)
    times = [predict(m, dataclasses.replace(lay, compile=c), BUILT_IN["h100-80g"], seq_len=1024,
                     global_batch=1).compute_s for c in (False, True)]
    assert times[0] > times[1]


def test_deepspeed_zero3_exposes_the_gathers_meshtrain_prefetches():
    m = preset("llama3-8b")
    lay = ParallelPlan(dp=8, micro_batch=1, zero=3)
    ds = dataclasses.replace(lay, zero_impl="deepspeed")
    hw = BUILT_IN["h100-80g"]
    own, theirs = (predict(m, x, hw, seq_len=8192, global_batch=16) for x in (lay, ds))
    assert theirs.compute_s == own.compute_s
    # the same memory but for the gradients filling at the backward's peak: a 5e8-element
    # reduce bucket of DeepSpeed's against meshtrain's fp32 bucket per unit
    assert dataclasses.replace(theirs.memory, buffers=own.memory.buffers) == own.memory
    assert theirs.memory.buffers != own.memory.buffers
    params = m.num_parameters()
    gathers = 2 * 2 * params * 7 / 8 / (hw.intra_node_gbytes_per_s * 1e9)  # forward, backward
    assert theirs.exposed_comm_s - own.exposed_comm_s == pytest.approx(2 * gathers, rel=0.2)


def test_tp_overlap_hides_sequence_parallel_collectives_behind_the_chunked_matmuls():
    """Each of a layer's sequence-parallel collectives runs as t - 1 ring steps behind the t
    chunks of its matmul: with matmuls far longer than the steps nothing but the fixed terms
    stays exposed, with free matmuls (infinitely fast compute) everything does."""
    hw = dataclasses.replace(BUILT_IN["h100-80g"], intra_node_gbytes_per_s=50.0)
    lay = ParallelPlan(dp=1, tp=4, micro_batch=4, sequence_parallel=True)
    plain, overlapped = (predict(GPT, dataclasses.replace(lay, tp_overlap=on), hw,
                                 seq_len=1024, global_batch=4) for on in (False, True))
    assert overlapped.compute_s == plain.compute_s
    assert overlapped.exposed_comm_s < plain.exposed_comm_s
    fast = dataclasses.replace(hw, peak_tflops=1e9, hbm_gbytes_per_s=1e12)
    free = [predict(GPT, dataclasses.replace(lay, tp_overlap=on), fast, seq_len=1024,
                    global_batch=4) for on in (False, True)]
    # nothing to hide behind: the two differ only by the re-gather riding the reduce-scatter
    assert free[1].exposed_comm_s == pytest.approx(free[0].exposed_comm_s, rel=0.05)


def test_expert_parallel_layers_pay_their_all_to_alls():
    moe = dataclasses.replace(GPT, moe_experts=8)
    hw = BUILT_IN["a100-80g-selene"]
    one, two = (chunk_costs(Workload(moe, ParallelPlan(dp=8, ep=ep, micro_batch=1), 1024, 8,
                                     "bf16"), hw)[0] for ep in (1, 2))
    rows = 1024 * moe.hidden_size * 2  # one micro-batch's tokens x top-1 x h, bf16
    link = hw.intra_node_gbytes_per_s * 1e9 * hw.network_efficiency
    exchange = hw.collective_latency_s + rows / 2 / link
    counts = hw.collective_latency_s + 8 * 8 / 2 / link
    layers = moe.num_layers
    assert two.forward_comm - one.forward_comm == pytest.approx(layers * (2 * exchange + counts))
    assert two.backward_comm - one.backward_comm == pytest.approx(layers * 2 * exchange)
    assert two.forward == one.forward  # the same work, only moved


def test_moe_activations_follow_the_expert_and_shared_widths():
    """A Llama MoE layer of top-4 narrow experts (width f/4) beside a shared expert of width f
    saves SwiGLU's 4 x width bytes per row for 4 rows a token at f/4 and one at f, in place of
    the dense MLP's one row at f: two dense MLPs' worth."""
    llama = preset("llama-tiny")
    f = llama.ffn_size
    moe = dataclasses.replace(llama, moe_experts=8, moe_top_k=4, moe_ffn_size=f // 4,
                              moe_shared_ffn_size=f, moe_shared_gate="none")
    lay = ParallelPlan(dp=8, ep=2, micro_batch=2)
    dense, sparse = (Workload(m, lay, 512, 16, "bf16").layer_activation_bytes(0)
                     for m in (llama, moe))
    tokens, e = 2 * 512, 2
    expected = 2 * 4 * tokens * llama.hidden_size * e + 4 * tokens * e * (4 * f // 4 + f - f)
    assert sparse - dense == pytest.approx(expected)


@pytest.mark.parametrize("top_k,every", [(1, 1), (2, 1), (1, 2)])
def test_moe_layers_keep_their_expert_rows_and_outputs_for_backward(top_k, every):
    moe = dataclasses.replace(GPT, moe_experts=8, moe_top_k=top_k, moe_every=every)
    lay = ParallelPlan(dp=8, ep=2, micro_batch=2)
    dense, sparse = (Workload(m, lay, 1024, 16, "bf16").layer_activation_bytes(every - 1)
                     for m in (GPT, moe))
    rows = 2 * 1024 * GPT.hidden_size * 2  # a micro-batch's tokens x h, bf16
    # k expert rows in and out, and k rows of GeLU's input and output at the expert width in
    # place of the dense MLP's one
    hidden = 2 * (2 * 1024) * GPT.ffn_size * 2
    assert sparse - dense == pytest.approx(2 * top_k * rows + (top_k - 1) * hidden)
    if every == 2:  # its dense layers keep a dense layer's
        assert Workload(moe, lay, 1024, 16, "bf16").layer_activation_bytes(0) == dense
    full = dataclasses.replace(lay, recompute="full")
    assert Workload(moe, full, 1024, 16, "bf16").layer_activation_bytes(every - 1) == \
        Workload(GPT, full, 1024, 16, "bf16").layer_activation_bytes(every - 1)


def test_dense_first_layers_and_the_shared_expert_are_priced_by_hand():
    """DeepSeek's shape: the first layer a dense MLP of the model's width, the others top-2 of
    8 narrow experts (4 a rank at ep 2) beside an ungated shared expert twice as wide. Each
    layer's weight-matmul FLOPs, parameters and saved bytes by hand: a dense first layer is
    priced as a dense model's layer, an MoE layer as its router, shared expert and k experts."""
    llama = preset("llama-tiny")
    h, f, w, e = llama.hidden_size, llama.ffn_size, 32, 2
    moe = dataclasses.replace(llama, moe_experts=8, moe_top_k=2, moe_ffn_size=w,
                              moe_shared_ffn_size=2 * w, moe_shared_gate="none",
                              moe_first_dense=1)
    lay = ParallelPlan(dp=4, ep=2, micro_batch=2)
    work, plain = (Workload(m, lay, 256, 8, "bf16") for m in (moe, llama))
    tokens, attention = 2 * 256, moe.attention_parameters()
    dense, sparse = work.layer(0), work.layer(1)
    assert sum(dense.weight_matmuls) == pytest.approx(2 * tokens * (attention + 3 * h * f))
    assert sum(sparse.weight_matmuls) == pytest.approx(
        2 * tokens * (attention + 8 * h + 3 * h * 2 * w + 2 * 3 * h * w))
    assert dense.parameters == attention + 3 * h * f and dense.expert_parameters == 0
    assert sparse.expert_parameters == 4 * 3 * h * w
    assert sparse.parameters == attention + 8 * h + 3 * h * 2 * w + 4 * 3 * h * w
    # saved: 2 rows of h in and out per choice, SwiGLU's 4 x width per row at the expert and
    # shared widths in place of the dense MLP's
    extra = 2 * 2 * tokens * h * e + 4 * e * (2 * tokens * w + tokens * 2 * w - tokens * f)
    assert work.layer_activation_bytes(0) == plain.layer_activation_bytes(0)
    assert work.layer_activation_bytes(1) == pytest.approx(plain.layer_activation_bytes(1)
                                                           + extra)
    assert work.layers_activation_bytes(range(moe.num_layers)) == pytest.approx(
        moe.num_layers * plain.layer_activation_bytes(0) + (moe.num_layers - 1) * extra)


def test_fp8_prices_its_float8_matmuls_at_the_fp8_peak_and_the_experts_in_bf16():
    """`fp8` (parallel/layers/fp8.py) runs the attention projections and a dense MLP in float8:
    those matmuls at the data sheet's FP8 peak (twice bf16's on the H100 and B200), an MoE
    layer's experts, the output layer and the attention core in bf16, as before."""
    h100, b200 = BUILT_IN["h100-80g"], BUILT_IN["b200"]
    assert (h100.peak_for("fp8"), b200.peak_for("fp8")) == (1979.0, 4500.0)
    # a profile without FP8 units (A100: none on its data sheet) prices them at 16 bits
    assert BUILT_IN["a100-40g"].peak_for("fp8") == BUILT_IN["a100-40g"].peak_tflops
    model = dataclasses.replace(preset("qwen3-moe-tiny"), moe_first_dense=1)
    dense, moe = 0, 1
    assert not model.is_moe_layer(dense) and model.is_moe_layer(moe)
    costs = {}
    for fp8 in ("none", "tensorwise"):
        work = Workload(model, ParallelPlan(precision="bf16", fp8=fp8), 128, 8, "bf16")
        costs[fp8] = {i: _layer_cost(work, h100, i).weight_grad for i in (dense, moe)}
        costs[fp8]["head"] = _head_cost(work, h100).forward
    assert costs["tensorwise"]["head"] == costs["none"]["head"]
    assert costs["tensorwise"][dense] < costs["none"][dense]
    # the MoE layer saves only its attention projections' share
    w = Workload(model, ParallelPlan(precision="bf16"), 128, 8, "bf16").layer(moe)
    attention = sum(_matmul(h100, f, "bf16") - _matmul(h100, f, "fp8")
                    for f in w.weight_matmuls[:2])
    assert costs["none"][moe] - costs["tensorwise"][moe] == pytest.approx(attention)
