"""The flush schedules with one chunk per rank: GPipe (all forwards, then all backwards) and
1F1B / PipeDream-Flush (warm-up, one forward one backward, cool-down), which does GPipe's work
holding at most p micro-batches' activations instead of m."""

from __future__ import annotations

from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    OPTIMIZER_STEP,
    Action,
    check_counts,
    one_f_one_b_order,
    with_communication,
)
from meshtrain.parallel.schedules.schedule import PipelineSchedule


def gpipe(p: int, m: int) -> list[list[Action]]:
    check_counts(p, m)
    return [with_communication([Action(FORWARD, i) for i in range(m)]
                               + [Action(BACKWARD, i) for i in range(m)]
                               + [Action(OPTIMIZER_STEP)], s, p, 1) for s in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """PipeDream-Flush: stage s warms up with min(p - s - 1, m) forwards."""
    return warmed_one_f_one_b(p, m, lambda s: p - s - 1)


def warmed_one_f_one_b(p: int, m: int, warmup) -> list[list[Action]]:
    """1F1B with stage s warming up with min(`warmup`(s), m) forwards."""
    check_counts(p, m)
    ranks = []
    for s in range(p):
        order = one_f_one_b_order(min(warmup(s), m), m, lambda k: Action(FORWARD, k),
                                  lambda k: Action(BACKWARD, k))
        ranks.append(with_communication(order + [Action(OPTIMIZER_STEP)], s, p, 1))
    return ranks


class GPipe(PipelineSchedule):
    name, summary = "gpipe", ""

    def action_lists(self, p, m, *, v=1, steps=1, chunk_costs=None):
        return gpipe(p, m)


class OneFOneB(PipelineSchedule):
    name, summary = "1f1b", ""
    searched = megatron = True

    def action_lists(self, p, m, *, v=1, steps=1, chunk_costs=None):
        return one_f_one_b(p, m)


GPIPE, ONE_F_ONE_B = GPipe(), OneFOneB()
