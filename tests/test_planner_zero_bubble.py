"""The planner's zero-bubble schedules: the split backward's I and W costs, the bubble and memory
they are predicted with, the V placement's ranks, the search choosing them, their refusals, and
`meshtrain plan --layout schedule=zb-v`."""

import dataclasses
import re

import pytest
from test_planner_costs import GPT, IDEAL

from meshtrain.cli.main import main
from meshtrain.errors import Code
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schedules import zero_bubble
from meshtrain.parallel.schedules.catalog import pipeline_schedule
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.planner.costs import chunk_costs, predict
from meshtrain.planner.hardware import BUILT_IN
from meshtrain.planner.pipeline_model import ChunkCost, run_pipeline, split_backward
from meshtrain.planner.search import search
from meshtrain.planner.workload import Workload

SMALL_VOCAB = dataclasses.replace(GPT, vocab_size=512)
"""The output layer's logits small: the first pipeline rank holds the most."""


def _even(p: int, v: int, f: float = 1.0, b: float = 2.0) -> list[ChunkCost]:
    """Equal chunks, F = I = W = f (the paper's equal-cost case) per stage."""
    return [ChunkCost(f / v, 0.0, b / v, 0.0, 1.0, b / (2 * v))] * (p * v)


def _bubble(schedule: str, p: int = 4, m: int = 8) -> float:
    lay = ParallelPlan(dp=1, pp=p, pp_schedule=schedule)
    run = run_pipeline(_even(p, lay.chunks_per_rank), lay, m)
    return run.makespan - m * 3.0


def test_zb_h1_models_a_third_of_1f1bs_bubble_and_zb_v_less():
    one_f_one_b, h1, v = (_bubble(s) for s in ("1f1b", "zb-h1", "zb-v"))
    assert one_f_one_b == pytest.approx(3 * (1 + 2))  # (p - 1)(F + B)
    assert h1 == pytest.approx(one_f_one_b / 3)  # (p - 1)(F + I - W), Qi et al.
    assert 0 < v < h1


@pytest.mark.parametrize("oversubscription", [1.0, 2.0])
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_capped_simulation_equals_the_full_one_on_uneven_stages(schedule, oversubscription):
    p, m = 3, 60  # cap is p x max(8, 2v + 2) = 24 < m
    lay = ParallelPlan(dp=1, pp=p, pp_schedule=schedule)
    chunks = [ChunkCost(1.0 + 0.3 * g, 0.1, 2.0 + 0.5 * g, 0.2, 1.0, 0.7 + 0.2 * g)
              for g in range(p * lay.chunks_per_rank)]
    run = run_pipeline(chunks, lay, m, oversubscription)
    generator = {"zb-h1": zero_bubble.zb_h1, "zb-v": zero_bubble.zb_v}[schedule]
    input_grad, weight_grad = split_backward(chunks)
    full = simulate(
        generator(p, m), forward_cost=[c.forward + c.forward_comm for c in chunks],
        backward_cost=[c.backward + c.backward_comm for c in chunks],
        input_grad_cost=input_grad, weight_grad_cost=weight_grad, v=lay.chunks_per_rank,
        placement=pipeline_schedule(schedule).placement, oversubscription=oversubscription)
    assert run.makespan == pytest.approx(full.makespan)
    assert run.busy == pytest.approx(full.busy)


def test_w_is_the_weight_half_and_the_first_chunk_runs_fused_at_its_w():
    lay = ParallelPlan(dp=1, pp=2, micro_batch=2, pp_schedule="zb-h1")
    chunks = chunk_costs(Workload(GPT, lay, 1024, 8, "bf16"), IDEAL)
    input_grad, weight_grad = split_backward(chunks)
    assert input_grad[0] == 0 and weight_grad[0] == chunks[0].backward
    # the last chunk: each weight matmul's gradient (one matmul its size), the head's too
    s, h, layers = 1024 * 2, GPT.hidden_size, GPT.num_layers // 2
    flops = 2 * s * (layers * 12 * h * h + h * GPT.vocab_size)
    assert weight_grad[1] == pytest.approx(flops / 100e12, rel=1e-6)
    assert input_grad[1] + weight_grad[1] == pytest.approx(chunks[1].backward)


def test_split_backward_exposes_the_input_gradient_all_reduce_it_cannot_hide():
    """A deferred weight gradient no longer runs under the all-reduce (without SP)."""
    hw = BUILT_IN["a100-80g-selene"]
    costs = {s: chunk_costs(Workload(GPT, ParallelPlan(tp=4, dp=1, pp=2, pp_schedule=s), 1024,
                                     8, "bf16"), hw) for s in ("1f1b", "zb-h1")}
    assert costs["zb-h1"][1].backward_comm > costs["1f1b"][1].backward_comm
    assert costs["zb-h1"][0] == costs["1f1b"][0]._replace(
        weight_grad=costs["1f1b"][0].backward, weight_grad_comm=costs["1f1b"][0].backward_comm)


