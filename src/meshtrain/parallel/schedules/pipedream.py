"""PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", 2021):
1F1B across optimizer steps with no flush; a micro-batch's backward uses the weights its
forward used, so the model keeps two weight versions and the update lands one step late
(`runtime/pipeline.PipeDream2BW` runs it)."""

from __future__ import annotations

from meshtrain.errors import Code, SettingError
from meshtrain.parallel.schedules.actions import (
    BACKWARD,
    FORWARD,
    OPTIMIZER_STEP,
    Action,
    check_counts,
    one_f_one_b_order,
    with_communication,
)
from meshtrain.parallel.schedules.flush import one_f_one_b
from meshtrain.parallel.schedules.schedule import PipelineSchedule


def pipedream_2bw(p: int, m: int, steps: int) -> list[list[Action]]:
    """1F1B over `steps` x m micro-batches with no flush: stage s steps its weights after every
    m-th backward. Needs m >= p (so a weight version is never needed by more than two
    in-flight generations)."""
    check_counts(p, m)
    if m < p:
        raise SettingError(Code.TWO_BW_MICRO_BATCHES,
                           f"PipeDream-2BW needs micro-batches ({m}) >= `pp` ({p}): raise"
                           " `global_batch` or lower `micro_batch`")
    total = steps * m
    ranks = []
    for s in range(p):
        order = one_f_one_b_order(min(p - s - 1, total), total, lambda k: Action(FORWARD, k),
                                  lambda k: Action(BACKWARD, k))
        with_steps: list[Action] = []
        for a in order:
            with_steps.append(a)
            if a.kind == BACKWARD and (a.micro + 1) % m == 0:
                with_steps.append(Action(OPTIMIZER_STEP, a.micro // m))
        ranks.append(with_communication(with_steps, s, p, 1))
    return ranks


class PipeDream2BW(PipelineSchedule):
    name = "2bw"
    summary = "PipeDream-2BW: no flush, weights updated one step late"
    weight_versions, flushes = 2, False

    def action_lists(self, p, m, *, v=1, steps=1, chunk_costs=None):
        return pipedream_2bw(p, m, steps)

    def step_lists(self, p, m, *, v=1, chunk_costs=None):
        """1F1B's: evaluation between steps runs the current weights' forwards."""
        return one_f_one_b(p, m)

    def state_bytes(self, element_bytes: int) -> int:
        """The fp32 weights the optimizer steps apart from the model's (16-bit runs: the
        masters, counted with the optimizer) and their previous version."""
        return 4 + (4 if element_bytes == 4 else 0)

    def check(self, plan, model, micro_batches: int) -> None:
        if plan.zero and plan.pp > 1:
            raise SettingError(Code.ZERO_2BW, (
                "`zero` with `pp_schedule` 2bw is not supported (2BW keeps two full"
                " weight versions): use `zero` 1 with 1f1b or interleaved"))
        if plan.pp == 1:
            raise SettingError(Code.TWO_BW_PP, "`pp_schedule` 2bw needs `pp` > 1")
        if micro_batches < plan.pp:
            raise SettingError(Code.TWO_BW_MICRO_BATCHES, (
                f"`pp_schedule` 2bw needs at least `pp` ({plan.pp}) micro-batches per"
                f" step, got global batch / (micro-batch x dp) = {micro_batches}: raise"
                " `global_batch` or lower `micro_batch`"))
        if plan.precision != "fp32":
            raise SettingError(Code.TWO_BW_PRECISION, (
                f"`pp_schedule` 2bw supports `precision` fp32 only, got"
                f" {plan.precision}"))
        if model.moe_experts:
            raise SettingError(Code.TWO_BW_MOE, (
                "`pp_schedule` 2bw does not support MoE layers yet: use"
                " `pp_schedule` 1f1b with `moe_experts`"))


PIPEDREAM_2BW = PipeDream2BW()
