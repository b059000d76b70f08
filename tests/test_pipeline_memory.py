"""A pipeline rank's boundary tensors (forward outputs, sends not yet waited, received
gradients) are bounded by the schedule and pp, not by the micro-batches (issue 54 item 1)."""

import pytest
import torch
from harness import run_on_ranks, worker_mesh

from meshtrain.parallel.runtime.pipeline import run_schedule
from meshtrain.parallel.schedules.catalog import SCHEDULES
from meshtrain.parallel.schedules.flush import one_f_one_b
from meshtrain.parallel.schedules.releases import held_boundary_tensors, send_releases

SHAPE = (1, 8, 16)  # [micro, s, h]


def _held(name: str, p: int, m: int) -> list[int]:
    kind = SCHEDULES[name]
    v = kind.chunks_per_rank(p, 2 if kind.takes_virtual_stages else 1)
    lists = kind.step_lists(p, m, v=v)
    releases = send_releases(lists, kind.placement)
    return [held_boundary_tensors(actions, releases[r], r, p, v, kind.placement)
            for r, actions in enumerate(lists)]


@pytest.mark.parametrize("name", sorted(set(SCHEDULES) - {"gpipe"}))
def test_every_schedule_holds_as_many_boundary_tensors_at_8_and_64_micro_batches(name):
    assert _held(name, 4, 8) == _held(name, 4, 64)
    assert min(_held("gpipe", 4, 64)[:3]) >= 64  # every forward is in flight by design


def test_1f1b_holds_its_in_flight_outputs_a_received_and_a_sent_gradient():
    # rank s < p - 1 keeps p - s forwards' outputs, the gradient received for the oldest and
    # (not the first) one sent input gradient; the last stage's outputs are losses, and its
    # gradient sends wait for the previous stage's next activation
    assert _held("1f1b", 4, 32) == [5, 5, 4, 2]


def _run(m: int, wait_all_at_end: bool) -> tuple[int, list[float]]:
    """pp 2 1F1B on a linear stage: the runtime's peak of distinct boundary tensors, losses."""
    mesh = worker_mesh(tp=1, pp=2, dp=1)
    torch.manual_seed(0)
    layer = torch.nn.Linear(SHAPE[-1], SHAPE[-1])
    lists = one_f_one_b(2, m)
    releases = None if wait_all_at_end else send_releases(lists)[mesh.pp.rank]
    batches = [(torch.randn(SHAPE),) for _ in range(m)]
    run = run_schedule(lists[mesh.pp.rank], stage=lambda x, chunk, batch: (layer(x), 0.0),
                       loss_fn=lambda out, batch: out.square().mean(), micro_batches=batches,
                       mesh=mesh, activation_shape=SHAPE, dtype=torch.float32,
                       releases=releases)
    return run.peak_boundary_tensors, [loss.item() for loss in run.losses] + [
        layer.weight.grad.sum().item()]


def _runs(ms):
    return [_run(m, wait_all_at_end) for wait_all_at_end in (False, True) for m in ms]


def test_pp2_1f1b_runtime_holds_the_same_boundary_tensors_at_4_and_16_micro_batches():
    ranks = run_on_ranks(2, _runs, (4, 16))
    # the count the runtime saw in its own state, equal to the schedule's bound
    bound = _held("1f1b", 2, 16)
    assert [[peak for peak, _ in rank[:2]] for rank in ranks] == [[bound[0]] * 2, [bound[1]] * 2]
    # waiting every send at the end instead keeps one per micro-batch (and the gradient
    # received last), computing the same
    assert [peak for peak, _ in ranks[0][2:]] == [4 + 1, 16 + 1]
    assert [[r for _, r in rank[:2]] for rank in ranks] == [[r for _, r in rank[2:]]
                                                              for rank in ranks]
