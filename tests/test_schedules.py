"""Pipeline schedules as data: the simulator reproduces the bubble and memory formulas exactly."""

import pytest
from harness import raises_as_flags

from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECV_ACTIVATION,
    SEND_GRAD,
    WEIGHT_GRAD,
    Action,
)
from meshtrain.parallel.schedules.catalog import SCHEDULES
from meshtrain.parallel.schedules.flush import gpipe, one_f_one_b
from meshtrain.parallel.schedules.interleaved import interleaved
from meshtrain.parallel.schedules.pipedream import pipedream_2bw
from meshtrain.parallel.schedules.simulator import simulate

LAYOUTS = [(2, 4), (4, 8), (4, 4), (3, 5), (4, 16)]


@pytest.mark.parametrize("p,m", LAYOUTS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_schedules_idle_exactly_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    sim = simulate(gpipe(p, m) if name == "gpipe" else one_f_one_b(p, m))
    for s in range(p):
        assert sim.idle_fraction(s) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", LAYOUTS)
def test_peak_activations_gpipe_m_and_1f1b_min_m_p_minus_s(p, m):
    assert simulate(gpipe(p, m)).peak_in_flight == [m] * p
    assert simulate(one_f_one_b(p, m)).peak_in_flight == [min(m, p - s) for s in range(p)]


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 4, 2), (2, 8, 3), (4, 8, 4)])
def test_interleaved_idle_and_peak(p, m, v):
    sim = simulate(interleaved(p, m, v), v=v)
    for s in range(p):
        assert sim.idle_fraction(s) == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    # peak live model chunks (each 1/v of the stage's layers): its warm-up plus one
    assert sim.peak_in_flight == [min(m * v, 2 * (p - s - 1) + (v - 1) * p + 1)
                                  for s in range(p)]


@pytest.mark.parametrize("p,m,steps", [(2, 4, 3), (4, 4, 5), (4, 8, 2)])
def test_2bw_has_only_one_fill_and_drain_per_run(p, m, steps):
    sim = simulate(pipedream_2bw(p, m, steps))
    for s in range(p):
        assert sim.idle_fraction(s) == pytest.approx((p - 1) / (steps * m + p - 1), abs=1e-12)
    # a new weight version every m micro-batches, on every stage
    for rank in pipedream_2bw(p, m, steps):
        assert [a.micro for a in rank if a.kind == "step"] == list(range(steps))


