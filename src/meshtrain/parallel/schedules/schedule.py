"""What a pipeline schedule is: everything the rest of meshtrain asks of one.

A schedule says where it places the model's chunks on the pipeline ranks (`placement`) and how
many each rank holds (`chunks_per_rank`), whether its backward is split into `I` and `W`
(`split_backward`: the layers must defer their weight gradients), how many weight versions it
keeps (`weight_versions`) and whether a step ends in a flush (`flushes`: without one, steps
overlap, so the runtime runs it as segments of the whole run and the planner prices a step as
the steady state's), its action lists (`action_lists`, `step_lists`), which layout features it runs
(`supports`, the allow-list the plan's `capabilities` checker reads), the values it refuses
(`check`, with coded errors) and what it adds to each parameter's optimizer state
(`state_bytes`). The plan, the executor, the trace and the planner all ask the schedule
(`catalog.pipeline_schedule(name)`); no code outside this package compares schedule names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from meshtrain.parallel.schedules.actions import Action, Placement, model_chunk


class PipelineSchedule(ABC):
    """One pipeline schedule (an instance per schedule, listed in `catalog.SCHEDULES`)."""

    name: str
    """The `pp_schedule` setting's value."""
    summary: str
    """What it is, in a few words, or nothing where the name says it (the setting's help lists
    them)."""
    placement: Placement = staticmethod(model_chunk)
    """(rank, local chunk, p) -> global chunk: looped unless the schedule says otherwise."""
    takes_virtual_stages = False
    """Whether `virtual_stages` > 1 gives each rank that many looped chunks."""
    split_backward = False
    """Whether the backward runs as `I` and `W` instead of a fused `B`."""
    weight_versions = 1
    """Weight versions the model keeps while micro-batches of two steps are in flight."""
    flushes = True
    """Whether every step drains the pipeline before its optimizer step."""
    orders_on_costs = False
    """Whether `action_lists` chooses its order on each chunk's estimated costs."""
    searched = False
    """Whether the planner chooses it when the schedule is not fixed."""
    megatron = False
    """Whether Megatron-LM has it (what a published Megatron run may have used)."""
    supports: frozenset[str] = frozenset({
        "tp", "pp", "tp_overlap", "sequence_parallel", "cp", "cp_all2all", "cp_hybrid",
        "cp_a2a", "ep", "etp", "moe",
        "moe_seq_aux", "moe_capacity", "mla", "dropout", "compile", "fp8", "half", "fp64", "zero",
        "zero_gradients", "zero_parameters", "offload", "hybrid"})
    """The layout features (`runtime/capabilities.FEATURES`) it runs: every one that is not a
    schedule's own; a schedule adds its own (virtual stages, a split backward, two weight
    versions), and a feature no schedule lists is refused."""

    def chunks_per_rank(self, pp: int, virtual_stages: int) -> int:
        """Model chunks each of the `pp` ranks holds."""
        return virtual_stages

    @abstractmethod
    def action_lists(self, p: int, m: int, *, v: int = 1, steps: int = 1,
                     chunk_costs=None) -> list[list[Action]]:
        """Per pipeline rank, its actions for m micro-batches per step on v chunks per rank,
        over `steps` optimizer steps where steps overlap (`chunk_costs` a
        `zero_bubble.ChunkCosts`, for a schedule that `orders_on_costs`)."""

    def step_lists(self, p: int, m: int, *, v: int = 1, chunk_costs=None
                   ) -> list[list[Action]]:
        """One step's actions that end in a flush (evaluation runs their forwards)."""
        return self.action_lists(p, m, v=v, chunk_costs=chunk_costs)

    def check(self, plan, model, micro_batches: int) -> None:  # noqa: B027
        """Refuse the values this schedule cannot run (`plan` a resolved `ParallelPlan`,
        `model` a `TransformerConfig`, `micro_batches` per step); nothing by default."""

    def state_bytes(self, element_bytes: int) -> int:
        """Bytes per parameter this schedule keeps beyond the optimizer's own state."""
        return 0
