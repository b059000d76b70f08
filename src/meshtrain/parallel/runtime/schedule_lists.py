"""Every pipeline schedule's action lists by its `pp_schedule` name: the one table the executor
and the planner's simulation both read (`schedules.py` and `zero_bubble.py` hold the
generators)."""

from __future__ import annotations

from meshtrain.parallel.runtime import schedules
from meshtrain.parallel.runtime.zero_bubble import ChunkCosts, zb_h1, zb_v


def action_lists(schedule: str, p: int, m: int, *, v: int = 1, steps: int = 1,
                 chunk_costs: ChunkCosts | None = None) -> list[list[schedules.Action]]:
    """Per pipeline rank, the actions of `schedule` for m micro-batches (v chunks per rank
    under interleaved; 2bw over `steps` optimizer steps; zb-v's order chosen on
    `chunk_costs` where given)."""
    if schedule == "interleaved":
        return schedules.interleaved(p, m, v)
    if schedule == "2bw":
        return schedules.pipedream_2bw(p, m, steps)
    if schedule == "zb-v":
        return zb_v(p, m, chunk_costs)
    generators = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b, "zb-h1": zb_h1}
    return generators[schedule](p, m)
