"""The planner's 2D/2.5D/3D tensor-parallel model: each scheme's byte formula against numbers
worked by hand, which scheme moves fewest where (the crossover in closed form), the cost model
charging exactly those bytes, the grids' memory split and 2.5d's depth gradient sync; the
search over grids, its rejections with `ParallelPlan.validate`'s reasons, and `meshtrain plan`
with a fixed scheme."""

import dataclasses
import json
import shlex

import pytest

from meshtrain.cli.auto_layout import short_spec
from meshtrain.cli.main import _train_config, main
from meshtrain.cli.parsers import build_parser
from meshtrain.models import preset
from meshtrain.models.gpt import GPTConfig
from meshtrain.models.llama import LlamaConfig
from meshtrain.parallel.runtime.plan import ParallelPlan, parse_spec
from meshtrain.parallel.schemes.cube import cube_linear
from meshtrain.parallel.schemes.megatron1d import megatron_layer
from meshtrain.parallel.schemes.registry import tp_scheme
from meshtrain.parallel.schemes.scheme import Traffic, layer_linears
from meshtrain.parallel.schemes.summa import depth_gradient_bytes, summa_linear
from meshtrain.planner.collectives import TPClock
from meshtrain.planner.costs import predict
from meshtrain.planner.hardware import BUILT_IN, Hardware
from meshtrain.planner.search import search
from meshtrain.planner.workload import GRAD_BYTES, Workload

LINK = Hardware(name="link", peak_tflops=100.0, hbm_gib=80, gpus_per_node=64,
                intra_node_gbytes_per_s=1.0, inter_node_gbytes_per_s=1.0, hbm_gbytes_per_s=1e15,
                matmul_efficiency=1.0, matmul_half_gflop=0.0, memory_efficiency=1.0,
                network_efficiency=1.0, collective_latency_s=0.0)
"""Matmuls at peak, free memory traffic, no latency, 1 GB/s links: a second per GB moved."""

GPT = dataclasses.replace(preset("gpt2"), num_layers=2, max_seq_len=1024)
SEQ = 1024


def test_megatron_layer_by_hand():
    # two all-reduces each way of B h e = 8 x 4 x 2 bytes over 4 ranks: 2 x 2 x 3/4 x 64
    assert megatron_layer(tokens=8, hidden=4, t=4, e=2) == Traffic(192, 192, 12, 12)


def test_1d_prices_the_traffic_it_counts():
    """On a clock of a second per GB and no latency, Megatron's layer with nothing hidden (a
    split backward) waits exactly for the bytes `megatron_layer` counts, each way."""
    plan, model = ParallelPlan(dp=1, tp=4), GPTConfig(num_layers=1, hidden_size=64, num_heads=4)
    waits = plan.scheme.layer_comm(plan, model, 128, 2, TPClock(LINK, 4), weights=[1.0] * 4,
                                   split=True)
    traffic = plan.scheme.layer_traffic(model, plan.tp_grid, 128, 2)
    assert waits.forward == pytest.approx(traffic.forward_bytes / 1e9)
    assert waits.backward == pytest.approx(traffic.backward_bytes / 1e9)
    assert waits.weight == 0.0


@pytest.mark.parametrize("plan,parts", [(ParallelPlan(dp=1, tp=4), 1),
                                        (ParallelPlan(dp=1, tp=4, sequence_parallel=True), 4),
                                        (ParallelPlan(dp=1, tp=4, micro_batch=2,
                                                      tp_scheme="2d"), 4)])
def test_the_scheme_says_how_the_plan_splits_its_hidden_states(plan, parts):
    assert plan.scheme.hidden_parts(plan) == parts


def test_summa_linear_by_hand():
    # q = 2: (q-1)/q^2 = 1/4 of (B h_in / d + h_in h_out) e = (32 / d + 24) x 2 forward
    assert summa_linear(tokens=8, h_in=4, h_out=6, q=2, d=1, e=2) == Traffic(28, 56, 4, 8)
    assert summa_linear(tokens=8, h_in=4, h_out=6, q=2, d=2, e=2) == Traffic(20, 40, 4, 8)
    assert depth_gradient_bytes(100, d=4, grad_bytes=4) == 600  # 2 x 3/4 x 100 x 4