def test_every_forward_and_backward_once_with_matching_communication():
    p, m, v = 4, 8, 2
    schedule = interleaved(p, m, v)
    for s, actions in enumerate(schedule):
        computed = sorted((a.kind, a.micro, a.chunk) for a in actions
                          if a.kind in (FORWARD, BACKWARD))
        assert computed == sorted((k, i, c) for k in (FORWARD, BACKWARD) for i in range(m)
                                  for c in range(v))
        # the very first model chunk receives nothing; the others receive each activation once
        receives = [a for a in actions if a.kind == RECV_ACTIVATION]
        assert len(receives) == m * v - (m if s == 0 else 0)
        assert len([a for a in actions if a.kind == SEND_GRAD]) == m * v - (m if s == 0 else 0)
    assert schedule[0][0] == Action(FORWARD, 0, 0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_computes_each_micro_batch_on_every_chunk_once(name, p, m):
    """Whatever the schedule: every (micro-batch, global chunk) forwarded and backwarded once
    (`B`, or `I` and `W`), in its own placement, and the simulator finishes it (no deadlock)."""
    schedule = SCHEDULES[name]
    v = schedule.chunks_per_rank(p, 2 if schedule.takes_virtual_stages else 1)
    lists = schedule.action_lists(p, m, v=v)
    simulate(lists, v=v, placement=schedule.placement)
    backward = (INPUT_GRAD, WEIGHT_GRAD) if schedule.split_backward else (BACKWARD,)
    for kind in (FORWARD, *backward):
        done = sorted((a.micro, schedule.placement(s, a.chunk, p))
                      for s, actions in enumerate(lists) for a in actions if a.kind == kind)
        assert done == [(i, g) for i in range(m) for g in range(p * v)], kind


def test_bad_schedule_settings():
    with raises_as_flags(r"micro-batches \(6\) divisible by --pp \(4\)"):
        interleaved(4, 6, 2)
    with raises_as_flags(r"PipeDream-2BW needs micro-batches \(2\) >= --pp \(4\)"):
        pipedream_2bw(4, 2, 3)
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate([[Action(BACKWARD, 0)], [Action(FORWARD, 1)]])


# Recorded from the simulator before it learnt I and W (commit c32dbb5), on uneven chunk costs:
# forward 1 + g/4 and backward 2 + (g mod 3)/2 on global chunk g. (makespan, busy, peak)
BEFORE_SPLIT = {
    ("gpipe", 3, 5, 1): (29.25, [15.0, 18.75, 22.5], [5, 5, 5]),
    ("1f1b", 4, 8, 1): (45.75, [24.0, 30.0, 36.0, 30.0], [4, 3, 2, 1]),
    ("2bw", 4, 8, 1): (81.75, [48.0, 60.0, 72.0, 60.0], [4, 3, 2, 1]),
    ("interleaved", 4, 8, 2): (87.75, [60.0, 72.0, 72.0, 72.0], [11, 9, 7, 5]),
    ("interleaved", 2, 8, 3): (107.5, [96.0, 102.0], [7, 5]),
}


@pytest.mark.parametrize("key", BEFORE_SPLIT)
def test_existing_schedules_simulate_as_before_the_split_backward(key):
    name, p, m, v = key
    schedule = {"gpipe": lambda: gpipe(p, m), "1f1b": lambda: one_f_one_b(p, m),
                "2bw": lambda: pipedream_2bw(p, m, 2),
                "interleaved": lambda: interleaved(p, m, v)}[name]()
    sim = simulate(schedule, v=v, forward_cost=[1 + 0.25 * g for g in range(p * v)],
                   backward_cost=[2 + 0.5 * (g % 3) for g in range(p * v)])
    assert (sim.makespan, sim.busy, sim.peak_in_flight) == BEFORE_SPLIT[key]
    assert sim.peak_activations == [n / v for n in sim.peak_in_flight]


def test_shared_processors_give_a_waiting_ranks_share_to_the_busy_one():
    # GPipe, p = 2, m = 2, F = 1, B = 2, two ranks per processor (o = 2): rank 0's F0 runs alone
    # at twice the speed (0.5), then F1 beside rank 1's F0 at speed 1 (to 1.5), rank 1's F1
    # alone (2.0), its B0 alone (3.0), B1 beside rank 0's B0 (5.0), rank 0's B1 alone (6.0):
    # the step is the total work over the two processors, where unshared it is 9.
    sim = simulate(gpipe(2, 2), forward_cost=1.0, backward_cost=2.0, oversubscription=2.0)
    assert sim.makespan == 6.0 and sim.busy == [4.5, 4.5]
    assert [(a.kind, start, end) for a, start, end in sim.timeline[1]] == [
        ("F", 0.5, 1.5), ("F", 1.5, 2.0), ("B", 2.0, 3.0), ("B", 3.0, 5.0)]
    unshared = simulate(gpipe(2, 2), forward_cost=1.0, backward_cost=2.0)
    assert unshared.makespan == 9.0 and unshared.busy == [6.0, 6.0]


@pytest.mark.parametrize("o", [1.5, 3.0])
def test_shared_processors_never_beat_the_total_work_nor_run_past_the_unshared_step(o):
    lists = one_f_one_b(4, 8)
    costs = {"forward_cost": [1 + 0.25 * g for g in range(4)],
             "backward_cost": [2 + 0.5 * (g % 3) for g in range(4)]}
    unshared, shared = simulate(lists, **costs), simulate(lists, **costs, oversubscription=o)
    assert sum(unshared.busy) / 4 <= shared.makespan < unshared.makespan
    assert all(b <= shared.makespan for b in shared.busy)
