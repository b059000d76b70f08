"""Eager 1F1B: 1F1B with stage s warming up with 2(p - s - 1) forwards instead of p - s - 1
(Megatron's interleaved warm-up at one chunk per rank), so each stage runs one more forward
ahead of its backwards than the stage after it.

Why: in 1F1B's steady state the activation stage s sends is used by stage s + 1 in the very
next period, so the transfer's latency L each way is on the critical path: s waits 2L a
micro-batch for the gradient it needs (posting receives early, as the gloo runtime does, does
not help: the tensor is produced just in time). Running one forward further ahead leaves a
period of slack on the activation's way, so round trips up to F + B are hidden, for up to
2(p - s) - 1 micro-batches' activations held on stage s instead of p - s. With free
communication and equal stages its makespan is 1F1B's; on uneven stages the slack also absorbs
some of their differences, which `simulator.simulate` and so the planner see (the planner
charges the transfers themselves on the critical path, as for 1F1B).
"""

from __future__ import annotations

from meshtrain.parallel.schedules.flush import warmed_one_f_one_b
from meshtrain.parallel.schedules.schedule import PipelineSchedule


class Eager1F1B(PipelineSchedule):
    name, summary = "eager-1f1b", "1F1B one forward further ahead per stage"

    def action_lists(self, p, m, *, v=1, steps=1, chunk_costs=None):
        return warmed_one_f_one_b(p, m, lambda s: 2 * (p - s - 1))


EAGER_1F1B = Eager1F1B()