def test_zb_v_puts_the_first_and_last_chunk_on_rank_0_and_keeps_its_turn_in_memory():
    p = 4
    lay = ParallelPlan(dp=1, pp=p, pp_schedule="zb-v")
    work = Workload(GPT, lay, 1024, 8, "bf16")
    chunks = chunk_costs(work, BUILT_IN["a100-80g-selene"])
    run = run_pipeline(chunks, lay, 8)
    assert run.chunks_of(0) == [0, 2 * p - 1] and run.chunks_of(p - 1) == [p - 1, p]
    assert chunks[p - 1].forward_comm < chunks[p - 2].forward_comm  # no send at the turn
    assert chunks[p].backward_comm < chunks[p + 1].backward_comm
    # the busiest rank: 1F1B's last (2 layers and the output layer's copy of the embedding),
    # zb-v's first, which holds the embedding (and its position table) too
    one_f_one_b = predict(GPT, ParallelPlan(dp=1, pp=p), IDEAL, seq_len=1024, global_batch=8)
    v = predict(GPT, lay, IDEAL, seq_len=1024, global_batch=8)
    assert v.memory.parameters - one_f_one_b.memory.parameters == pytest.approx(
        2 * (work.embedding_parameters() + work.position_parameters()), rel=1e-6)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_activations_are_1f1bs_p_stages(schedule):
    kw = {"seq_len": 1024, "global_batch": 16}
    hw = BUILT_IN["a100-80g-selene"]
    base = predict(SMALL_VOCAB, ParallelPlan(dp=1, pp=4), hw, **kw)
    zb = predict(SMALL_VOCAB, ParallelPlan(dp=1, pp=4, pp_schedule=schedule), hw, **kw)
    assert zb.memory.activations == pytest.approx(base.memory.activations)
    assert zb.bubble_s < base.bubble_s


def test_the_search_picks_a_zero_bubble_schedule_when_bubbles_dominate():
    """Four stages, eight micro-batches, no communication: the step is compute and bubble."""
    kw = {"gpus": 4, "seq_len": 1024, "global_batch": 8, "precision": "bf16",
          "fixed": {"pp": 4, "mb": 1}}
    found = search(SMALL_VOCAB, IDEAL, **kw).best()
    without = search(SMALL_VOCAB, IDEAL, **kw, schedules=("1f1b", "interleaved")).best()
    one_f_one_b = predict(SMALL_VOCAB, ParallelPlan(dp=1, pp=4), IDEAL, seq_len=1024,
                          global_batch=8)
    assert found.layout.pp_schedule == "zb-v" and without.layout.pp_schedule == "interleaved"
    assert found.step_time_s < without.step_time_s
    assert found.bubble_s < one_f_one_b.bubble_s / 3


def test_refused_zero_bubble_layouts_are_grouped_by_their_code():
    model = dataclasses.replace(GPT, num_layers=4)
    found = search(model, BUILT_IN["a100-40g"], gpus=8, seq_len=1024, global_batch=16,
                   precision="bf16", fixed={"schedule": "zb-v"})
    for code, layout in ((Code.ZERO_BUBBLE_PP, "pp=1"), (Code.ZB_V_LAYERS, "pp=4"),
                         (Code.ZERO_BUBBLE_SCHEME, "scheme=")):
        assert any(layout in r.layout.spec(found.base) for r in found.rejected[code.value])
    assert found.ranked and {p.layout.pp for p in found.ranked} == {2}


@pytest.mark.parametrize("schedule", ["zb-v", "zb-h1"])
def test_plan_layout_explains_a_zero_bubble_layout(capsys, schedule):
    spec = f"tp=1,pp=4,dp=2,mb=1,zero=1,sp=0,recompute=none,schedule={schedule}"
    args = ["plan", "--model", "gpt2", "--num-layers", "8", "--seq-len", "1024",
            "--global-batch", "16", "--hardware", "a100-40g", "--gpus", "8", "--layout", spec]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert err == "" and re.search(r"1 layout\(s\) considered .*: 1 fit", out)
    row = next(line for line in out.splitlines() if line.lstrip().startswith("1 "))
    step, compute, comm, bubble = map(float, row.split()[1:5])
    expected = predict(GPT, ParallelPlan(dp=2, pp=4, zero=1, pp_schedule=schedule),
                       BUILT_IN["a100-40g"], seq_len=1024, global_batch=16)
    assert step == pytest.approx(expected.step_time_s, rel=1e-3)
    assert (compute, comm, bubble) == pytest.approx(
        (expected.compute_s, expected.exposed_comm_s, expected.bubble_s), rel=1e-2)
    assert f"schedule={schedule}" in row and f"--pp-schedule {schedule}" in out
