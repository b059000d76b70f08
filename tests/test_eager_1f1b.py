"""Eager 1F1B, the schedule that shows a new one is its file plus one catalog line: its lists
simulate with 1F1B's bubble and a deeper warm-up's memory, the planner prices it, and
`tests/test_pipeline.py` runs it against one process."""

import dataclasses

import pytest

from meshtrain.cli.main import main
from meshtrain.models import preset
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schedules.catalog import PP_SCHEDULES, SEARCHED_SCHEDULES
from meshtrain.parallel.schedules.eager_1f1b import EAGER_1F1B
from meshtrain.parallel.schedules.flush import one_f_one_b
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.planner.costs import predict
from meshtrain.planner.hardware import BUILT_IN


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 5), (4, 16)])
def test_bubble_is_1f1bs_and_stage_s_holds_2_p_minus_s_minus_1(p, m):
    sim = simulate(EAGER_1F1B.action_lists(p, m))
    for s in range(p):
        assert sim.idle_fraction(s) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert sim.peak_in_flight == [min(m, 2 * (p - s) - 1) for s in range(p)]


def test_the_slack_absorbs_a_slower_first_stage():
    # F 2 and 1, B 2 per micro-batch on stages 0 and 1, m 4: 1F1B's stage 1 waits on stage
    # 0's forward after each of its backwards; the eager stage 0 has its forward ready
    costs = {"forward_cost": [2.0, 1.0], "backward_cost": [2.0, 2.0]}
    assert simulate(one_f_one_b(2, 4), **costs).makespan == 18.0
    assert simulate(EAGER_1F1B.action_lists(2, 4), **costs).makespan == 16.0


def test_is_a_choice_but_not_searched_unfixed():
    assert "eager-1f1b" in PP_SCHEDULES and "eager-1f1b" not in SEARCHED_SCHEDULES


def test_the_planner_prices_it_as_1f1b_holding_more_activations():
    """Equal stages (no output layer in the way: a small vocabulary) and m >= 2p - 1."""
    model = dataclasses.replace(preset("gpt2"), vocab_size=512)
    lay = {name: ParallelPlan(dp=1, pp=4, micro_batch=1, pp_schedule=name)
           for name in ("1f1b", "eager-1f1b")}
    one, eager = (predict(model, lay[name], BUILT_IN["a100-80g-selene"], seq_len=1024,
                          global_batch=16) for name in ("1f1b", "eager-1f1b"))
    assert eager.memory.activations == pytest.approx(7 / 4 * one.memory.activations)
    assert eager.step_time_s == pytest.approx(one.step_time_s)


def test_plan_takes_it_in_a_layout(capsys):
    spec = "tp=1,pp=2,dp=2,mb=1,zero=1,sp=0,recompute=none,schedule=eager-1f1b"
    args = ["plan", "--model", "gpt2", "--num-layers", "8", "--seq-len", "1024",
            "--global-batch", "16", "--hardware", "a100-40g", "--gpus", "4", "--layout", spec]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert err == "" and "schedule=eager-1f1b" in out and "--pp-schedule eager-1f1b" in out
