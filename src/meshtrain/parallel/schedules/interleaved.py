"""Megatron's interleaved 1F1B: v model chunks per rank, looped (rank s holds model chunks s,
s + p, ...), so the bubble shrinks to 1/v of 1F1B's for more point-to-point traffic."""

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
from meshtrain.parallel.schedules.schedule import PipelineSchedule


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Forwards go through chunks in groups of p micro-batches; backwards through the chunks in
    reverse. Needs m divisible by p."""
    check_counts(p, m)
    if v < 1:
        raise SettingError(Code.RANGE, f"`virtual_stages` must be positive, got {v}")
    if m % p:
        raise SettingError(Code.INTERLEAVED_MICRO_BATCHES,
                           f"the interleaved schedule needs micro-batches ({m}) divisible by"
                           f" `pp` ({p}): change `global_batch` or `micro_batch`")
    total = m * v

    def forward(k: int) -> Action:
        return Action(FORWARD, (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action(BACKWARD, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    ranks = []
    for s in range(p):
        warmup = min(total, (p - s - 1) * 2 + (v - 1) * p)
        order = one_f_one_b_order(warmup, total, forward, backward)
        ranks.append(with_communication(order + [Action(OPTIMIZER_STEP)], s, p, v))
    return ranks


class Interleaved(PipelineSchedule):
    name = "interleaved"
    summary = "1F1B over virtual stages model chunks per rank"
    takes_virtual_stages = searched = megatron = True

    def action_lists(self, p, m, *, v=1, steps=1, chunk_costs=None):
        return interleaved(p, m, v)

    def check(self, plan, model, micro_batches: int) -> None:
        """Every group of p micro-batches goes through the chunks together, and the chunks
        split the layers evenly unless `pp_layers` says otherwise."""
        pp, v, m = plan.pp, plan.virtual_stages, micro_batches
        if pp == 1:
            return
        if m % pp:
            raise SettingError(Code.INTERLEAVED_MICRO_BATCHES, (
                f"`pp_schedule` interleaved needs the micro-batches per step"
                f" (global batch / (micro-batch x dp) = {m}) divisible by `pp`"
                f" {pp}: change `global_batch` or `micro_batch`"))
        if plan.pp_layers is None and model.num_layers % (pp * v):
            raise SettingError(Code.INTERLEAVED_LAYERS, (
                f"`pp_schedule` interleaved needs the {model.num_layers}"
                f" layers divisible by `pp` x `virtual_stages` = {pp} x"
                f" {v}, or explicit `pp_layers`"))


INTERLEAVED = Interleaved()
