"""Timeline of one real pipeline step: what each stage computed and when, as a Chrome/Perfetto
trace and a picture, and its idle time next to what `simulate` predicts for the same schedule.

`run_schedule(..., timeline=events)` records (kind, micro, chunk, start, end) per action on each
rank; `gather_timeline` brings every stage's events to one place on a common clock and
`write_trace` writes DIR/pipeline.json (open it in ui.perfetto.dev or chrome://tracing),
DIR/pipeline.png (with matplotlib) and DIR/pipeline_idle.json.

Clocks: every stage passes a barrier over the pp axis just before the step and takes its exit
from the barrier as its time zero. Processes on one host share `time.perf_counter()` (a
system-wide monotonic clock), so there the earliest exit is everyone's zero and cross-stage
order is exact; across hosts each stage's own exit is its zero, off by the barrier's skew (about
one message latency). Times are host times: on CUDA, kernels run asynchronously, so a stage that
does not synchronize shows launches rather than execution.
"""

from __future__ import annotations

import json
import socket
import statistics
from pathlib import Path

from meshtrain.mesh import MeshAxis
from meshtrain.parallel.communication import comm
from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    INPUT_GRAD,
    OPTIMIZER_STEP,
    WEIGHT_GRAD,
    Action,
    Placement,
    model_chunk,
)
from meshtrain.parallel.schedules.catalog import DEFAULT_SCHEDULE, pipeline_schedule
from meshtrain.parallel.schedules.simulator import simulate
from meshtrain.training.plots import plot_pipeline_timeline

Event = tuple[str, int, int, float, float]  # kind, micro-batch, local chunk, start s, end s
COMPUTE = (FORWARD, BACKWARD, INPUT_GRAD, WEIGHT_GRAD)


def gather_timeline(events: list[Event], origin: float, axis: MeshAxis) -> list[list[Event]]:
    """Every stage's events, in pp-rank order, in seconds since the step's start (see the
    module docstring for the clock). Collective over the pp `axis`; `origin` is this rank's
    `time.perf_counter()` right after the barrier that starts the step."""
    parts = comm.all_gather_objects((socket.gethostname(), origin, events), axis)
    shared_clock = len({host for host, _, _ in parts}) == 1
    earliest = min(zero for _, zero, _ in parts)
    stages = []
    for _, zero, stage in parts:
        zero = earliest if shared_clock else zero
        stages.append([(kind, i, c, start - zero, end - zero) for kind, i, c, start, end in stage])
    return stages


def idle_report(stages: list[list[Event]], placement: Placement = model_chunk) -> dict:
    """Measured idle fraction per stage (1 - busy / makespan, where busy is the stage's
    forwards and backwards, or input- and weight-gradient actions, and the makespan runs from
    the step's first forward to its last backward on any stage), next to `simulate` on the
    same action lists with each model chunk's mean time of each kind (so unequal stages
    idle as measured; communication is free, and `chunk_ms` gives those means per global
    chunk); `placement` is the schedule's (`PipelineSchedule.placement`)."""
    compute = [[e for e in stage if e[0] in COMPUTE] for stage in stages]
    begin = min(e[3] for stage in compute for e in stage)
    makespan = max(e[4] for stage in compute for e in stage) - begin
    v = 1 + max(e[2] for stage in compute for e in stage)  # model chunks per rank

    def mean(kind: str, events) -> float:
        times = [end - start for k, _, _, start, end in events if k == kind]
        return statistics.fmean(times) if times else 0.0

    everywhere = [e for stage in compute for e in stage]
    p = len(stages)
    by_chunk: list[list[Event]] = [[] for _ in range(p * v)]
    for s, stage in enumerate(compute):
        for e in stage:
            by_chunk[placement(s, e[2], p)].append(e)

    def costs(kind: str) -> list[float]:  # each global chunk's own mean: unequal stages
        return [mean(kind, events) for events in by_chunk]

    schedule = [[Action(kind, i, c) for kind, i, c, _, _ in stage if kind != OPTIMIZER_STEP]
                for stage in stages]
    sim = simulate(schedule, forward_cost=costs(FORWARD), backward_cost=costs(BACKWARD), v=v,
                   input_grad_cost=costs(INPUT_GRAD), weight_grad_cost=costs(WEIGHT_GRAD),
                   placement=placement)
    rows = []
    for s, stage in enumerate(compute):
        busy = sum(end - start for *_, start, end in stage)
        rows.append({"stage": s, "busy_ms": 1e3 * busy,
                     **{f"{name}_ms": 1e3 * mean(kind, stage) for kind, name in _KINDS},
                     "idle_measured": 1.0 - busy / makespan,
                     "idle_simulated": sim.idle_fraction(s)})
    return {"num_stages": len(stages), "chunks_per_stage": v,
            "num_micro_batches": sum(e[0] == FORWARD for e in compute[0]) // v,
            **{f"{name}_ms": 1e3 * mean(kind, everywhere) for kind, name in _KINDS},
            "makespan_ms": {"measured": 1e3 * makespan, "simulated": 1e3 * sim.makespan},
            "chunk_ms": {name: [1e3 * x for x in costs(kind)] for kind, name in _KINDS},
            "stages": rows}


_KINDS = ((FORWARD, "forward"), (BACKWARD, "backward"), (INPUT_GRAD, "input_grad"),
          (WEIGHT_GRAD, "weight_grad"))


def chrome_trace(stages: list[list[Event]], meta: dict) -> dict:
    """Chrome trace-event JSON: a process per stage, forwards and backwards ("F3", "B3") on its
    compute thread, sends and receive waits on its p2p thread; ts and dur in microseconds."""
    events: list[dict] = []
    for s, stage in enumerate(stages):
        events += [{"ph": "M", "name": "process_name", "pid": s, "args": {"name": f"stage {s}"}},
                   {"ph": "M", "name": "process_sort_index", "pid": s, "args": {"sort_index": s}},
                   {"ph": "M", "name": "thread_name", "pid": s, "tid": 0,
                    "args": {"name": "compute"}},
                   {"ph": "M", "name": "thread_name", "pid": s, "tid": 1, "args": {"name": "p2p"}}]
        for kind, i, chunk, start, end in stage:
            if kind == OPTIMIZER_STEP:
                continue
            is_compute = kind in COMPUTE
            events.append({"ph": "X", "name": f"{kind}{i}" if is_compute else f"{kind} {i}",
                           "cat": "compute" if is_compute else "p2p", "pid": s,
                           "tid": 0 if is_compute else 1, "ts": 1e6 * start,
                           "dur": 1e6 * (end - start), "args": {"micro": i, "chunk": chunk}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def write_trace(out_dir: Path, stages: list[list[Event]], meta: dict) -> dict:
    """Write pipeline.json, pipeline_idle.json and (with matplotlib) pipeline.png into
    `out_dir`; returns the idle report with `png` telling whether the picture was drawn."""
    out_dir.mkdir(parents=True, exist_ok=True)
    schedule = pipeline_schedule(meta.get("schedule", DEFAULT_SCHEDULE))
    report = meta | idle_report(stages, schedule.placement)
    (out_dir / "pipeline.json").write_text(json.dumps(chrome_trace(stages, meta)))
    idle = ", ".join(f"{r['idle_measured']:.0%}" for r in report["stages"])
    title = " ".join(f"{k}={v}" for k, v in meta.items()) + f"; idle per stage {idle}"
    report["png"] = plot_pipeline_timeline(stages, out_dir / "pipeline.png", title=title)
    (out_dir / "pipeline_idle.json").write_text(json.dumps(report, indent=1))
    return report
