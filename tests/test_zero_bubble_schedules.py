"""Zero-bubble schedules (ZB-H1, ZB-V) as data: closed forms of their bubbles and peaks, and
hand-worked small cases, on the simulator with the backward split into I and W.

Costs are equal, F = I = W = 1 per whole stage (so a fused B = 2), and a makespan is in those
units. The closed forms tested (p stages, m micro-batches, bubble = makespan - m(F + I + W)):
1F1B (p - 1)(F + B) = 3(p - 1); ZB-H1 (p - 1)(F + I - W) = p - 1 for m >= p, a third of 1F1B's
(the paper's "(p - 1)/3m bubble rate" is this bubble over the work 3m); ZB-V (p - 1)F/2 for
m >= 2p - 1, the least a V placement allows (rank p - 1 waits p - 1 half-stage forwards before
its first), a sixth of 1F1B's and half of ZB-H1's; below that, at most ZB-H1's.
"""

import pytest

from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    RECV_ACTIVATION,
    RECV_GRAD,
    SEND_ACTIVATION,
    SEND_GRAD,
    WEIGHT_GRAD,
    Action,
    model_chunk,
    v_shape_chunk,
)
from meshtrain.parallel.schedules.flush import one_f_one_b
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.parallel.schedules.zero_bubble import estimated_costs, zb_h1, zb_v

LAYOUTS = [(p, m) for p in range(2, 9) for m in range(p, 3 * p + 1)]
COMPUTE = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


def simulate_v(schedule):
    return simulate(schedule, v=2, placement=v_shape_chunk)


def compute_order(actions) -> str:
    """'F0 I0 W0 ...' (with '.chunk' for two-chunk schedules): the compute actions in order."""
    chunks = any(a.chunk for a in actions)
    return " ".join(f"{a.kind}{a.micro}" + (f".{a.chunk}" if chunks else "")
                    for a in actions if a.kind in COMPUTE)


@pytest.mark.parametrize("p,m", LAYOUTS)
def test_1f1b_bubble_is_p_minus_1_times_f_plus_b(p, m):
    assert simulate(one_f_one_b(p, m)).makespan == m * 3 + (p - 1) * 3


@pytest.mark.parametrize("p,m", LAYOUTS)
def test_zb_h1_bubble_is_a_third_of_1f1b_at_1f1b_peak(p, m):
    sim = simulate(zb_h1(p, m))
    assert sim.makespan == m * 3 + (p - 1) * (1 + 1 - 1)
    for s in range(p):
        assert sim.idle_fraction(s) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    # every rank holds p micro-batches at its peak: 1F1B's rank 0, nobody more
    assert sim.peak_in_flight == [p] * p == [max(simulate(one_f_one_b(p, m)).peak_in_flight)] * p


@pytest.mark.parametrize("p,m", LAYOUTS)
def test_zb_v_bubble_is_the_v_minimum_at_1f1b_peak(p, m):
    sim = simulate_v(zb_v(p, m))
    if m >= 2 * p - 1:
        assert sim.makespan == m * 3 + (p - 1) * 0.5
    else:
        assert m * 3 + (p - 1) * 0.5 <= sim.makespan <= simulate(zb_h1(p, m)).makespan
    # chunks hold half a stage each: at most p stages' activations, 1F1B's rank-0 peak
    assert max(sim.peak_in_flight) <= 2 * p
    assert max(sim.peak_activations) <= max(simulate(one_f_one_b(p, m)).peak_activations) == p


@pytest.mark.parametrize("p,m", [(1, 1), (1, 3), (2, 1), (3, 2), (4, 5), (8, 3)])
def test_zero_bubble_schedules_run_with_few_micro_batches(p, m):
    """Below p (ZB-H1) or 2p - 1 (ZB-V) micro-batches the orders still run, at most at 1F1B's
    makespan, holding no more than m micro-batches."""
    one_f = simulate(one_f_one_b(p, m)).makespan
    for sim in (simulate(zb_h1(p, m)), simulate_v(zb_v(p, m))):
        assert sim.makespan <= one_f
        assert max(sim.peak_activations) <= min(m, p)


def zb_v_on_costs(p: int, m: int):
    """zb-v as the runtime builds it: the order chosen on estimated chunk costs (here a
    layer each, a head of half a layer, attention a tenth)."""
    return zb_v(p, m, estimated_costs((1,) * (2 * p), 0.5, 0.1))


