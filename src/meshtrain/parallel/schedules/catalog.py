"""The pipeline schedules meshtrain has, by the `pp_schedule` name: the one list.

Adding a schedule is its file (a `PipelineSchedule` and its generator) and one line here.
"""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.parallel.schedules.eager_1f1b import EAGER_1F1B
from meshtrain.parallel.schedules.flush import GPIPE, ONE_F_ONE_B
from meshtrain.parallel.schedules.interleaved import INTERLEAVED
from meshtrain.parallel.schedules.pipedream import PIPEDREAM_2BW
from meshtrain.parallel.schedules.schedule import PipelineSchedule
from meshtrain.parallel.schedules.zero_bubble import ZB_H1, ZB_V

SCHEDULES: dict[str, PipelineSchedule] = {
    schedule.name: schedule for schedule in (GPIPE, ONE_F_ONE_B, INTERLEAVED, PIPEDREAM_2BW,
                                             ZB_H1, ZB_V, EAGER_1F1B)}

DEFAULT_SCHEDULE = ONE_F_ONE_B.name
PP_SCHEDULES = tuple(SCHEDULES)
"""The `pp_schedule` choices."""
SEARCHED_SCHEDULES = tuple(s.name for s in SCHEDULES.values() if s.searched)
"""What the planner's search chooses among when the schedule is not fixed."""
MEGATRON_SCHEDULES = tuple(s.name for s in SCHEDULES.values() if s.megatron)
"""The schedules Megatron-LM has."""


def pipeline_schedule(name: str) -> PipelineSchedule:
    """The schedule called `name`; SettingError naming the choices otherwise."""
    if name not in SCHEDULES:
        raise SettingError(Code.CHOICE, f"`pp_schedule` must be one of {', '.join(SCHEDULES)},"
                                        f" got {name!r}")
    return SCHEDULES[name]


def schedules_help() -> str:
    """The `pp_schedule` setting's help: every schedule, with its summary."""
    return "pipeline schedule: " + ", ".join(
        s.name + (f" ({s.summary})" if s.summary else "") for s in SCHEDULES.values())
