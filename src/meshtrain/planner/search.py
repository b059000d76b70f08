"""The search: the fastest layouts of a model on `gpus` devices that fit in their memory.

The space (a field fixed by `--layout` takes only its value): tp powers of two up to a node; pp
divisors of the devices up to MAX_PP (deeper pipelines are slow to simulate: fix pp to try one);
cp divisors while every rank keeps CP_MIN_TOKENS of the sequence (shorter ring blocks only add
latency); dp the rest; ep (MoE models) divisors of dp x cp that divide the experts, and with
experts whole (`etp` 1, tp > 1) divisors of dp x cp x tp that do; micro-batch
divisors of the per-dp batch up to MAX_MICRO_BATCH; schedules 1f1b and interleaved, virtual
stages the divisors of layers / pp from 2 to MAX_VIRTUAL_STAGES, and zb-h1 and zb-v where they
run (1d tensor parallelism; zb-v: 2 x pp layers at least); gpipe only when fixed (it does
1F1B's work holding every micro-batch's activations, and the simulator never finds it faster),
2bw only when fixed (its delayed update changes what is trained), eager-1f1b only when fixed
(it holds more activations to hide transfer latency, which the cost model does not credit);
sp with tp > 1; ZeRO 0-3; recompute none, selective, full; at cp > 1 the ring and hybrid
context parallelism at each `cp_a2a` inside a node (`fit_context`); the tensor-parallel
schemes tp forms a grid for (`scheme_space.py`: 1d, 2d, 2.5d at each depth, 3d; a grid's
micro-batches split evenly over its batch split, up to MAX_MICRO_BATCH sequences per rank),
each scheme its own
degree combination. `ParallelPlan.validate` rejects what meshtrain cannot run, with its reason.

Pruned so thousands of devices take seconds (a prediction takes milliseconds, a deep pipeline's
more). Exactly, since saving memory never makes the cost model faster: recompute, ZeRO 2 and 3
and expert parallelism are raised only while a layout is over budget; what is over budget at one
micro-batch is not tried at a larger one; a degree combination whose most memory-saving layout is
over budget is rejected whole. Heuristically: micro-batches and virtual stages are swept
upwards until the step time rises (larger matmuls and a smaller bubble speed it up, then the
pipeline fill and point-to-point traffic slow it); every degree combination is screened with
zb-h1 where it runs (else 1f1b), sp on and ZeRO from stage 1, and only the REFINE_AT_MOST
within REFINE_MARGIN of the best screened time are refined over every schedule, virtual
stages, sp and ZeRO stage. A fixed `tp_overlap` fixes sp on (the cost model charges its layouts
as sp's: it does not model the overlap); `zero_impl` deepspeed fixes ZeRO 3, all it prices.
Measured (CPU seconds, this 2-core host, global batch
1536, 1536 and 512): GPT-3 175B on 3072 A100s 4.7 s, on 1024 6.1 s; Llama 3 70B at 8k tokens
on 512 H100s 5.3 s (1.4-1.9x the search before the zero-bubble schedules, most of it their
simulations); GPT-2 on 8 GPUs 0.04 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from meshtrain.data.corpus import MAX_GLOBAL_BATCH
from meshtrain.errors import Code, SettingError
from meshtrain.models.family import TransformerConfig
from meshtrain.parallel.layers.recompute import RECOMPUTE
from meshtrain.parallel.runtime.capabilities import admits
from meshtrain.parallel.runtime.plan import SPEC_FIELDS, ParallelPlan
from meshtrain.parallel.runtime.zero import ZERO_STAGES
from meshtrain.parallel.schedules.catalog import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    SEARCHED_SCHEDULES,
    pipeline_schedule,
)
from meshtrain.parallel.schemes.registry import tp_scheme
from meshtrain.planner import costs
from meshtrain.planner.costs import Prediction
from meshtrain.planner.hardware import Hardware
from meshtrain.planner.scheme_space import grid_choices, micro_batches

MAX_PP = 32
CP_MIN_TOKENS = 1024
MAX_MICRO_BATCH = 8
MAX_VIRTUAL_STAGES = 8
REFINE_MARGIN = 0.1
REFINE_AT_MOST = 3
HYBRID_TRIALS = 2  # hybrid sharding: the largest node-local shard groups tried per layout
OVER_BUDGET = "memory over budget"
DEGREES = ("tp", "pp", "dp", "cp")

Cost = Callable[..., Prediction]


class Combo(NamedTuple):
    """The structural choices screened together: degrees and the tensor-parallel grid."""

    tp: int
    pp: int
    cp: int
    dp: int
    tp_scheme: str = ParallelPlan().tp_scheme
    tp_depth: int | None = None


class Rejection(NamedTuple):
    layout: ParallelPlan
    detail: str
    """The validation message, or how far over the memory budget."""
    over_gib: float = 0.0


@dataclass
class SearchResult:
    ranked: list[Prediction]
    """Layouts within the memory budget, fastest (then smallest) first; a fully fixed one even
    when over."""
    rejected: dict[str, list[Rejection]] = field(default_factory=dict)
    """By short reason: the refusal's `errors.Code` value ("heads not divisible by tp"), or
    "memory over budget"."""
    warnings: list[str] = field(default_factory=list)
    evaluated: int = 0
    """Layouts the cost model predicted."""
    base: ParallelPlan = field(default_factory=ParallelPlan)
    """Every candidate's fields the search does not vary: specs of the candidates name only
    where they differ from it, beside the searched fields."""

    def best(self) -> Prediction:
        """The fastest layout, or a ValueError saying why none fits."""
        if self.ranked:
            return self.ranked[0]
        if not self.rejected:
            raise SettingError(Code.NO_LAYOUT_FITS, "no layout to search: the space is empty")
        reason, items = max(self.rejected.items(), key=lambda kv: len(kv[1]))
        closest = min(items, key=lambda r: r.over_gib)
        raise SettingError(Code.NO_LAYOUT_FITS,
                           f"no layout fits: {sum(map(len, self.rejected.values()))} rejected,"
                           f" most for {reason} ({len(items)}; e.g."
                           f" {closest.layout.spec(self.base)}: {closest.detail})")


def search(model: TransformerConfig, hardware: Hardware, *, gpus: int, seq_len: int,
           global_batch: int, precision: str, fixed: dict[str, object] | None = None,
           cost: Cost = costs.predict, schedules: tuple[str, ...] = SEARCHED_SCHEDULES
           ) -> SearchResult:
    """Rank the layouts of `model` on `gpus` devices of `hardware`; `fixed` (a parsed `--layout`
    spec: `ParallelPlan` fields by name or spec key) pins fields, the searched ones and any
    other (`precision` overrides `precision`). A spec that leaves one candidate is evaluated
    even over budget. `schedules`: the pipeline schedules an unfixed search chooses among
    (`published.py` leaves out the zero-bubble ones, which the runs it compares with did not
    have). A CPU profile measured at another rank count is scaled to `gpus` ranks
    (`Hardware.for_ranks`)."""
    run = _Search(model, hardware.for_ranks(gpus), gpus, seq_len, global_batch, precision,
                  dict(fixed or {}), cost, schedules)
    run.check_fixed_degrees()
    only = run.only_candidate()
    if only is not None:
        return run.evaluate_fixed(only)
    screened = {combo: run.screen(combo) for combo in run.degree_combos()}
    timed = sorted((t, combo) for combo, t in screened.items() if t is not None)
    for t, combo in timed[:REFINE_AT_MOST]:
        if t <= (1 + REFINE_MARGIN) * timed[0][0]:
            run.refine(combo)
    run.result.ranked.sort(key=lambda p: (p.step_time_s, p.memory_gib))
    return run.result


MAX_GPUS = 2**20  # the largest clusters of 2026 hold about 10^5 devices
MAX_LAYERS = 2**12  # the deepest published models have about 10^2 layers; 2**12 take seconds


def check_gpus(gpus: int) -> None:
    """The devices a plan is for: 1 to `MAX_GPUS` (the search walks their divisors)."""
    if gpus < 1:
        raise SettingError(Code.RANGE, f"`gpus` must be positive, got {gpus}")
    if gpus > MAX_GPUS:
        raise SettingError(Code.RANGE, f"`gpus` {gpus} is more than any cluster holds: plan at"
                                       f" most {MAX_GPUS}")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


class _Search:
    def __init__(self, model, hardware, gpus, seq_len, global_batch, precision, fixed, cost,
                 schedules):
        check_gpus(gpus)
        if model.num_layers > MAX_LAYERS:
            raise SettingError(Code.RANGE,
                               f"`num_layers` {model.num_layers} is past any model the planner"
                               f" prices (it costs each layer of each layout): plan at most"
                               f" {MAX_LAYERS}")
        if global_batch is not None and global_batch > MAX_GLOBAL_BATCH:
            raise SettingError(Code.RANGE,
                               f"`global_batch` {global_batch} sequences per step is past any run:"
                               f" plan at most {MAX_GLOBAL_BATCH}")
        self.model, self.hardware, self.gpus = model, hardware, gpus
        self.seq_len, self.global_batch, self.cost = seq_len, global_batch, cost
        self.schedules = schedules
        fixed = {SPEC_FIELDS[k].name if k in SPEC_FIELDS else k: v for k, v in fixed.items()}
        searched = {f.name for f in SPEC_FIELDS.values() if f.metadata["searched"]}
        self.fixed = {k: v for k, v in fixed.items() if k in searched}
        self.base = {"precision": precision} | {k: v for k, v in fixed.items()
                                                 if k not in searched}
        self.precision = self.base["precision"]
        if self.base.get("tp_overlap"):  # it overlaps sp's communication: only sp layouts run
            self.fixed.setdefault("sequence_parallel", True)
        if self.base.get("zero_impl", "meshtrain") != "meshtrain":  # it prices ZeRO-3 alone
            self.fixed.setdefault("zero", 3)
        self.result = SearchResult(ranked=[], base=ParallelPlan(**self.base))
        self.seen: dict[ParallelPlan, Prediction | None] = {}
        self.checked: dict[ParallelPlan, bool] = {}

    def layout(self, combo: Combo, **fields) -> ParallelPlan:
        """A candidate: the combination, `fields`, and the fixed fields the search does not
        vary."""
        return ParallelPlan(**self.base, **combo._asdict(), **fields)

    def choices(self, name: str, values) -> list:
        return [self.fixed[name]] if name in self.fixed else list(values)

    def check_fixed_degrees(self) -> None:
        """A fixed degree product must divide the devices (equal them when all four are
        fixed)."""
        given = [(d, self.fixed[d]) for d in DEGREES if d in self.fixed]
        product = 1
        for _, value in given:
            product *= value
        names = " x ".join(d for d, _ in given)
        values = " x ".join(str(v) for _, v in given) + (f" = {product}" if len(given) > 1
                                                          else "")
        if len(given) == len(DEGREES) and product != self.gpus:
            raise SettingError(Code.DEGREES_WORLD,
                               f"`layout` fixes {names} = {values}, not `gpus` {self.gpus}:"
                               " change the degrees or `gpus`")
        if given and self.gpus % product:
            raise SettingError(Code.DEGREES_WORLD,
                               f"`layout` fixes {names} = {values}, which does not divide `gpus`"
                               f" {self.gpus}")

    def degree_combos(self) -> list[Combo]:
        """(tp, pp, cp, dp) with tp x pp x cp x dp = gpus, each with every grid tp forms."""
        n, f, moe = self.gpus, self.fixed, bool(self.model.moe_experts)
        tps = self.choices("tp", [t for t in _divisors(n) if t & (t - 1) == 0
                                  and t <= self.hardware.gpus_per_node])
        combos = []
        for tp in (t for t in tps if n % t == 0):
            for pp in self.choices("pp", [p for p in _divisors(n // tp) if p <= MAX_PP]):
                if n % (tp * pp):
                    continue
                rest = n // (tp * pp)
                cps = [c for c in _divisors(rest)
                       if c == 1 or "dp" in f or self.seq_len // c >= CP_MIN_TOKENS]
                for cp in self.choices("cp", cps):
                    if rest % cp == 0 and f.get("dp", rest // cp) == rest // cp:
                        combos += [Combo(tp, pp, cp, rest // cp, *grid)
                                   for grid in grid_choices(tp, f, cp=cp, moe=moe)]
        return combos

    def execution_choices(self, combo: Combo) -> dict[str, list]:
        """Every non-structural field's candidates for one combination."""
        tp, pp, cp, dp, scheme, depth = combo
        per_dp = self.global_batch // dp if self.global_batch % dp == 0 else 1
        interleaved = self.model.num_layers // pp if pp > 1 else 0
        vps = [v for v in _divisors(interleaved) if 2 <= v <= MAX_VIRTUAL_STAGES]
        schedules = self.schedule_choices(pp, scheme, vps)
        experts = self.model.moe_experts
        return {
            "micro_batch": self.choices("micro_batch", micro_batches(
                _divisors(per_dp), tp, scheme, depth, MAX_MICRO_BATCH)),
            "pp_schedule": self.choices("pp_schedule", schedules),
            "virtual_stages": self.choices("virtual_stages", vps or [1]),
            "sequence_parallel": self.choices("sequence_parallel", [True, False] if tp > 1 and
                                              "sequence_parallel" in tp_scheme(scheme).supports
                                              else [False]),
            "zero": self.choices("zero", list(ZERO_STAGES) if dp * cp > 1 else [0]),
            "recompute": self.choices("recompute", RECOMPUTE),
            "ep": self.choices("ep", [e for e in _divisors(dp * cp) if experts % e == 0]
                               if experts else [1]),
            # whole experts (etp 1): ep over dp x cp x tp (`fit_experts`)
            "etp": self.choices("etp", [None, 1] if experts and tp > 1 else [None]),
            "ep_whole": self.choices("ep", [e for e in _divisors(dp * cp * tp)
                                            if experts and experts % e == 0] or [1]),
        }

    def schedule_choices(self, pp: int, scheme: str, vps: list[int]) -> list[str]:
        """The searched schedules that run here, of `self.schedules`: at pp 1 the default;
        those that loop virtual stages where some divide the layers (or `vp` is fixed above
        1); the others while `vp` is not, where their own refusals let them run (a split
        backward: the scheme's layers defer their weight gradients, zb-v's 2 x pp chunks
        have a layer each). Split-backward schedules first: `screen` times a combination with
        the first (zb-h1: 1F1B's shape, as cheap to simulate, with a third of its bubble, so a
        deep pipeline is not screened out for a bubble they fill)."""
        fixed_vp = self.fixed.get("virtual_stages", 1)
        if pp == 1:
            return [DEFAULT_SCHEDULE]
        probe = ParallelPlan(pp=pp, tp_scheme=scheme)
        runs = [s for s in SCHEDULES.values() if s.searched and (
            vps or fixed_vp > 1 if s.takes_virtual_stages
            else fixed_vp == 1 and admits(replace(probe, pp_schedule=s.name), self.model))]
        names = [s.name for s in sorted(runs, key=lambda s: not s.split_backward)]
        return [s for s in names if s in self.schedules] or names[:1]

    def vp_for(self, schedule: str, choices: dict[str, list]) -> list[int]:
        return choices["virtual_stages"] if pipeline_schedule(schedule).takes_virtual_stages \
            else [self.fixed.get("virtual_stages", 1)]

    def only_candidate(self) -> ParallelPlan | None:
        """The one layout the fixed fields leave, if they leave one."""
        combos = self.degree_combos()
        if len(combos) != 1:
            return None
        choices = self.execution_choices(combos[0])
        whole = choices.pop("ep_whole")
        if choices["etp"] == [1]:
            choices["ep"] = whole
        choices["virtual_stages"] = self.vp_for(choices["pp_schedule"][0], choices)
        if any(len(values) != 1 for values in choices.values()):
            return None
        return self.layout(combos[0], **{k: v[0] for k, v in choices.items()})

    def evaluate_fixed(self, layout: ParallelPlan) -> SearchResult:
        """A fully fixed layout: invalid is an error; over budget is a warning."""
        self.validate(layout, record=False)
        prediction = self.predict(layout)
        self.result.ranked.append(prediction)
        over = prediction.memory_gib - self.hardware.hbm_gib
        if over > 0:
            self.result.warnings.append(
                f"layout {layout.spec(self.result.base)} needs {prediction.memory_gib:.1f} GiB"
                f" per device,"
                f" {over:.1f} GiB over the {self.hardware.hbm_gib:g} GiB of {self.hardware.name}")
        return self.result

    def validate(self, layout: ParallelPlan, *, record: bool = True) -> bool:
        """`ParallelPlan.validate`'s verdict; a refusal is recorded under its reason (or raised,
        unrecorded)."""
        if record and layout in self.checked:
            return self.checked[layout]
        try:
            layout.validate(
                self.model, world_size=self.gpus, global_batch=self.global_batch,
                seq_len=self.seq_len)
        except SettingError as e:
            if not record:
                raise
            self.reject(e.code.value, layout, str(e))
            self.checked[layout] = False
            return False
        self.checked[layout] = True
        return True

    def reject(self, reason: str, layout: ParallelPlan, detail: str) -> None:
        self.result.rejected.setdefault(reason, []).append(Rejection(layout, detail))

    def predict(self, layout: ParallelPlan) -> Prediction:
        self.result.evaluated += 1
        return self.cost(self.model, layout, self.hardware, seq_len=self.seq_len,
                         global_batch=self.global_batch, precision=self.precision)

    def fits(self, layout: ParallelPlan) -> bool:
        """Predict a valid layout once; rank it when it fits, reject it when over budget."""
        if layout in self.seen:
            return self.seen[layout] is not None
        prediction = self.predict(layout)
        over = prediction.memory_gib - self.hardware.hbm_gib
        if over > 0:
            self.result.rejected.setdefault(OVER_BUDGET, []).append(Rejection(
                layout, f"by {over:.1f} GiB ({prediction.memory_gib:.1f} of"
                        f" {self.hardware.hbm_gib:g})", over))
            self.seen[layout] = None
            return False
        self.seen[layout] = prediction
        self.result.ranked.append(prediction)
        return True

    def screen(self, combo: Combo) -> float | None:
        """Validate a combination, probe its memory, and time it with its first schedule,
        sp on and ZeRO from stage 1; the best screened step time, or None."""
        choices = self.execution_choices(combo)
        schedule = choices["pp_schedule"][0]
        bases = [self.layout(combo, micro_batch=choices["micro_batch"][0], pp_schedule=schedule,
                             sequence_parallel=sp, virtual_stages=self.vp_for(schedule,
                                                                              choices)[0],
                             ep=choices["ep"][-1], etp=choices["etp"][0],
                             zero=choices["zero"][0],
                             recompute=choices["recompute"][0])
                 for sp in choices["sequence_parallel"]]
        base = next((b for b in bases if self.validate(b)), None)
        if base is None or not self.probe(base, choices):
            return None
        zeros = [z for z in choices["zero"] if z >= 1 and self.runnable(replace(base, zero=z))]
        zeros = zeros or choices["zero"]
        swept = self.sweep(base, zeros, choices)
        return min(swept) if swept else None

    def sweep(self, base: ParallelPlan, zeros: list[int], choices: dict[str, list]
              ) -> list[float]:
        """The fastest fitting step time at each micro-batch, ascending, until one fits nowhere
        (memory grows with the micro-batch) or is slower than the last (step time falls, then
        rises with it: larger matmuls, then a longer pipeline fill)."""
        times: list[float] = []
        start: dict[int, int] = {}
        for mb in choices["micro_batch"]:
            found = self.escalate(replace(base, micro_batch=mb), zeros, choices, start)
            if not found:
                break
            times.append(min(p.step_time_s for p in found))
            if len(times) > 1 and times[-1] > times[-2]:
                break
        return times

    def probe(self, base: ParallelPlan, choices: dict[str, list]) -> bool:
        """Whether the combination's most memory-saving valid layout fits."""
        for zero in sorted(choices["zero"], reverse=True):
            saving = replace(base, zero=zero, recompute=choices["recompute"][-1])
            if self.runnable(saving):
                return self.fits(saving)
        return True  # no ZeRO stage is valid: `escalate` records why

    def runnable(self, layout: ParallelPlan) -> bool:
        """`validate`'s verdict, not recorded (a choice among alternatives)."""
        try:
            self.validate(layout, record=False)
        except SettingError:
            return False
        return True

    def refine(self, combo: Combo) -> None:
        """Every schedule, sp and ZeRO stage; virtual stages upwards until the step time rises
        (the bubble shrinks with them, point-to-point traffic grows)."""
        choices = self.execution_choices(combo)
        for schedule in choices["pp_schedule"]:
            for sp in choices["sequence_parallel"]:
                last = None
                for vp in self.vp_for(schedule, choices):
                    base = self.layout(combo, micro_batch=choices["micro_batch"][0],
                                       pp_schedule=schedule, virtual_stages=vp,
                                       sequence_parallel=sp, ep=choices["ep"][-1],
                                       etp=choices["etp"][0])
                    fastest = min(self.sweep(base, choices["zero"], choices), default=None)
                    if fastest is None or last is not None and fastest > last:
                        break
                    last = fastest

    def escalate(self, base: ParallelPlan, zeros: list[int], choices: dict[str, list],
                 start: dict[int, int]) -> list[Prediction]:
        """`base` at each ZeRO stage, raising recompute (then ZeRO 2 and 3, and expert
        parallelism) only while over budget; what fits. `start[zero]`: the first recompute choice
        worth trying (what was over budget at a smaller micro-batch stays over), updated."""
        recomputes = choices["recompute"]
        found, fit_at = [], {}
        for zero in zeros:
            lower = [i for z, i in fit_at.items() if 1 <= z < zero]
            limit = min(lower) if zero >= 2 and lower else len(recomputes)
            for i in range(start.get(zero, 0), limit):
                layout = replace(base, zero=zero, recompute=recomputes[i])
                if not self.validate(layout):
                    break  # recompute does not change validity
                fitting = self.fit_experts(layout, choices)
                for fit in fitting:
                    found += [fit, *self.fit_hybrid(fit.layout), *self.fit_context(fit.layout)]
                if fitting:
                    fit_at[zero] = i
                    break
            start[zero] = fit_at.get(zero, max(limit, start.get(zero, 0)))
        return found

    def fit_hybrid(self, layout: ParallelPlan) -> list[Prediction]:
        """Hybrid sharding of a fitting ZeRO layout: shard groups inside a node (tp x cp x
        dp_shard ranks at most a node's GPUs), the largest `HYBRID_TRIALS` of them, largest
        first while they fit (a smaller group holds more per rank). Not searched when
        `dp_shard` is fixed, nor where the data-parallel ranks fit in a node (nothing would
        leave the node's links, and the states would grow)."""
        node = self.hardware.gpus_per_node // (layout.tp * layout.cp)
        if not layout.zero or layout.dp_shard is not None or layout.dp <= node:
            return []
        found = []
        for s in sorted((d for d in _divisors(layout.dp) if d < layout.dp and d <= node),
                        reverse=True)[:HYBRID_TRIALS]:
            trial = replace(layout, dp_shard=s)
            if not (self.runnable(trial) and self.fits(trial)):
                break
            found.append(self.seen[trial])
        return found

    def fit_context(self, layout: ParallelPlan) -> list[Prediction]:
        """Hybrid context parallelism of a fitting layout: each `cp_a2a` strictly between 1
        and cp that divides it and keeps the all-to-all inside a node (tp x cp_a2a ranks at
        most a node's GPUs; validation refuses one not dividing the heads per tp rank). Not
        searched when `cp_mode` or `cp_a2a` is fixed."""
        if layout.cp == 1 or {"cp_mode", "cp_a2a"} & self.base.keys():
            return []
        node = self.hardware.gpus_per_node // layout.tp
        trials = [replace(layout, cp_mode="hybrid", cp_a2a=a) for a in _divisors(layout.cp)
                  if 1 < a < layout.cp and a <= node]
        return [self.seen[t] for t in trials if self.runnable(t) and self.fits(t)]

    def fit_experts(self, layout: ParallelPlan, choices: dict[str, list]) -> list[Prediction]:
        """For each expert tensor-parallel degree (tp, then 1: whole experts, ep over dp x cp
        x tp), the smallest expert-parallel degree (the fewest all-to-all peers) that fits."""
        found = []
        for etp in choices["etp"]:
            for ep in choices["ep_whole" if etp == 1 else "ep"]:
                trial = replace(layout, ep=ep, etp=etp)
                if (trial == layout or self.validate(trial)) and self.fits(trial):
                    found.append(self.seen[trial])
                    break
        return found