@pytest.mark.parametrize("generator,v", [(zb_h1, 1), (zb_v, 2), (zb_v_on_costs, 2)])
@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (4, 8), (3, 7), (5, 5), (4, 2)])
def test_every_f_i_w_once_with_matching_communication(generator, v, p, m):
    placement = v_shape_chunk if v == 2 else model_chunk
    last = p * v - 1
    for s, actions in enumerate(generator(p, m)):
        computed = sorted((a.kind, a.micro, a.chunk) for a in actions if a.kind in COMPUTE)
        assert computed == sorted((k, i, c) for k in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)
                                  for i in range(m) for c in range(v))
        transfers = 0
        for i, a in enumerate(actions):
            g = placement(s, a.chunk, p)
            before, after = actions[i - 1], actions[min(i + 1, len(actions) - 1)]
            if a.kind == FORWARD:
                transfers += (g > 0) + (g < last)
                assert (before == Action(RECV_ACTIVATION, a.micro, a.chunk)) == (g > 0)
                assert (after == Action(SEND_ACTIVATION, a.micro, a.chunk)) == (g < last)
            elif a.kind == INPUT_GRAD:
                transfers += (g > 0) + (g < last)
                assert (before == Action(RECV_GRAD, a.micro, a.chunk)) == (g < last)
                assert (after == Action(SEND_GRAD, a.micro, a.chunk)) == (g > 0)
        # the transfers around F and I are all there are: W communicates nothing
        assert len(actions) == 3 * m * v + transfers + 1  # + the optimizer step
        # per chunk, every kind runs its micro-batches in order (transfers match in issue order)
        for kind in (FORWARD, INPUT_GRAD, WEIGHT_GRAD):
            for c in range(v):
                micros = [a.micro for a in actions if (a.kind, a.chunk) == (kind, c)]
                assert micros == list(range(m))


def test_zb_h1_by_hand_p2():
    """Rank 0 warms up with one forward and defers nothing; rank 1 defers its first W."""
    assert [compute_order(r) for r in zb_h1(2, 2)] == ["F0 F1 I0 W0 I1 W1", "F0 I0 F1 I1 W0 W1"]
    assert [compute_order(r) for r in zb_h1(2, 4)] == [
        "F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3",
        "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3"]
    assert zb_h1(2, 2)[1][:7] == [
        Action(RECV_ACTIVATION, 0), Action(FORWARD, 0), Action(INPUT_GRAD, 0),
        Action(SEND_GRAD, 0), Action(RECV_ACTIVATION, 1), Action(FORWARD, 1),
        Action(INPUT_GRAD, 1)]
    # rank 0 waits one step for I0 (F1 ends at 2, rank 1's I0 at 3): bubble p - 1 = 1
    sim = simulate(zb_h1(2, 4))
    assert [(a.kind, a.micro, start) for a, start, _ in sim.timeline[0][:4]] == [
        (FORWARD, 0, 0.0), (FORWARD, 1, 1.0), (INPUT_GRAD, 0, 3.0), (WEIGHT_GRAD, 0, 4.0)]
    assert sim.makespan == 13.0 and sim.peak_in_flight == [2, 2]


def test_zb_v_by_hand_p2():
    """Rank 0 holds global chunks 0 and 3 (the loss), rank 1 chunks 1 and 2. m = 4 >= 2p - 1:
    warm-up F0.0 F1.0 F2.0 on rank 0 (2(p - r) - 1 = 3), then (F1, I1, W1) twice; rank 1 one
    forward, one (F1, F0) pair, one (F1, I1, W1), and both settle into F0 I0 W0 F1 I1 W1."""
    assert [compute_order(r) for r in zb_v(2, 4)] == [
        "F0.0 F1.0 F2.0 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F3.0 I0.0 W0.0 F2.1 I2.1 W2.1 I1.0 W1.0"
        " F3.1 I3.1 W3.1 I2.0 W2.0 I3.0 W3.0",
        "F0.0 F0.1 F1.0 F1.1 I0.1 W0.1 F2.0 I0.0 W0.0 F2.1 I1.1 W1.1 F3.0 I1.0 W1.0 F3.1 I2.1"
        " W2.1 I2.0 I3.1 I3.0 W2.0 W3.1 W3.0"]
    # m = 2 < 2p - 1: the order for three micro-batches with micro-batch 2 left out
    assert [compute_order(r) for r in zb_v(2, 2)] == [
        "F0.0 F1.0 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 I0.0 W0.0 I1.0 W1.0",
        "F0.0 F0.1 F1.0 F1.1 I0.1 W0.1 I0.0 W0.0 I1.1 W1.1 I1.0 W1.0"]
    # the turn of the V (chunk 1 -> 2) stays on rank 1 but keeps its send/receive pair
    assert zb_v(2, 2)[1][:6] == [
        Action(RECV_ACTIVATION, 0, 0), Action(FORWARD, 0, 0), Action(SEND_ACTIVATION, 0, 0),
        Action(RECV_ACTIVATION, 0, 1), Action(FORWARD, 0, 1), Action(SEND_ACTIVATION, 0, 1)]
    sim = simulate_v(zb_v(2, 4))  # half-stage chunks: F = I = W = 0.5
    assert sim.makespan == 12.5 and sim.peak_in_flight == [4, 4]
    assert sim.peak_activations == [2.0, 2.0]


