"""The planner's expert tensor parallelism (`etp`): whole experts' memory sharded over their
wider edp groups, their all-to-alls carrying a tp-th of the rows and their tensor-parallel
traffic replaced, the search trying etp 1, and Megatron's Qwen3-235B-A22B-style layout (tp 2,
pp 8, ep 32 with whole experts on 256 GPUs) expressible where etp = tp refuses it."""

import dataclasses

import pytest

from meshtrain.errors import Code, SettingError
from meshtrain.models import preset
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.costs import chunk_costs, predict
from meshtrain.planner.hardware import BUILT_IN
from meshtrain.planner.search import search
from meshtrain.planner.workload import Workload

MOE = dataclasses.replace(preset("gpt2"), num_layers=8, max_seq_len=1024, moe_experts=8)
HW = BUILT_IN["a100-80g-selene"]


@pytest.mark.parametrize("zero", [1, 3])
def test_whole_experts_are_sharded_over_their_edp_across_tp(zero):
    """tp 2 x dp 4, ep 4 at etp 1: each rank holds 2 of the 8 experts whole, as do the
    edp = 2 x 4 / 4 = 2 ranks it shards them with; the rest split over tp and sharded over dp."""
    lay = ParallelPlan(tp=2, dp=4, ep=4, etp=1, micro_batch=1, zero=zero)
    p = predict(MOE, lay, HW, seq_len=1024, global_batch=4).memory  # one micro-batch
    expert = MOE.mlp_parameters(width=MOE.expert_ffn_size)
    experts = MOE.num_moe_layers() * 2 * expert
    dense = (MOE.num_parameters() - MOE.num_moe_layers() * 8 * expert) / 2
    per = {1: lambda n: 2 + 4 + 12 / n, 3: lambda n: (2 + 12) / n}[zero]
    states = p.parameters + p.gradients + p.optimizer_states
    assert states == pytest.approx(dense * per(4) + experts * per(2), rel=0.01)


def test_whole_experts_send_a_tp_share_of_rows_and_gather_instead_of_reducing():
    """Per MoE layer and direction, etp 1 against etp = tp at tp 2, dp 4, ep 2: each all-to-all
    carries half the rows (each tp rank dispatches its half of the tokens); the experts' all-
    reduce of the k rows per token over tp becomes an all-gather of the layer's output (or of
    its input's gradient). The same FLOPs."""
    split, whole = (chunk_costs(Workload(MOE, ParallelPlan(tp=2, dp=4, ep=2, etp=etp,
                                                           micro_batch=1), 1024, 8, "bf16"),
                                HW)[0] for etp in (None, 1))
    link = HW.intra_node_gbytes_per_s * 1e9 * HW.network_efficiency
    lat, tokens = HW.collective_latency_s, 1024 * MOE.hidden_size * 2  # top-1, bf16
    exchange = {1: lat + tokens / 2 / 2 / link, 2: lat + tokens / 2 / link}  # by rows' parts
    reduce = 2 * lat + 2 * (1 / 2) * tokens / link
    gather = lat + tokens / 2 / link
    per_layer = 2 * (exchange[1] - exchange[2]) + gather - reduce
    layers = MOE.num_layers
    assert whole.forward_comm - split.forward_comm == pytest.approx(layers * per_layer)
    assert whole.backward_comm - split.backward_comm == pytest.approx(layers * per_layer)
    assert whole.forward == split.forward


def test_the_search_tries_whole_experts():
    found = search(MOE, HW, gpus=8, seq_len=1024, global_batch=16, precision="bf16",
                   fixed={"tp": 2})
    etps = {p.layout.etp for p in found.ranked}
    assert etps == {None, 1}, etps


def test_megatron_style_folded_layout_is_expressible_on_256_gpus():
    """Qwen3-235B-A22B's shape (128 experts, top 8, 94 layers; here 16 to stay fast) at tp 2,
    pp 8, ep 32: ep 32 spans the tp x dp = 32 ranks of a stage only with whole experts."""
    model = dataclasses.replace(preset("llama3-8b"), num_layers=16, num_heads=64,
                                num_kv_heads=4, moe_experts=128, moe_top_k=8,
                                moe_ffn_size=1536, moe_capacity_factor=0.0)
    kw = {"gpus": 256, "seq_len": 4096, "global_batch": 1024, "precision": "bf16"}
    fixed = {"tp": 2, "pp": 8, "cp": 1, "ep": 32, "etp": 1, "micro_batch": 1, "zero": 1,
             "recompute": "full", "pp_schedule": "1f1b", "sequence_parallel": True,
             "virtual_stages": 1}
    result = search(model, BUILT_IN["h100-80g"], fixed=fixed, **kw)
    layout = result.ranked[0].layout
    assert (layout.tp, layout.pp, layout.dp, layout.ep, layout.etp) == (2, 8, 16, 32, 1)
    assert result.ranked[0].step_time_s > 0
    with pytest.raises(SettingError) as refused:
        search(model, BUILT_IN["h100-80g"], fixed=fixed | {"etp": 2}, **kw)
    assert refused.value.code is Code.EP_DEGREE and "`etp` 1" in str(refused.value)
