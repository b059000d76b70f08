"""ParallelMesh: degrees, rank layout, groups."""

import pytest
import torch
from harness import RankPool, raises_as_flags, run_on_ranks, worker_mesh

from meshtrain.mesh import _axis_groups, resolve_degrees
from meshtrain.parallel.communication.comm import all_gather


def test_resolve_degrees_derives_dp():
    assert resolve_degrees(8, tp=2, pp=2) == {"pp": 2, "dp": 2, "cp": 1, "tp": 2, "ep": 1}
    assert resolve_degrees(8, tp=2, cp=2, ep=2)["dp"] == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp=3), r"world size 8 is not divisible by tp x pp x cp = 3 x 1 x 1"),
    (dict(tp=2, dp=2), r"pp x dp x cp x tp = 1 x 2 x 1 x 2 = 4 does not equal the world size 8"),
    (dict(tp=0), r"--tp must be a positive integer"),
    (dict(tp=2, ep=3), r"ep=3 must divide dp x cp = 4 x 1 = 4"),
    (dict(tp=2, ep=8), r"ep=8 must divide dp x cp = 4 x 1 = 4.*or set --etp 1"),
    (dict(tp=2, ep=16, etp=1), r"--ep x --etp = 16 x 1 must divide tp x dp x cp = 2 x 4 x 1"),
    (dict(tp=2, etp=4), r"--etp 4 must be 1 \(whole experts\) or --tp 2"),
])
def test_resolve_degrees_rejects(kwargs, match):
    with raises_as_flags(match):
        resolve_degrees(8, **kwargs)


def test_whole_experts_let_ep_span_tp():
    assert resolve_degrees(8, tp=2, ep=8, etp=1)["dp"] == 4  # ep x etp = 8 divides 2 x 4
    assert resolve_degrees(8, tp=2, ep=4, etp=2)["ep"] == 4  # etp = tp: today's rule


def test_axis_order_puts_tp_innermost():
    degrees = {"pp": 2, "dp": 2, "cp": 1, "tp": 2, "ep": 1}
    assert _axis_groups(degrees, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _axis_groups(degrees, ("dp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _axis_groups(degrees, ("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    cp_degrees = {"pp": 1, "dp": 2, "cp": 2, "tp": 2, "ep": 1}
    assert _axis_groups(cp_degrees, ("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _check_mesh_8():
    mesh = worker_mesh(tp=2, pp=2, ep=2)
    rank = mesh.rank
    assert mesh.coords == {"tp": rank % 2, "cp": 0, "dp": (rank // 2) % 2, "pp": rank // 4}
    for name in ("tp", "dp", "pp", "dp_cp", "ep", "edp"):
        axis = mesh.axis(name)
        assert axis.ranks[axis.rank] == rank
        # The group really connects the ranks it claims to.
        got = all_gather(torch.tensor([rank]), axis, dim=0)
        assert got.tolist() == list(axis.ranks), name
    assert mesh.ep.size == 2 and mesh.axis("edp").size == 1
    return mesh.coords


def test_mesh_on_8_ranks():
    coords = run_on_ranks(8, _check_mesh_8)
    assert len({tuple(c.values()) for c in coords}) == 8


def test_init_parallel_mismatch_names_world():
    run_on_ranks(2, _check_mismatch)


def _check_mismatch():
    from meshtrain import init_parallel

    with pytest.raises(ValueError, match="does not equal the world size 2"):
        init_parallel(tp=2, dp=2)


def test_one_gpu_per_local_rank(monkeypatch):
    from meshtrain.parallel.runtime.process_groups import check_local_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_local_devices("auto", 1)
    check_local_devices("cpu", 4)
    with pytest.raises(ValueError, match="2 local ranks need 2 GPUs but 1 are visible"):
        check_local_devices("auto", 2)


def test_a_script_that_forgets_destroy_parallel_still_tears_the_groups_down_at_exit():
    """Gloo's threads abort the process ("terminate called without an active exception") when
    the groups die in the interpreter's own teardown: `init_parallel` tears them down at exit
    (benchmarks/bench_clean_exit.py counts the aborts over many 4-rank runs)."""
    import subprocess
    import sys

    script = ("import atexit, torch.distributed as dist, meshtrain\n"
              "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
              "meshtrain.init_parallel(device='cpu')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout == "initialized at exit: False\n", done.stderr


def _groups_alive() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


def _build_a_mesh() -> int:
    from meshtrain import init_parallel

    init_parallel(tp=2, device="cpu")  # as a run in a task does, its groups left behind
    return _groups_alive()


def test_a_pool_task_leaves_no_process_groups_behind():
    """Gloo polls every group's sockets each 10 ms: groups left in idle pools slowed the suite by
    a third, so the pool destroys what a task made beyond its cached meshes."""
    before = run_on_ranks(2, _groups_alive)
    during = run_on_ranks(2, _build_a_mesh)
    assert all(d > b for d, b in zip(during, before, strict=True))
    assert run_on_ranks(2, _groups_alive) == before


_kept = {}  # in a benchmark pool's workers: a group one task makes for later tasks


def _keep_a_group() -> None:
    _kept["group"] = torch.distributed.new_group([0, 1])


def _send_on_the_kept_group() -> float:
    """Point-to-point calls look the group up (a destroyed one is 'not registered')."""
    x = torch.full((1,), 1.0 + torch.distributed.get_rank())
    peer = 1 - torch.distributed.get_rank()
    sent = torch.distributed.isend(x.clone(), group=_kept["group"], group_dst=peer)
    torch.distributed.recv(x, group=_kept["group"], group_src=peer)
    sent.wait()
    return x.item()


def test_a_benchmark_pool_keeps_a_tasks_groups_for_later_tasks():
    """The benchmarks build their contenders (meshes, groups) in one task and time them in
    others: their pools destroy nothing between tasks."""
    with RankPool(2) as pool:
        pool.run(_keep_a_group)
        assert pool.run(_send_on_the_kept_group) == [2.0, 1.0]