def test_split_backward_costs_and_dependencies():
    """I and W cost half of B each unless given; W waits for its own I, I (and B) for the next
    chunk's I or B and, on the last chunk, its own F; a W before its I never runs."""
    split = [[b for a in rank for b in ([Action(INPUT_GRAD, a.micro), Action(WEIGHT_GRAD, a.micro)]
                                        if a.kind == BACKWARD else [a])]
             for rank in one_f_one_b(4, 8)]
    costs = {"forward_cost": 1.5, "backward_cost": [2, 3, 4, 5]}
    fused, halves = simulate(one_f_one_b(4, 8), **costs), simulate(split, **costs)
    # the same work; the upstream stage starts its backward after I, not after all of B
    assert halves.busy == fused.busy and halves.makespan < fused.makespan
    sim = simulate(zb_h1(4, 8), input_grad_cost=1.0, weight_grad_cost=0.0)
    assert sim.makespan == 8 * 2 + 3 * 2  # W free: 1F1B with B = I
    mixed = [[Action(FORWARD, 0), Action(BACKWARD, 0)], [Action(FORWARD, 0), Action(INPUT_GRAD, 0),
                                                         Action(WEIGHT_GRAD, 0)]]
    assert simulate(mixed).makespan == 1 + 1 + 1 + 2  # B on rank 0 waits for rank 1's I
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate([[Action(FORWARD, 0), Action(WEIGHT_GRAD, 0), Action(INPUT_GRAD, 0)]])
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate([[Action(FORWARD, 0), Action(INPUT_GRAD, 0)], [Action(INPUT_GRAD, 0)]])


def test_v_placement():
    assert [[v_shape_chunk(r, c, 4) for c in (0, 1)] for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    with pytest.raises(ValueError, match="two chunks"):
        v_shape_chunk(0, 2, 4)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 3), (8, 16), (8, 5)])
@pytest.mark.parametrize("layers,head,attention", [((1,), 0.5, 0.0), ((2,), 1.0, 0.1),
                                                   ((1, 2, 1, 1), 1.0, 0.04)])
def test_zb_v_on_chunk_costs_is_never_longer_than_handcrafted_at_its_peak(p, m, layers, head,
                                                                          attention):
    """The first chunk's I is empty and the last holds the output layer: on such costs the
    chosen order finishes no later than the handcrafted one, holding no more."""
    costs = estimated_costs(tuple(layers[g % len(layers)] for g in range(2 * p)), head, attention)

    def run(schedule):
        return simulate(schedule, forward_cost=list(costs.forward), v=2,
                        backward_cost=[i + w for i, w in zip(costs.input_grad, costs.weight_grad,
                                                             strict=True)],
                        input_grad_cost=list(costs.input_grad),
                        weight_grad_cost=list(costs.weight_grad), placement=v_shape_chunk)
    chosen, hand = run(zb_v(p, m, costs)), run(zb_v(p, m))
    assert chosen.makespan <= hand.makespan
    assert max(chosen.peak_in_flight) <= 2 * p


def test_zb_v_on_costs_beats_handcrafted_where_the_first_chunk_has_no_input_gradient():
    """p 8, m 16, a layer per chunk, a head of half a layer: 120 against 125.5 layer-times."""
    costs = estimated_costs((1,) * 16, 0.5, 0.0)
    kwargs = dict(forward_cost=list(costs.forward), v=2, placement=v_shape_chunk,
                  backward_cost=[i + w for i, w in zip(costs.input_grad, costs.weight_grad,
                                                       strict=True)],
                  input_grad_cost=list(costs.input_grad), weight_grad_cost=list(costs.weight_grad))
    assert simulate(zb_v(8, 16), **kwargs).makespan == 125.5
    assert simulate(zb_v(8, 16, costs), **kwargs).makespan == 120.0
