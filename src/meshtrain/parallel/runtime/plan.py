"""The parallel plan: every layout choice of a run, declared and validated in one place.

Degrees say how many ranks each parallelism spans; the other fields say how the model is split
and executed on them. Each field declares, once, what the rest of meshtrain shows of it: its
help text, its choices, its key in a `--layout` spec (`spec`: tp, sp, mb, ...; the field name
when none) and whether the planner searches it, and the TOML table and flag that set it
(`section`). The run config builds a plan from these fields alone (`config.run_config`), the
planner's candidates are plans and a `--layout` spec is a view of one (`parse_spec`, `spec`),
and `parallelize` applies it. `validate` checks it against a model config and the world size and
raises `SettingError` naming the settings in backticks (`pp_schedule`); the CLI shows them as
flags.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from meshtrain.data.corpus import check_batch_sizes
from meshtrain.errors import Code, SettingError, alternatives
from meshtrain.mesh import resolve_degrees
from meshtrain.parallel.layers.attention import CP_MODES
from meshtrain.parallel.layers.fp8 import ALIGNMENT, FP8_RECIPES
from meshtrain.parallel.layers.recompute import RECOMPUTE
from meshtrain.parallel.runtime.capabilities import check_capabilities
from meshtrain.parallel.runtime.pipeline import stage_layers
from meshtrain.parallel.runtime.zero import OFFLOAD_TARGETS, ZERO_STAGES
from meshtrain.parallel.schedules.catalog import (
    DEFAULT_SCHEDULE,
    PP_SCHEDULES,
    pipeline_schedule,
    schedules_help,
)
from meshtrain.parallel.schedules.schedule import PipelineSchedule
from meshtrain.parallel.schemes.registry import SCHEMES, tp_grid, tp_scheme
from meshtrain.parallel.schemes.scheme import TPScheme
from meshtrain.precision import DTYPES

ZERO_IMPLS = ("meshtrain", "deepspeed")
"""The `zero_impl` choices: the ZeRO-3 meshtrain trains with, and DeepSpeed's, which the planner
prices for comparing with published DeepSpeed runs."""


def parse_dtype(name: str, setting: str) -> torch.dtype:
    if name not in DTYPES:
        raise SettingError(Code.CHOICE, f"`{setting}` must be {alternatives(DTYPES)}, got"
                                        f" {name!r}")
    return DTYPES[name]


def _layout(default: Any, help: str, *, spec: str | None = None, searched: bool = False,
            choices: tuple | None = None, section: str = "parallel",
            run_default: Any = dataclasses.MISSING) -> Any:
    """A plan field and what it declares (module docstring); `run_default`: a run's default
    where it differs from the plan's (a run's micro-batch is 8, a bare plan's 1)."""
    return field(default=default, metadata={
        "help": help, "spec": spec, "searched": searched, "choices": choices,
        "section": section, "run_default": default if run_default is dataclasses.MISSING
        else run_default})


