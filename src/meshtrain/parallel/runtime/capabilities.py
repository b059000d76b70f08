"""What combines with what, declared once: the layout features, what each needs, what it does
not combine with, and which tensor-parallel schemes and pipeline schedules run it.

A feature is something a plan (or its model) turns on that constrains the rest of the layout:
sequence parallelism, a ZeRO stage, a split backward, MoE layers, ... Each scheme
(`TPScheme.supports`) and each schedule (`PipelineSchedule.supports`) lists the features it
runs: an allow-list, so a feature nobody listed is refused rather than let through. Between
features, `RULES` says which one needs another and which two exclude each other, each with its
code and message. `check_capabilities` is the one checker turning the first declaration a plan
breaks into its `SettingError`; the numeric checks (divisibility, lengths) stay beside the
values they check. The guide's compatibility table is `table()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from meshtrain.errors import Code, SettingError, alternatives
from meshtrain.parallel.schedules.catalog import SCHEDULES
from meshtrain.parallel.schedules.schedule import PipelineSchedule
from meshtrain.parallel.schemes.registry import SCHEMES


@dataclass(frozen=True)
class Feature:
    """One feature: `in_use(plan, model)` says whether a resolved plan and its model
    (`TransformerConfig`) turn it on; `turn_on` the settings that do in the smallest layout
    showing it (plan fields and model fields; the guide shows them, the pairs test uses them);
    `setting` the setting messages name; `scheme_refusal` (code, message) for a scheme that
    does not list it, `schedule_refusal` for a schedule (defaults: `*_COMBINATION`)."""

    name: str
    setting: str
    in_use: Callable
    turn_on: dict = field(default_factory=dict)
    scheme_refusal: tuple[Code, str] | None = None
    schedule_refusal: tuple[Code, str] | None = None


def _first_schedule(has: Callable[[PipelineSchedule], bool]) -> str:
    """The first schedule of the catalog that has a property (what turns a schedule's feature
    on, named without comparing schedule names)."""
    return next(name for name, schedule in SCHEDULES.items() if has(schedule))


_GRID_SPLIT = (Code.SCHEME_COMBINATION, (
    "`tp_scheme` {plan.tp_scheme} does not combine with `{feature.setting}` (its hidden"
    " states are already split over batch and hidden): use `tp_scheme` {supporters} for"
    " `{feature.setting}`"))

FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("tp", "tp", lambda p, m: p.tp > 1, {"tp": 2}),
    Feature("pp", "pp", lambda p, m: p.pp > 1, {"pp": 2}),
    Feature("tp_overlap", "tp_overlap", lambda p, m: p.tp_overlap,
            {"tp": 2, "sequence_parallel": True, "tp_overlap": True},
            scheme_refusal=(Code.TP_OVERLAP_SCHEME, (
                "`tp_overlap` overlaps the sequence-parallel communication of 1d"
                " tensor-parallel layers, which `tp_scheme` {plan.tp_scheme}'s grid layers do"
                " not have: use `tp_scheme` {supporters} or drop `tp_overlap`"))),
    Feature("sequence_parallel", "sequence_parallel", lambda p, m: p.sequence_parallel,
            {"tp": 2, "sequence_parallel": True}, scheme_refusal=_GRID_SPLIT),
    Feature("cp", "cp", lambda p, m: p.cp > 1, {"cp": 2}, scheme_refusal=_GRID_SPLIT),
    Feature("cp_all2all", "cp_mode", lambda p, m: p.cp > 1 and p.cp_mode == "all2all",
            {"cp": 2, "cp_mode": "all2all"}, scheme_refusal=_GRID_SPLIT),
    Feature("cp_hybrid", "cp_mode", lambda p, m: p.cp_mode == "hybrid",
            {"cp": 4, "cp_mode": "hybrid", "cp_a2a": 2, "micro_batch": 2},
            scheme_refusal=_GRID_SPLIT),
    Feature("cp_a2a", "cp_a2a", lambda p, m: p.cp_a2a is not None,
            {"cp": 4, "cp_mode": "hybrid", "cp_a2a": 2, "micro_batch": 2},
            scheme_refusal=_GRID_SPLIT),
    Feature("ep", "ep", lambda p, m: p.ep > 1,
            {"dp": 2, "ep": 2, "moe_experts": 4, "moe_capacity_factor": 0.0},
            scheme_refusal=_GRID_SPLIT),
    Feature("etp", "etp", lambda p, m: p.whole_experts,
            {"tp": 2, "ep": 2, "etp": 1, "moe_experts": 4, "moe_capacity_factor": 0.0},
            scheme_refusal=_GRID_SPLIT),
    Feature("moe", "moe_experts", lambda p, m: bool(m.moe_experts),
            {"moe_experts": 4, "moe_capacity_factor": 0.0}, scheme_refusal=_GRID_SPLIT),
    Feature("moe_capacity", "moe_capacity_factor",
            lambda p, m: m.moe_capacity,
            {"moe_experts": 4, "moe_capacity_factor": 1.0}, scheme_refusal=_GRID_SPLIT),
    Feature("moe_seq_aux", "moe_seq_aux_loss_coef",
            lambda p, m: bool(m.moe_experts and m.moe_seq_aux_loss_coef),
            {"moe_experts": 4, "moe_seq_aux_loss_coef": 0.01}, scheme_refusal=_GRID_SPLIT),
    Feature("mla", "kv_lora_rank", lambda p, m: m.LATENT_ATTENTION, {"model": "deepseek-v3-tiny"},
            scheme_refusal=(Code.SCHEME_COMBINATION, (
                "multi-head latent attention (`{feature.setting}`) keeps its down-projections"
                " whole on hidden states `tp_scheme` {plan.tp_scheme} splits along the hidden"
                " size: use `tp_scheme` {supporters}"))),
    Feature("dropout", "dropout", lambda p, m: m.dropout > 0, {"dropout": 0.1}),
    Feature("compile", "compile", lambda p, m: p.compile, {"compile": True},
            scheme_refusal=(Code.COMPILE_SCHEME, (
                "`compile` compiles 1d tensor-parallel blocks, not `tp_scheme`"
                " {plan.tp_scheme}'s grid layers (they compile again on every call): use"
                " `tp_scheme` {supporters} or drop `compile`"))),
    Feature("fp8", "fp8", lambda p, m: p.fp8 != "none", {"fp8": "tensorwise"},
            scheme_refusal=(Code.FP8_SCHEME, (
                "`fp8` converts the 1d tensor-parallel layers only, not `tp_scheme`"
                " {plan.tp_scheme}'s grid layers: use `tp_scheme` {supporters} or drop `fp8`"))),
    Feature("half", "precision", lambda p, m: p.precision in ("bf16", "fp16"),
            {"precision": "bf16"}),
    Feature("fp64", "precision", lambda p, m: p.precision == "fp64", {"precision": "fp64"}),
    Feature("zero", "zero", lambda p, m: p.zero >= 1, {"dp": 2, "zero": 1}),
    Feature("zero_gradients", "zero", lambda p, m: p.zero >= 2, {"dp": 2, "zero": 2}),
    Feature("zero_parameters", "zero", lambda p, m: p.zero == 3, {"dp": 2, "zero": 3}),
    Feature("hybrid", "dp_shard", lambda p, m: p.dp_shard is not None,
            {"dp": 4, "dp_shard": 2, "zero": 1}),
    Feature("offload", "offload_optimizer", lambda p, m: p.offload_optimizer != "none",
            {"dp": 2, "zero": 1, "offload_optimizer": "cpu"}),
    Feature("virtual_stages", "virtual_stages", lambda p, m: p.virtual_stages > 1,
            {"pp": 2, "virtual_stages": 2,
             "pp_schedule": _first_schedule(lambda s: s.takes_virtual_stages)},
            schedule_refusal=(Code.VIRTUAL_STAGES_SCHEDULE, (
                "`virtual_stages` {plan.virtual_stages} needs `pp_schedule` {supporters} (got"
                " {plan.pp_schedule})"))),
    Feature("split_backward", "pp_schedule", lambda p, m: p.schedule.split_backward,
            {"pp": 2, "pp_schedule": _first_schedule(lambda s: s.split_backward)},
            scheme_refusal=(Code.ZERO_BUBBLE_SCHEME, (
                "`pp_schedule` {plan.pp_schedule} splits the backward of 1d tensor-parallel"
                " layers only, not of `tp_scheme` {plan.tp_scheme}'s grid layers: use"
                " `tp_scheme` {supporters} or `pp_schedule` 1f1b"))),
    Feature("two_weight_versions", "pp_schedule", lambda p, m: p.schedule.weight_versions > 1,
            {"pp": 2, "pp_schedule": _first_schedule(lambda s: s.weight_versions > 1)}),
)}
"""Every feature, in the order the checker asks the scheme and the schedule about them."""


@dataclass(frozen=True)
class Rule:
    """`feature` in use needs `other` in use too (`needs`), or must not meet it (not
    `needs`): refused with `code` and `message` (formatted with `plan` and `model`)."""

    feature: str
    other: str
    needs: bool
    code: Code
    message: str

    def broken(self, used: set[str]) -> bool:
        return self.feature in used and (self.other in used) != self.needs


def _needs(feature: str, other: str, code: Code, message: str) -> Rule:
    return Rule(feature, other, True, code, message)


def _excludes(feature: str, other: str, code: Code, message: str) -> Rule:
    return Rule(feature, other, False, code, message)


_MOE_SPLIT = ("`moe_capacity_factor` {model.moe_capacity_factor} with `sequence_parallel` or"
              " `cp` > 1 is not supported (its capacity is per rank): use 0 (dropless)")
_SEQ_AUX_SPLIT = ("`moe_seq_aux_loss_coef` with `sequence_parallel` or `cp` > 1 is not"
                  " supported: a sequence's tokens are routed on several ranks, so its"
                  " per-sequence loss would not be one process's; use `moe_aux_loss_scope`"
                  " global instead")
_TWO_BW_PRECISION = "`pp_schedule` {plan.pp_schedule} supports `precision` fp32 only, got" \
                    " {plan.precision}"
_ZERO_FP64 = ("`zero` {plan.zero} keeps fp32 master shards, which would round `precision`"
              " fp64's parameters: use `zero` 0 with fp64")

RULES: tuple[Rule, ...] = (
    _needs("tp_overlap", "sequence_parallel", Code.TP_OVERLAP_WITHOUT_SP, (
        "`tp_overlap` overlaps the all-gather and reduce-scatter of `sequence_parallel`: add"
        " `sequence_parallel` (with `tp` > 1) or drop `tp_overlap`")),
    _needs("sequence_parallel", "tp", Code.SP_WITHOUT_TP, (
        "`sequence_parallel` needs `tp` > 1 (it splits the sequence over the tensor-parallel"
        " ranks)")),
    _needs("cp_hybrid", "cp", Code.CP_HYBRID_WITHOUT_CP, (
        "`cp_mode` hybrid splits the context-parallel ranks: add `cp` > 1 (a multiple of"
        " `cp_a2a`) or use `cp_mode` ring")),
    _needs("cp_a2a", "cp_hybrid", Code.CP_A2A_WITHOUT_HYBRID, (
        "`cp_a2a` {plan.cp_a2a} sets `cp_mode` hybrid's all-to-all group: add `cp_mode`"
        " hybrid or drop `cp_a2a`")),
    _excludes("cp", "dropout", Code.CP_DROPOUT,
              "attention dropout with `cp` > 1 is not supported: use `dropout` 0"),
    _excludes("moe_seq_aux", "sequence_parallel", Code.MOE_SEQ_AUX_SPLIT, _SEQ_AUX_SPLIT),
    _excludes("moe_seq_aux", "cp", Code.MOE_SEQ_AUX_SPLIT, _SEQ_AUX_SPLIT),
    _excludes("moe_capacity", "sequence_parallel", Code.MOE_SEQUENCE_SPLIT, _MOE_SPLIT),
    _excludes("moe_capacity", "cp", Code.MOE_SEQUENCE_SPLIT, _MOE_SPLIT),
    _needs("etp", "moe", Code.ETP_WITHOUT_MOE, (
        "`etp` 1 keeps MoE experts whole: it needs an MoE model (set `moe_experts`) or drop"
        " `etp`")),
    _excludes("compile", "moe", Code.COMPILE_MOE, (
        "`compile` with `moe_experts` is not supported: routing sizes each expert's batch by"
        " counts read on the host, so every step would compile again; train MoE models without"
        " `compile`")),
    _excludes("fp8", "fp64", Code.FP8_PRECISION, (
        "`fp8` rounds matmul operands to 8 bits, which defeats `precision` fp64's checks: use"
        " bf16 (or fp32) with `fp8`")),
    _excludes("zero", "fp64", Code.ZERO_FP64, _ZERO_FP64),
    _needs("offload", "zero", Code.OFFLOAD_WITHOUT_ZERO, (
        "`offload_optimizer` {plan.offload_optimizer} offloads ZeRO's optimizer shard: add"
        " `zero` 1 (or 2, 3)")),
    _needs("hybrid", "zero", Code.DP_SHARD_WITHOUT_ZERO, (
        "`dp_shard` {plan.dp_shard} sets the group ZeRO shards over: add `zero` 1 (or 2, 3)"
        " or drop `dp_shard`")),
    _excludes("hybrid", "moe", Code.DP_SHARD_MOE, (
        "`dp_shard` does not shard MoE experts yet: drop `dp_shard` with `moe_experts`")),
    _excludes("zero_gradients", "pp", Code.ZERO_PIPELINE, (
        "`zero` {plan.zero} does not combine with `pp` {plan.pp}: a pipeline interleaves the"
        " backwards of many micro-batches, so sharded gradients would be reduce-scattered once"
        " per micro-batch per stage; use `zero` 1 with pipelines")),
    _needs("virtual_stages", "pp", Code.VIRTUAL_STAGES_PP,
           "`virtual_stages` {plan.virtual_stages} needs `pp` > 1"),
    _needs("two_weight_versions", "pp", Code.TWO_BW_PP,
           "`pp_schedule` {plan.pp_schedule} needs `pp` > 1"),
    _excludes("two_weight_versions", "zero", Code.ZERO_2BW, (
        "`zero` with `pp_schedule` {plan.pp_schedule} is not supported (2BW keeps two full"
        " weight versions): use `zero` 1 with 1f1b or interleaved")),
    _excludes("two_weight_versions", "half", Code.TWO_BW_PRECISION, _TWO_BW_PRECISION),
    _excludes("two_weight_versions", "fp64", Code.TWO_BW_PRECISION, _TWO_BW_PRECISION),
    _excludes("two_weight_versions", "moe", Code.TWO_BW_MOE, (
        "`pp_schedule` {plan.pp_schedule} does not support MoE layers yet: use `pp_schedule`"
        " 1f1b with `moe_experts`")),
    _needs("split_backward", "pp", Code.ZERO_BUBBLE_PP,
           "`pp_schedule` {plan.pp_schedule} needs `pp` > 1"),
)
"""What features need of and refuse to each other, in the order the checker asks."""


def features_in_use(plan, model) -> list[str]:
    """The features a resolved plan (`ParallelPlan`) and its model turn on, in `FEATURES`'
    order."""
    return [name for name, f in FEATURES.items() if f.in_use(plan, model)]


def supporters(feature: str, kind: str) -> list[str]:
    """The schemes (`kind` "scheme") or schedules ("schedule") that list `feature`."""
    listed = SCHEMES if kind == "scheme" else SCHEDULES
    return [name for name, entry in listed.items() if feature in entry.supports]


def refusal(plan, model, *, only: set[str] | None = None) -> SettingError | None:
    """The refusal of the first declaration a resolved plan breaks: a feature its scheme or
    schedule does not list, then `RULES`; None when it breaks none. `only`: the declarations
    about these features alone."""
    used = features_in_use(plan, model)
    asked = [name for name in used if only is None or name in only]
    for name in asked:
        for kind, entry in (("scheme", plan.scheme), ("schedule", plan.schedule)):
            if name not in entry.supports:
                return _unsupported(FEATURES[name], kind, plan, model)
    for rule in RULES:
        if rule.feature in asked and rule.broken(set(used)):
            return SettingError(rule.code, rule.message.format(plan=plan, model=model))
    return None


_DEFAULT_REFUSALS = {
    "scheme": (Code.SCHEME_COMBINATION, "`tp_scheme` {plan.tp_scheme} does not combine with"
                                        " `{feature.setting}`: use `tp_scheme` {supporters}"),
    "schedule": (Code.SCHEDULE_COMBINATION, "`pp_schedule` {plan.pp_schedule} does not combine"
                                            " with `{feature.setting}`: use `pp_schedule`"
                                            " {supporters}"),
}


def _unsupported(feature: Feature, kind: str, plan, model) -> SettingError:
    declared = feature.scheme_refusal if kind == "scheme" else feature.schedule_refusal
    code, message = declared or _DEFAULT_REFUSALS[kind]
    names = supporters(feature.name, kind) or ["none"]
    return SettingError(code, message.format(plan=plan, model=model, feature=feature,
                                             supporters=alternatives(names)))


def check_capabilities(plan, model) -> None:
    """Raise the refusal of the first declaration a resolved plan breaks (`refusal`)."""
    error = refusal(plan, model)
    if error is not None:
        raise error


SCHEDULE_FEATURES = {name for name, f in FEATURES.items() if f.setting == "pp_schedule"}
"""The features a schedule itself turns on (a split backward, two weight versions)."""


def admits(plan, model) -> bool:
    """Whether a plan's schedule runs on its layout: what its own features need (`pp` > 1,
    the scheme's support) and its own checks with pp micro-batches, which every schedule takes
    (the planner's search asks before it prices; the rest of the layout is validated later)."""
    try:
        plan.schedule.check(plan, model, micro_batches=plan.pp)
    except SettingError:
        return False
    return refusal(plan, model, only=SCHEDULE_FEATURES) is None


def table() -> list[str]:
    """The guide's compatibility table, a row per feature: the settings that turn it on, what
    it needs and refuses (`RULES`), and the schemes and schedules that list it."""
    rows = ["| feature | turned on by | needs | not with | tp schemes | pp schedules |",
            "|---|---|---|---|---|---|"]
    for name, feature in FEATURES.items():
        settings = ", ".join(f"`{key}` {value}" for key, value in feature.turn_on.items())
        needs = [r.other for r in RULES if r.feature == name and r.needs]
        excluded = [r.other if r.feature == name else r.feature for r in RULES
                    if name in (r.feature, r.other) and not r.needs]
        cells = [name, settings, ", ".join(needs) or "-", ", ".join(dict.fromkeys(excluded))
                 or "-", _listed(supporters(name, "scheme"), SCHEMES),
                 _listed(supporters(name, "schedule"), SCHEDULES)]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _listed(names: list[str], every: dict) -> str:
    return "all" if len(names) == len(every) else ", ".join(names) or "none"
