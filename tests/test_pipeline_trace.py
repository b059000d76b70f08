"""The pipeline timeline (--trace): one box per forward and backward (or I and W), in dependency
order, and idle fractions that agree with the simulator when fed its own timeline."""

import importlib.util
import json

import pytest
from harness import run_on_ranks, worker_mesh
from test_pipeline import _cfg

from meshtrain.parallel.schedules.actions import BACKWARD, FORWARD, v_shape_chunk
from meshtrain.parallel.schedules.flush import gpipe, one_f_one_b
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.parallel.schedules.zero_bubble import zb_h1, zb_v
from meshtrain.training.pipeline_trace import idle_report, write_trace
from meshtrain.training.trainer import Trainer

SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe}


def _traced_step(corpus, schedule, out):
    trainer = Trainer.build(_cfg(corpus, schedule), worker_mesh(tp=1, pp=2, dp=1))
    trainer.train_step(0)
    return trainer.traced_train_step(1, out)[1]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trace_of_a_real_pipeline_step(corpus, tmp_path, schedule):
    report = run_on_ranks(2, _traced_step, corpus, schedule, tmp_path)[0]
    p, m = 2, 4  # global batch 8 in micro-batches of 2
    trace = json.loads((tmp_path / "pipeline.json").read_text())
    assert trace["otherData"] == {"schedule": schedule, "pp": p, "step": 2}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "stage 0", 1: "stage 1"}
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert all({"name", "ts", "dur", "pid", "tid", "args"} <= e.keys() for e in boxes)
    span: dict[tuple[str, int, int], tuple[float, float]] = {}
    for s in range(p):
        mine = sorted((e for e in boxes if e["pid"] == s), key=lambda e: e["ts"])
        # exactly one F and one B per micro-batch, in the schedule's order, never overlapping
        expected = [f"{a.kind}{a.micro}" for a in SCHEDULES[schedule](p, m)[s]
                    if a.kind in (FORWARD, BACKWARD)]
        assert [e["name"] for e in mine] == expected
        for before, after in zip(mine, mine[1:], strict=False):
            assert after["ts"] >= before["ts"] + before["dur"]
        span |= {(e["name"][0], e["args"]["micro"], s): (e["ts"], e["ts"] + e["dur"])
                 for e in mine}
    for i in range(m):
        for s in range(p - 1):
            assert span[FORWARD, i, s + 1][0] >= span[FORWARD, i, s][1]
            assert span[BACKWARD, i, s][0] >= span[BACKWARD, i, s + 1][1]
    idle = json.loads((tmp_path / "pipeline_idle.json").read_text())
    assert idle["num_micro_batches"] == m and len(idle["stages"]) == p
    makespan = idle["makespan_ms"]["measured"]
    for row in idle["stages"]:
        assert row["idle_measured"] == pytest.approx(1 - row["busy_ms"] / makespan)
        assert 0 < row["idle_measured"] < 1
        # the simulator runs each stage's own measured times: its busy time is the stage's
        simulated = idle["makespan_ms"]["simulated"]
        assert row["idle_simulated"] == pytest.approx(1 - row["busy_ms"] / simulated)
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert report["png"] == has_matplotlib == (tmp_path / "pipeline.png").is_file()


def _traced_zero_bubble_step(corpus, schedule, out):
    """The traced step, and this rank's actions as its executor built them (zb-v: the order
    chosen on its chunk costs, which must be `zb_v`'s on them)."""
    trainer = Trainer.build(_cfg(corpus, schedule), worker_mesh(tp=1, pp=2, dp=1))
    trainer.train_step(0)
    trainer.traced_train_step(1, out)
    executor, m = trainer.executor, 4
    built = zb_v(2, m, executor.chunk_costs) if schedule == "zb-v" else zb_h1(2, m)
    assert executor.actions(m) == built[executor.mesh.pp.rank]
    return executor.actions(m)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_trace_shows_the_split_backward(corpus, tmp_path, schedule):
    """Zero-bubble steps: each stage's boxes are its F, I and W actions in the schedule's
    order (zb-v: chunk 1 labelled micro.1), never overlapping; the idle report times I and W."""
    actions = run_on_ranks(2, _traced_zero_bubble_step, corpus, schedule, tmp_path)
    p = 2
    trace = json.loads((tmp_path / "pipeline.json").read_text())
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    for s in range(p):
        mine = sorted((e for e in boxes if e["pid"] == s), key=lambda e: e["ts"])
        expected = [(f"{a.kind}{a.micro}", a.chunk) for a in actions[s] if a.kind in "FIW"]
        assert [(e["name"], e["args"]["chunk"]) for e in mine] == expected
        for before, after in zip(mine, mine[1:], strict=False):
            assert after["ts"] >= before["ts"] + before["dur"]
    idle = json.loads((tmp_path / "pipeline_idle.json").read_text())
    assert idle["input_grad_ms"] > 0 and idle["weight_grad_ms"] > 0 and idle["backward_ms"] == 0
    assert all(0 < row["idle_measured"] < 1 for row in idle["stages"])


def test_idle_of_a_zb_v_timeline_is_the_simulators():
    """The V placement reaches the simulator: fed its own zb-v timeline (I and W each half a
    backward), the report reproduces the simulated idle fractions."""
    sim = simulate(zb_v(4, 8), forward_cost=0.002, backward_cost=0.004, v=2,
                   placement=v_shape_chunk)
    stages = [[(a.kind, a.micro, a.chunk, start, end) for a, start, end in stage]
              for stage in sim.timeline]
    report = idle_report(stages, v_shape_chunk)
    # each global chunk's forward: the stage's 2 ms over its two chunks
    assert report["chunk_ms"]["forward"] == pytest.approx([1.0] * 8)
    assert report["makespan_ms"]["simulated"] == pytest.approx(1e3 * sim.makespan)
    for s, row in enumerate(report["stages"]):
        assert row["idle_measured"] == pytest.approx(sim.idle_fraction(s))
        assert row["idle_simulated"] == pytest.approx(sim.idle_fraction(s))


def _simulated_events(p, m):
    sim = simulate(one_f_one_b(p, m), forward_cost=0.001, backward_cost=0.002)
    return sim, [[(a.kind, a.micro, a.chunk, start, end) for a, start, end in stage]
                 for stage in sim.timeline]


def test_idle_of_the_simulators_own_timeline_is_the_simulators():
    sim, stages = _simulated_events(4, 8)
    report = idle_report(stages)
    assert report["makespan_ms"]["measured"] == pytest.approx(1e3 * sim.makespan)
    assert report["makespan_ms"]["simulated"] == pytest.approx(1e3 * sim.makespan)
    for s, row in enumerate(report["stages"]):
        assert row["idle_measured"] == pytest.approx(sim.idle_fraction(s))
        assert row["idle_simulated"] == pytest.approx(sim.idle_fraction(s))
    # 1F1B on equal stages: every stage idles (p - 1) / (m + p - 1) of the makespan
    assert report["stages"][0]["idle_measured"] == pytest.approx(3 / 11)


def test_timeline_png(tmp_path):
    pytest.importorskip("matplotlib")
    _, stages = _simulated_events(4, 8)
    assert write_trace(tmp_path, stages, {"schedule": "1f1b"})["png"]
    assert (tmp_path / "pipeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