@dataclass(frozen=True)
class ParallelPlan:
    """How a model runs across the mesh. Degrees not given are 1; `dp` fills the world."""

    tp: int = _layout(1, "tensor-parallel degree", spec="tp", searched=True)
    pp: int = _layout(1, "pipeline-parallel degree (layers split evenly, earlier stages take"
                         " the remainder)", spec="pp", searched=True)
    dp: int | None = _layout(None, "data-parallel degree (default: the ranks left, world /"
                                   " (tp x pp x cp))", spec="dp", searched=True)
    cp: int = _layout(1, "context-parallel degree: each rank holds 1/cp of every sequence",
                      spec="cp", searched=True)
    ep: int = _layout(1, "expert-parallel degree: experts spread over this many of the dp"
                         " ranks (dp x cp x tp ranks at etp 1)", spec="ep", searched=True)
    etp: int | None = _layout(None, "expert tensor-parallel degree: tp (default; each expert"
                                    " split over tp like the dense MLP) or 1 (experts whole,"
                                    " ep spread over tp x dp x cp: Megatron's MoE parallel"
                                    " folding)", spec="etp", searched=True)
    virtual_stages: int = _layout(1, "model chunks per pipeline rank (pp schedule"
                                     " interleaved)", spec="vp", searched=True)
    micro_batch: int = _layout(1, "sequences per forward/backward on one rank", spec="mb",
                               searched=True, section="train", run_default=8)
    zero: int = _layout(0, "ZeRO stage over the data-parallel ranks: 0 replicates everything,"
                           " 1 shards optimizer states, 2 also gradients, 3 also parameters"
                           " (gathered per layer); 2 and 3 not with pp > 1", spec="zero",
                        searched=True, choices=ZERO_STAGES)
    dp_shard: int | None = _layout(None, "hybrid sharding: ZeRO shards over groups of this many"
                                         " data-parallel ranks (x cp) and the dp / dp_shard"
                                         " groups are replicas, their gradient shards"
                                         " all-reduced (default: shard over all dp ranks;"
                                         " usually the GPUs of a node; needs zero >= 1)",
                                   spec="dp_shard")
    sequence_parallel: bool = _layout(False, "Megatron sequence parallelism over the TP ranks"
                                             " (needs tp > 1)", spec="sp", searched=True)
    tp_overlap: bool = _layout(False, "overlap the all-gather and reduce-scatter of sequence"
                                      " parallelism with the matmuls of the tensor-parallel"
                                      " linears, chunk by chunk around the tp ranks (needs"
                                      " sequence_parallel, tp_scheme 1d)")
    recompute: str = _layout("none", "activation recomputation: none, selective (attention"
                                     " core) or full (whole layers)", spec="recompute",
                             searched=True, choices=RECOMPUTE)
    pp_schedule: str = _layout(DEFAULT_SCHEDULE, schedules_help(), spec="schedule",
                               searched=True, choices=PP_SCHEDULES)
    tp_scheme: str = _layout("1d", "tensor-parallel scheme: 1d (Megatron), 2d (SUMMA on a q x q"
                                   " grid, tp = q^2), 2.5d (q x q x depth) or 3d (q x q x q)",
                             spec="scheme", searched=True, choices=tuple(SCHEMES))
    tp_depth: int | None = _layout(None, "2.5d's depth d (tp = q^2 d; default: the largest d"
                                         " leaving q >= 2)", spec="depth", searched=True)
    cp_mode: str = _layout("ring", "context-parallel attention: ring (K/V around a ring),"
                                   " all2all (Ulysses: heads/tp divisible by cp) or hybrid"
                                   " (all-to-all over cp_a2a ranks inside, ring over cp /"
                                   " cp_a2a outside)", choices=CP_MODES)
    cp_a2a: int | None = _layout(None, "cp_mode hybrid's all-to-all group: this many"
                                       " consecutive cp ranks, innermost after tp (a node's"
                                       " links); divides cp and the heads per tp rank")
    pp_layers: tuple[int, ...] | None = _layout(
        None, "layers per pipeline stage, comma-separated (e.g. 3,5); with virtual stages one"
              " count per model chunk (pp x v of them; 2 x pp under zb-v); default: an even split")
    zero_impl: str = _layout("meshtrain", "whose ZeRO-3 the planner prices: meshtrain (each"
                                          " layer's parameters gathered ahead of it, behind"
                                          " compute) or deepspeed (DeepSpeed's: gathered"
                                          " when needed, gradients reduced in its buckets),"
                                          " to compare with DeepSpeed's runs; training runs"
                                          " meshtrain's only", choices=ZERO_IMPLS)
    offload_optimizer: str = _layout("none", "none; cpu: keep ZeRO's fp32 master shard, its"
                                             " gradient and the Adam moments in host memory"
                                             " and step there; nvme: keep the master shard and"
                                             " moments in files under offload_dir, a few"
                                             " buckets in memory at a time (needs zero >= 1)",
                                     choices=OFFLOAD_TARGETS)
    offload_dir: str | None = _layout(None, "folder for offload_optimizer nvme's files"
                                            " (created when missing): DIR/<run name>/rank<N>,"
                                            " removed at exit")
    recompute_layers: int | None = _layout(None, "with full recompute, only the first k layers")
    precision: str = _layout("fp32", "parameter/activation dtype: fp32, bf16 or fp16 (16-bit"
                                     " keeps fp32 master weights; fp16 adds dynamic loss"
                                     " scaling), or fp64 to check a layout against one process"
                                     " (no ZeRO)", section="train", choices=tuple(DTYPES))
    fp8: str = _layout("none", "float8 matmuls in the attention and MLP linears (1d tp scheme;"
                               " GPUs with FP8 tensor cores, CUDA capability >= 8.9; needs"
                               " torchao): tensorwise or rowwise scaling; parameters, masters"
                               " and checkpoints keep their dtype", section="train",
                       choices=FP8_RECIPES)
    grad_dtype: str = _layout("fp32", "dtype gradients are accumulated and reduced in: fp32, or"
                                      " the 16-bit precision dtype (fp64 runs always reduce in"
                                      " fp64)", section="train", choices=tuple(DTYPES))
    bucket_mb: float = _layout(25.0, "gradient all-reduce (ZeRO 1/2: reduce-scatter) bucket"
                                     " size in MiB")
    compile: bool = _layout(False, "compile each transformer block with torch.compile"
                                   " (inductor): the first step compiles, later ones run"
                                   " fused kernels", section="train")

    @property
    def zero_shard_ranks(self) -> int:
        """The ranks ZeRO shards each bucket over: dp_shard (default dp) x cp."""
        return (self.dp_shard or self.degrees["dp"]) * self.cp

    @property
    def world_size(self) -> int:
        """Ranks the degrees span (dp resolved)."""
        return self.tp * self.pp * self.cp * self.degrees["dp"]

    def spec_items(self, reference: ParallelPlan | None = None) -> list[tuple[str, str]]:
        """(key, value) as a `--layout` spec writes them: every searched field that is set,
        and the other fields where they differ from `reference` (default: a bare plan)."""
        reference = reference or ParallelPlan()
        items = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (f.metadata["searched"]
                                      or value != getattr(reference, f.name)):
                items.append((spec_key(f), _spec_text(value)))
        return items

    def spec(self, reference: ParallelPlan | None = None) -> str:
        """This plan as a `--layout` spec (`spec_items`)."""
        return ",".join(f"{key}={value}" for key, value in self.spec_items(reference))

    def searched_view(self) -> dict[str, Any]:
        """The fields the planner searches, by spec key (`meshtrain plan --json`'s layout)."""
        return {spec_key(f): getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata["searched"]}

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh degrees (after `resolved`)."""
        assert self.dp is not None, "resolve the plan against a world size first"
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep}

    def resolved(self, world_size: int) -> ParallelPlan:
        """This plan with dp derived from the world size (degrees checked)."""
        degrees = resolve_degrees(world_size, tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp,
                                  ep=self.ep, etp=self.etp)
        return dataclasses.replace(self, dp=degrees["dp"])

    @property
    def whole_experts(self) -> bool:
        """Experts whole on each rank while the rest is split over tp (`etp` 1, tp > 1)."""
        return self.etp == 1 and self.tp > 1

    @property
    def scheme(self) -> TPScheme:
        """The tensor-parallel scheme (`parallel/schemes/registry.py`)."""
        return tp_scheme(self.tp_scheme)

    @property
    def schedule(self) -> PipelineSchedule:
        """The pipeline schedule (`parallel/schedules/catalog.py`)."""
        return pipeline_schedule(self.pp_schedule)

    @property
    def tp_grid(self) -> dict[str, int]:
        """The TP block's grid axes and sizes (`TPScheme.grid`)."""
        return tp_grid(self.tp_scheme, self.tp, self.tp_depth)

    @property
    def head_parts(self) -> int:
        """How many ways attention heads are split: tp (1d) or the grid side q."""
        return self.scheme.head_parts(self.tp_grid)

    @property
    def batch_parts(self) -> int:
        """How many ways a micro-batch is split inside the TP block: 1 (1d), q (2d), d q
        (2.5d) or q^2 (3d)."""
        return self.scheme.batch_parts(self.tp_grid)

    def with_degrees(self, degrees: dict[str, int]) -> ParallelPlan:
        return dataclasses.replace(self, **{k: degrees[k] for k in ("tp", "pp", "dp", "cp", "ep")})

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.precision, "precision")

    @property
    def gradient_dtype(self) -> torch.dtype:
        """Never narrower than the parameters: fp64 runs reduce in fp64 whatever `grad_dtype`."""
        return torch.promote_types(parse_dtype(self.grad_dtype, "grad_dtype"), self.dtype)

    @property
    def master_weights(self) -> bool:
        """Whether the optimizer steps fp32 copies (16-bit parameters)."""
        return self.dtype.itemsize < 4

    def micro_batches_per_step(self, global_batch: int) -> int:
        return global_batch // (self.micro_batch * self.degrees["dp"])

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds (`PipelineSchedule.chunks_per_rank`)."""
        return self.schedule.chunks_per_rank(self.pp, self.virtual_stages)

    def stage_layers(self, num_layers: int) -> list[range]:
        """Every pipeline stage's (model chunk's, under interleaving or zb-v) layers, in
        order."""
        return stage_layers(num_layers, self.pp * self.chunks_per_rank,
                            list(self.pp_layers) if self.pp_layers is not None else None)

    def validate(self, model, *, world_size: int, global_batch: int,
                 seq_len: int) -> ParallelPlan:
        """Check this plan against a model config (`TransformerConfig`), the world size, the
        global batch and the sequence length; returns it resolved."""
        self.validate_choices()
        plan = self.resolved(world_size)
        plan._validate_numbers(global_batch)
        check_capabilities(plan, model)
        plan.scheme.check(plan, model)
        model.validate_for_tp(plan.head_parts)
        model.validate_for_ep(plan.ep)
        plan._validate_execution(model, seq_len)
        plan._validate_fp8(seq_len)
        plan._validate_zero()
        plan._validate_pipeline(model, global_batch)
        return plan

    def validate_choices(self) -> None:
        """Every field with choices holds one of them."""
        for f in dataclasses.fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices is not None and value not in choices:
                raise SettingError(Code.CHOICE, f"`{f.name}` must be {alternatives(choices)},"
                                                f" got {value!r}")

    def _validate_numbers(self, global_batch: int) -> None:
        check_batch_sizes(global_batch=global_batch, micro_batch=self.micro_batch, dp=self.dp)
        precision = self.dtype
        if parse_dtype(self.grad_dtype, "grad_dtype") not in (torch.float32, precision):
            raise SettingError(Code.GRAD_DTYPE, (
                f"`grad_dtype` {self.grad_dtype} must be fp32 or the `precision`"
                f" dtype ({self.precision})"))
        if not math.isfinite(self.bucket_mb) or int(self.bucket_mb * 2**20) < 1:
            raise SettingError(Code.RANGE, f"`bucket_mb` must be positive, got {self.bucket_mb}")

    def _validate_execution(self, model, seq_len: int) -> None:
        """The values of sequence and context parallelism and recomputation (what they
        combine with: `capabilities`)."""
        tp, cp = self.tp, self.cp
        if self.recompute_layers is not None and self.recompute_layers < 0:
            raise SettingError(Code.RANGE, (
                f"`recompute_layers` must be >= 0, got {self.recompute_layers}"))
        if self.recompute_layers is not None and self.recompute != "full":
            raise SettingError(Code.RECOMPUTE_LAYERS, (
                "`recompute_layers` applies to `recompute` full only: add it or drop"
                " `recompute_layers`"))
        if cp > 1 and seq_len % (2 * cp):
            raise SettingError(Code.CP_SEQ_LEN, (
                f"`seq_len` {seq_len} must be divisible by 2 x cp = {2 * cp} (each"
                " rank holds 2 of 2 x cp chunks): choose a multiple"))
        local = seq_len // cp  # tokens per CP rank, split again over TP by sequence parallelism
        if self.sequence_parallel and local % tp:
            raise SettingError(Code.SP_SEQ_LEN, (
                f"`seq_len` {seq_len} / cp ({cp}) = {local} tokens per rank must be"
                f" divisible by tp ({tp}) for `sequence_parallel`: choose a multiple"))
        if cp > 1 and self.cp_mode == "all2all" and (model.num_heads // tp) % cp:
            raise SettingError(Code.ALL2ALL_HEADS, (
                f"`cp_mode` all2all needs heads per TP rank ({model.num_heads // tp})"
                f" divisible by `cp` {cp}: use `cp_mode` ring or another `cp`"))
        if self.cp_mode == "hybrid":
            self._validate_cp_a2a(model.num_heads // tp)

    def _validate_cp_a2a(self, heads: int) -> None:
        """Hybrid's all-to-all group: given, a divisor of cp, and of the query heads one
        tensor-parallel rank holds (each of its ranks takes 1/cp_a2a of them)."""
        a2a = self.cp_a2a
        if a2a is None or a2a < 1 or self.cp % a2a:
            raise SettingError(Code.CP_A2A, (
                f"`cp_mode` hybrid needs `cp_a2a` dividing `cp` {self.cp}, got {a2a}: choose a"
                " divisor (the ranks of the all-to-all, usually inside a node)"))
        if heads % a2a:
            raise SettingError(Code.CP_A2A_HEADS, (
                f"`cp_a2a` {a2a} must divide the heads per TP rank ({heads}): choose a"
                " divisor (the ring part has no head limit)"))

    def _validate_fp8(self, seq_len: int) -> None:
        """The tokens float8 matmuls run over (the device is checked where it is known:
        `fp8.check_fp8_device`)."""
        if self.fp8 == "none":
            return
        tokens = self.micro_batch * seq_len // self.cp
        if tokens % ALIGNMENT:
            raise SettingError(Code.FP8_TOKENS, (
                f"`fp8` needs the tokens of a micro-batch on a rank (`micro_batch` x `seq_len`"
                f" / cp = {tokens}) to be a multiple of {ALIGNMENT}: the weight gradient's"
                f" float8 matmul runs over them; change `micro_batch` or `seq_len`"))

    def check_trainable(self) -> None:
        """Refuse what only the planner prices: another system's ZeRO-3."""
        if self.zero_impl != "meshtrain":
            raise SettingError(Code.ZERO_IMPL_TRAIN, (
                f"`zero_impl` {self.zero_impl} prices another system's ZeRO-3 in the planner;"
                " meshtrain trains with its own: drop `zero_impl`"))

    def _validate_zero(self) -> None:
        if self.zero_impl != "meshtrain" and self.zero != 3:
            raise SettingError(Code.ZERO_IMPL_STAGE, (
                f"`zero_impl` {self.zero_impl} prices ZeRO-3: set `zero` 3 (got {self.zero})"))
        if self.dp_shard is not None and (self.dp_shard < 1 or self.dp % self.dp_shard):
            raise SettingError(Code.DP_SHARD, (
                f"`dp_shard` {self.dp_shard} must divide `dp` {self.dp}: ZeRO shards over"
                " groups of that many data-parallel ranks; choose a divisor of dp"))
        if (self.offload_optimizer == "nvme") != (self.offload_dir is not None):
            raise SettingError(Code.OFFLOAD_DIR, (
                "`offload_optimizer` nvme keeps its files in `offload_dir`: set both, or"
                " neither"))

    def _validate_pipeline(self, model, global_batch: int) -> None:
        """Chunks of at least one layer each and the schedule's own refusals
        (`PipelineSchedule.check`)."""
        v = self.virtual_stages
        if self.pp > model.num_layers:
            raise SettingError(Code.PP_LAYERS, (
                f"`pp` {self.pp} exceeds the model's {model.num_layers} layers:"
                " every stage needs at least one"))
        if v < 1:
            raise SettingError(Code.RANGE, f"`virtual_stages` must be >= 1, got {v}")
        if self.pp * v > model.num_layers:
            raise SettingError(Code.CHUNK_LAYERS, (
                f"`pp` x `virtual_stages` = {self.pp} x {v} exceeds the model's"
                f" {model.num_layers} layers: every model chunk needs at least one"))
        self.schedule.check(self, model, self.micro_batches_per_step(global_batch))
        if self.pp_layers is not None:
            self.stage_layers(model.num_layers)