def test_cube_linear_by_hand():
    # (q-1)/q^3 e = 1/4: forward B h_in + h_in h_out + B h_out = 32 + 24 + 48;
    # backward 2 x 32 + 48 + 2 x 24; together (3 B h_in + 2 B h_out + 3 h_in h_out) / 4 = 66
    traffic = cube_linear(tokens=8, h_in=4, h_out=6, q=2, e=2)
    assert traffic == Traffic(26, 40, 3, 5) and traffic.total_bytes == 66


def test_layer_linears_of_each_family():
    gpt = GPTConfig(num_layers=1, hidden_size=8, num_heads=2)
    assert layer_linears(gpt) == ((8, 24), (8, 8), (8, 32), (32, 8))
    llama = LlamaConfig(num_layers=1, hidden_size=16, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=40)
    assert layer_linears(llama) == ((16, (4 + 2 * 2) * 4), (16, 16), (16, 80), (40, 16))


def _bytes(h: int, tokens: int, ranks: int, scheme: str, depth: int | None = None) -> float:
    model = GPTConfig(num_layers=1, hidden_size=h, num_heads=h // 128)
    grid = tp_scheme(scheme).grid(ranks, depth)
    return tp_scheme(scheme).layer_traffic(model, grid, tokens, 2).total_bytes


@pytest.mark.parametrize("tokens", [2048, 16384])
def test_1d_moves_fewest_at_small_tp_for_gpt3_width(tokens):
    h = 12288
    for ranks, grids in ((4, [("2d", None)]), (8, [("2.5d", 2), ("3d", None)]),
                         (16, [("2d", None), ("2.5d", 4)])):
        one_d = _bytes(h, tokens, ranks, "1d")
        assert all(one_d < _bytes(h, tokens, ranks, *grid) for grid in grids)


def test_3d_moves_fewest_at_large_tp_once_the_micro_batch_outweighs_the_weights():
    """GPT layer: 3d moves (q-1)/q^3 (39 B h + 36 h^2) e, 1d 8 (q^3-1)/q^3 B h e, so 3d moves
    less exactly when B > 36 h / (8 (q^2 + q + 1) - 39): B > 0.28 h at q = 4 (tp 64)."""
    h = 12288
    for ranks in (27, 64):
        others = [_bytes(h, 16384, ranks, s, d) for s, d in (("1d", None), ("2.5d", 3 if
                                                                         ranks == 27 else 4))]
        assert _bytes(h, 16384, ranks, "3d") < min(others)
    crossover = 36 * h / (8 * (16 + 4 + 1) - 39)  # 3429.2 tokens at q = 4
    assert _bytes(h, 3430, 64, "3d") < _bytes(h, 3430, 64, "1d")
    assert _bytes(h, 3429, 64, "3d") > _bytes(h, 3429, 64, "1d")
    assert 3429 < crossover < 3430
    # a 2048-token micro-batch (one GPT-3 sequence) stays cheaper on 1d even at tp 64;
    # a narrow model's crosses over sooner
    assert _bytes(h, 2048, 64, "1d") < _bytes(h, 2048, 64, "3d")
    assert _bytes(1024, 2048, 27, "3d") < _bytes(1024, 2048, 27, "1d")


def _predict(layout: ParallelPlan, *, batch: int = 8):
    return predict(GPT, layout, LINK, seq_len=SEQ, global_batch=batch)


def _step_bytes(work: Workload) -> float:
    """The layers' and the output layer's traffic of one micro-batch (the scheme's formulas)."""
    lay, tokens = work.layout, work.local_tokens
    layer = lay.scheme.layer_traffic(GPT, lay.tp_grid, tokens, 2)
    head = lay.scheme.output_traffic(lay.tp_grid, tokens, GPT.hidden_size, GPT.vocab_size, 2)
    return GPT.num_layers * layer.total_bytes + head.total_bytes


@pytest.mark.parametrize("layout", [ParallelPlan(dp=1, tp=4, micro_batch=4, tp_scheme="2d"),
                                    ParallelPlan(dp=1, tp=8, micro_batch=4, tp_scheme="3d")])
def test_a_grid_is_charged_its_formula_bytes_and_the_same_compute_as_1d(layout):
    grid, one_d = _predict(layout), _predict(dataclasses.replace(layout, tp_scheme="1d"))
    work = Workload(GPT, layout, SEQ, 8, "bf16")
    moved = _step_bytes(work)
    # (plus the step's 4-byte scalar all-reduces)
    assert grid.exposed_comm_s == pytest.approx(work.micro_batches * moved / 1e9, rel=1e-6)
    assert grid.compute_s == pytest.approx(one_d.compute_s, rel=1e-6)
    assert grid.exposed_comm_s != pytest.approx(one_d.exposed_comm_s, rel=1e-3)


def test_2p5d_pays_its_depth_all_reduce_once_a_step():
    layout = ParallelPlan(dp=1, tp=8, micro_batch=4, tp_scheme="2.5d", tp_depth=2)
    p = _predict(layout, batch=16)  # four micro-batches, one depth all-reduce
    work = Workload(GPT, layout, SEQ, 16, "bf16")
    in_path = _step_bytes(work)
    held = GPT.num_layers * work.layer(0).parameters + work.embedding_parameters()
    depth = depth_gradient_bytes(held, 2, GRAD_BYTES)
    assert p.exposed_comm_s == pytest.approx((4 * in_path + depth) / 1e9, rel=1e-6)


def test_grids_split_model_states_and_every_activation():
    def states(p):
        return p.memory.parameters + p.memory.gradients + p.memory.optimizer_states

    dense = _predict(ParallelPlan(dp=1, micro_batch=4))
    one_d = _predict(ParallelPlan(dp=1, tp=4, micro_batch=4))
    two_d = _predict(ParallelPlan(dp=1, tp=4, micro_batch=4, tp_scheme="2d"))
    deep = _predict(ParallelPlan(dp=1, tp=8, micro_batch=4, tp_scheme="2.5d", tp_depth=2))
    cube = _predict(ParallelPlan(dp=1, tp=8, micro_batch=4, tp_scheme="3d"))
    # GPT's position table: whole on every 1d rank, split along the hidden size (q = 2) on a
    # grid; 2 + 4 + 12 bytes of bf16 parameter, fp32 gradient and optimizer states each
    table = Workload(GPT, ParallelPlan(dp=1), SEQ, 8, "bf16").position_parameters() * 18
    assert states(two_d) == pytest.approx(states(one_d) - table / 2)  # 1/q^2 = 1/tp
    assert states(deep) == pytest.approx(states(two_d))  # 1/q^2, replicated over depth 2
    assert states(cube) == pytest.approx((states(dense) - table) / 8 + table / 2,
                                         rel=0.01)  # 1/q^3
    for p, t in ((two_d, 4), (deep, 8), (cube, 8)):
        assert p.memory.activations == pytest.approx(dense.memory.activations / t)
    assert one_d.memory.activations > two_d.memory.activations  # 1d replicates norms, residuals


# --- the search ------------------------------------------------------------------------------

def _search(model=GPT, fixed=None, seq_len=SEQ):
    return search(model, BUILT_IN["a100-40g"], gpus=8, seq_len=seq_len, global_batch=64,
                  precision="bf16", fixed=fixed)


def test_the_search_tries_every_grid_tp_forms_and_a_fixed_scheme_alone():
    assert {(p.layout.tp_scheme, p.layout.tp, p.layout.tp_depth) for p in _search().ranked
            if p.layout.tp_scheme != "1d"} == {("2d", 4, None), ("2.5d", 8, 2), ("3d", 8, None)}
    fixed = _search(fixed={"scheme": "2d"})
    assert {(p.layout.tp_scheme, p.layout.tp) for p in fixed.ranked} == {("2d", 4)}
    assert all(p.layout.micro_batch % 2 == 0 and not p.layout.sequence_parallel
               for p in fixed.ranked)
    bad = fixed.rejected["tp does not form the scheme's grid"]
    assert {r.layout.tp for r in bad} == {1, 2, 8} and "q^2 grid" in bad[0].detail
    assert {p.layout.tp_scheme for p in _search(fixed={"scheme": "1d"}).ranked} == {"1d"}
    deep = _search(fixed={"depth": 2})
    assert {(p.layout.tp_scheme, p.layout.tp) for p in deep.ranked} == {("2.5d", 8)}


def test_a_searched_scheme_respects_a_fixed_micro_batch_and_sp():
    """Grids are searched only where the fixed fields allow one, so a spec fixing everything
    but the scheme still leaves one (1d) layout, reported even over budget."""
    spec = {"tp": 4, "pp": 1, "dp": 2, "mb": 1, "zero": 0, "sp": False, "recompute": "none",
            "schedule": "1f1b"}
    assert [p.layout.tp_scheme for p in _search(fixed=spec).ranked] == ["1d"]
    wider = _search(fixed=spec | {"mb": 4})
    assert {p.layout.tp_scheme for p in wider.ranked} == {"1d", "2d"}
    assert {p.layout.tp_scheme for p in _search(fixed={"sp": True}).ranked} == {"1d"}


@pytest.mark.parametrize("fixed,model,reason,message", [
    ({"scheme": "3d", "sp": True}, GPT, "grid scheme with sp, cp or MoE",
     "does not combine with `sequence_parallel`"),
    ({"scheme": "2d", "cp": 2}, GPT, "grid scheme with sp, cp or MoE",
     "does not combine with `cp`"),
    ({"scheme": "2d"}, dataclasses.replace(GPT, moe_experts=4),
     "grid scheme with sp, cp or MoE", "does not combine with `"),
    ({"scheme": "3d", "tp": 8, "mb": 2}, GPT, "micro-batch not divisible by the grid's batch split",
     "splits each micro-batch 4 ways"),
    ({"scheme": "2d"}, dataclasses.replace(GPT, num_heads=3),
     "heads or widths not divisible by the grid", "number of heads (3) must be divisible by 2"),
    ({"scheme": "2.5d", "depth": 3}, GPT, "tp_depth does not fit the scheme or tp",
     "`tp_depth` 3 must divide"),
])
def test_grids_that_cannot_run_are_rejected_with_the_plans_reason(fixed, model, reason,
                                                                    message):
    result = _search(model=model, fixed=fixed, seq_len=2048)
    assert not result.ranked
    assert message in result.rejected[reason][0].detail
    with pytest.raises(ValueError, match="no layout fits"):
        result.best()


def test_a_grid_layout_round_trips_through_its_spec():
    layout = ParallelPlan(dp=1, tp=8, micro_batch=4, tp_scheme="2.5d", tp_depth=2)
    assert ParallelPlan(**parse_spec(layout.spec())) == layout
    assert short_spec(layout) == "tp=8,pp=1,dp=1,mb=4,scheme=2.5d,depth=2"
    assert "depth" not in ParallelPlan(dp=1).spec()
    plan = layout
    assert (plan.tp_scheme, plan.tp_depth, plan.batch_parts) == ("2.5d", 2, 4)


@pytest.mark.parametrize("spec,flags", [("scheme=3d,tp=8", ["--tp-scheme", "3d"]),
                                        ("scheme=2.5d,tp=8", ["--tp-scheme", "2.5d", "--tp-depth",
                                                         "2"])])
def test_plan_with_a_fixed_scheme_prints_commands_that_train_it(capsys, spec, flags):
    assert main(["plan", "--model", "gpt2", "--num-layers", "4", "--seq-len", "1024",
                 "--global-batch", "64", "--hardware", "a100-40g", "--gpus", "8",
                 "--layout", spec, "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts
    for entry in layouts:
        words = shlex.split(entry["command"])
        assert " ".join(flags) in " ".join(words)
        cfg = _train_config(build_parser().parse_args(words[words.index("train"):]))
        assert cfg.plan.searched_view() == entry["layout"]