def spec_key(f: dataclasses.Field) -> str:
    """A plan field's key in a `--layout` spec."""
    return f.metadata["spec"] or f.name


def _spec_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


SPEC_FIELDS = {spec_key(f): f for f in dataclasses.fields(ParallelPlan)}
"""Every plan field by its `--layout` spec key."""


def parse_setting(f: dataclasses.Field, text: str, *, where: str) -> Any:
    """A plan field's value from its text (a spec item, a flag): its type, its choices, counts
    as comma-separated layer counts; SettingError naming `where` it came from otherwise."""
    kind, choices = str(f.type), f.metadata["choices"]
    if kind.startswith("bool"):
        if text not in ("0", "1", "true", "false"):
            raise SettingError(Code.CHOICE, f"{where} must be 0 or 1")
        return text in ("1", "true")
    if kind.startswith("tuple"):
        try:
            return tuple(int(n) for n in text.split(","))
        except ValueError:
            raise SettingError(Code.RANGE, f"{where} must be comma-separated layer numbers such"
                                           f" as 3,5, got {text!r}") from None
    if kind.startswith("float"):
        try:
            return float(text)
        except ValueError:
            raise SettingError(Code.RANGE, f"{where} must be a number, got {text!r}") from None
    if kind.startswith("int"):
        lowest = min(choices) if choices else 1  # zero's choices start at 0
        if not text.isdigit() or not lowest <= int(text) <= 1 << 20:
            raise SettingError(Code.RANGE, f"{where} must be a positive integer")
        value = int(text)
    else:
        value = text
    if choices is not None and value not in choices:
        raise SettingError(Code.CHOICE, f"{where} must be one of"
                                        f" {', '.join(map(str, choices))}")
    return value


def _is_list(key: str) -> bool:
    return key in SPEC_FIELDS and str(SPEC_FIELDS[key].type).startswith("tuple")


def parse_spec(spec: str) -> dict[str, Any]:
    """The fields a `--layout` spec fixes, by field name, typed: `tp=8,sp=1,recompute=selective`
    -> {"tp": 8, "sequence_parallel": True, "recompute": "selective"}. A list value (pp_layers)
    runs on over the items without `=` that follow it: `pp_layers=3,5,zero=1`."""
    fixed: dict[str, Any] = {}
    items = [part.strip() for part in spec.split(",") if part.strip()]
    merged: list[str] = []
    for item in items:
        if "=" not in item and merged and _is_list(merged[-1].partition("=")[0].strip()):
            merged[-1] += "," + item
        else:
            merged.append(item)
    for item in merged:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or key not in SPEC_FIELDS:
            raise SettingError(Code.CHOICE, f"`layout` item {item!r} is not KEY=VALUE with KEY"
                                            f" one of {', '.join(SPEC_FIELDS)}")
        f = SPEC_FIELDS[key]
        if f.name in fixed:  # (the later one would silently win)
            raise SettingError(Code.CHOICE, f"`layout` fixes {key} twice ({spec!r}): give each"
                                            " field once")
        fixed[f.name] = parse_setting(f, text.strip(), where=f"`layout` {key}={text.strip()}")
    return fixed
