"""The parallel plan: every layout choice of a run, validated in one place.

Degrees say how many ranks each parallelism spans; the other fields say how the model is split
and executed on them. The CLI fills a plan from flags, a planner would produce one, and
`parallelize` applies it. `validate` checks it against a model config and the world size and
raises ValueError naming the settings in backticks (`pp_schedule`); the CLI shows them as flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from meshtrain.data.corpus import check_batch_sizes
from meshtrain.errors import Code, SettingError
from meshtrain.mesh import resolve_degrees
from meshtrain.parallel.runtime.pipeline import stage_layers
from meshtrain.parallel.schemes.registry import tp_scheme
from meshtrain.parallel.schemes.scheme import TPScheme

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")


def parse_dtype(name: str, setting: str) -> torch.dtype:
    if name not in DTYPES:
        raise SettingError(Code.CHOICE, (
            f"`{setting}` must be one of {', '.join(DTYPES)}, got"
            f" {name!r}"))
    return DTYPES[name]


@dataclass(frozen=True)
class ParallelPlan:
    """How a model runs across the mesh. Degrees not given are 1; `dp` fills the world."""

    tp: int = 1
    """Tensor-parallel degree (innermost mesh axis, inside a node)."""
    pp: int = 1
    """Pipeline-parallel degree."""
    dp: int | None = None
    """Data-parallel degree; None: world / (tp x pp x cp)."""
    cp: int = 1
    """Context-parallel degree: each rank holds 1/cp of every sequence."""
    ep: int = 1
    """Expert-parallel degree, carved out of dp x cp."""
    tp_scheme: str = "1d"
    """Tensor-parallel scheme: 1d (Megatron), 2d (SUMMA on a q x q grid, tp = q^2), 2.5d
    (q x q x depth) or 3d (q x q x q)."""
    tp_depth: int | None = None
    """2.5d's depth d (tp = q^2 d); None: the largest d leaving q >= 2."""
    sequence_parallel: bool = False
    """Megatron SP: norm/dropout/residual regions hold s/tp of the sequence."""
    cp_mode: str = "ring"
    """Context-parallel attention: ring (K/V passed around) or all2all (Ulysses, over heads)."""
    pp_schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved (1F1B over virtual stages) or 2bw (PipeDream-2BW)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedule)."""
    pp_layers: tuple[int, ...] | None = None
    """Layers per pipeline stage (pp x virtual_stages counts); None: an even split."""
    zero: int = 0
    """ZeRO stage over the data-parallel ranks: 0, 1 (optimizer states), 2 (+ gradients),
    3 (+ parameters)."""
    offload_optimizer: str = "none"
    """none, or cpu: ZeRO's master shard, its gradient and the Adam moments in host memory."""
    recompute: str = "none"
    """Recompute in backward: none, selective (attention core) or full (whole layers)."""
    recompute_layers: int | None = None
    """With full recompute, only the first k layers (None: all)."""
    precision: str = "fp32"
    """Parameter and activation dtype: fp32, bf16 or fp16 (16-bit keeps fp32 master weights),
    or fp64 to check a layout against one process to float64 precision."""
    grad_dtype: str = "fp32"
    """Dtype gradients are accumulated and reduced in: fp32 or the 16-bit precision (fp64
    parameters always reduce in fp64)."""
    micro_batch: int = 1
    """Sequences per forward/backward on one rank."""
    bucket_mb: float = 25.0
    """Gradient all-reduce (ZeRO: reduce-scatter) bucket size in MiB."""

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh degrees (after `resolved`)."""
        assert self.dp is not None, "resolve the plan against a world size first"
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp, "ep": self.ep}

    def resolved(self, world_size: int) -> ParallelPlan:
        """This plan with dp derived from the world size (degrees checked)."""
        degrees = resolve_degrees(world_size, tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp,
                                  ep=self.ep)
        return dataclasses.replace(self, dp=degrees["dp"])

    @property
    def scheme(self) -> TPScheme:
        """The tensor-parallel scheme (`parallel/schemes/registry.py`)."""
        return tp_scheme(self.tp_scheme)

    @property
    def tp_grid(self) -> dict[str, int]:
        """The TP block's grid axes and sizes (`TPScheme.grid`)."""
        return self.scheme.grid(self.tp, self.tp_depth)

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

    def stage_layers(self, num_layers: int) -> list[range]:
        """Every pipeline stage's (model chunk's, under interleaving) layers, in order."""
        return stage_layers(num_layers, self.pp * self.virtual_stages,
                            list(self.pp_layers) if self.pp_layers is not None else None)

    def validate(self, model, *, world_size: int, global_batch: int,
                 seq_len: int) -> ParallelPlan:
        """Check this plan against a model config (`TransformerConfig`), the world size, the
        global batch and the sequence length; returns it resolved."""
        plan = self.resolved(world_size)
        plan._validate_numbers(global_batch)
        model.validate()
        plan.scheme.check(plan, model)
        model.validate_for_tp(plan.head_parts)
        model.validate_for_ep(plan.ep)
        plan._validate_execution(model, seq_len)
        plan._validate_zero(model)
        plan._validate_pipeline(model, global_batch)
        return plan

    def _validate_numbers(self, global_batch: int) -> None:
        check_batch_sizes(global_batch=global_batch, micro_batch=self.micro_batch, dp=self.dp)
        precision = self.dtype
        if parse_dtype(self.grad_dtype, "grad_dtype") not in (torch.float32, precision):
            raise SettingError(Code.GRAD_DTYPE, (
                f"`grad_dtype` {self.grad_dtype} must be fp32 or the `precision`"
                f" dtype ({self.precision})"))
        if int(self.bucket_mb * 2**20) < 1:
            raise SettingError(Code.RANGE, f"`bucket_mb` must be positive, got {self.bucket_mb}")

    def _validate_execution(self, model, seq_len: int) -> None:
        """Sequence and context parallelism, recomputation."""
        tp, cp = self.tp, self.cp
        if self.cp_mode not in ("ring", "all2all"):
            raise SettingError(Code.CHOICE, (
                f"`cp_mode` must be ring or all2all, got {self.cp_mode!r}"))
        if self.recompute not in ("none", "selective", "full"):
            raise SettingError(Code.CHOICE, (
                f"`recompute` must be none, selective or full, got"
                f" {self.recompute!r}"))
        if self.recompute_layers is not None and self.recompute_layers < 0:
            raise SettingError(Code.RANGE, (
                f"`recompute_layers` must be >= 0, got {self.recompute_layers}"))
        if self.recompute_layers is not None and self.recompute != "full":
            raise SettingError(Code.RECOMPUTE_LAYERS, (
                "`recompute_layers` applies to `recompute` full only: add it or drop"
                " `recompute_layers`"))
        if self.sequence_parallel and tp == 1:
            raise SettingError(Code.SP_WITHOUT_TP, (
                "`sequence_parallel` needs `tp` > 1 (it splits the sequence over the"
                " tensor-parallel ranks)"))
        if cp > 1 and seq_len % (2 * cp):
            raise SettingError(Code.CP_SEQ_LEN, (
                f"`seq_len` {seq_len} must be divisible by 2 x cp = {2 * cp} (each"
                " rank holds 2 of 2 x cp chunks): choose a multiple"))
        local = seq_len // cp  # tokens per CP rank, split again over TP by sequence parallelism
        if self.sequence_parallel and local % tp:
            raise SettingError(Code.SP_SEQ_LEN, (
                f"`seq_len` {seq_len} / cp ({cp}) = {local} tokens per rank must be"
                f" divisible by tp ({tp}) for `sequence_parallel`: choose a multiple"))
        if cp > 1 and model.dropout > 0:
            raise SettingError(Code.CP_DROPOUT, (
                "attention dropout with `cp` > 1 is not supported: use `dropout` 0"))
        if cp > 1 and self.cp_mode == "all2all" and (model.num_heads // tp) % cp:
            raise SettingError(Code.ALL2ALL_HEADS, (
                f"`cp_mode` all2all needs heads per TP rank ({model.num_heads // tp})"
                f" divisible by `cp` {cp}: use `cp_mode` ring or another `cp`"))
        if model.moe_experts and (self.sequence_parallel or cp > 1):
            raise SettingError(Code.MOE_SEQUENCE_SPLIT, (
                "`moe_experts` with `sequence_parallel` or `cp` > 1 is not"
                " supported: routing assumes every TP/CP rank holds the whole"
                " micro-batch"))

    def _validate_zero(self, model) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise SettingError(Code.CHOICE, f"`zero` must be 0, 1, 2 or 3, got {self.zero}")
        if self.offload_optimizer not in ("none", "cpu"):
            raise SettingError(Code.CHOICE, (
                f"`offload_optimizer` must be none or cpu, got"
                f" {self.offload_optimizer!r}"))
        if self.zero and self.precision == "fp64":
            raise SettingError(Code.ZERO_FP64, (
                f"`zero` {self.zero} keeps fp32 master shards, which would round"
                " `precision` fp64's parameters: use `zero` 0 with fp64"))
        if self.offload_optimizer == "cpu" and self.zero == 0:
            raise SettingError(Code.OFFLOAD_WITHOUT_ZERO, (
                "`offload_optimizer` cpu offloads ZeRO's optimizer shard: add `zero`"
                " 1 (or 2, 3)"))
        if self.zero >= 2 and self.pp > 1:
            raise SettingError(Code.ZERO_PIPELINE, (
                f"`zero` {self.zero} does not combine with `pp` {self.pp}: a"
                " pipeline interleaves the backwards of many micro-batches, so"
                " sharded gradients would be reduce-scattered once per micro-batch"
                " per stage; use `zero` 1 with pipelines"))
        if self.zero and self.pp > 1 and self.pp_schedule == "2bw":
            raise SettingError(Code.ZERO_2BW, (
                "`zero` with `pp_schedule` 2bw is not supported (2BW keeps two full"
                " weight versions): use `zero` 1 with 1f1b or interleaved"))
        if self.zero == 3 and model.moe_experts:
            raise SettingError(Code.ZERO3_MOE, (
                "`zero` 3 does not shard MoE experts yet: use `zero` 1 or 2 with"
                " `moe_experts`"))

    def _validate_pipeline(self, model, global_batch: int) -> None:
        v, m = self.virtual_stages, self.micro_batches_per_step(global_batch)
        if self.pp > model.num_layers:
            raise SettingError(Code.PP_LAYERS, (
                f"`pp` {self.pp} exceeds the model's {model.num_layers} layers:"
                " every stage needs at least one"))
        if self.pp_schedule not in SCHEDULES:
            raise SettingError(Code.CHOICE, (
                f"`pp_schedule` must be gpipe, 1f1b, interleaved or 2bw, got"
                f" {self.pp_schedule!r}"))
        if self.pp_schedule == "2bw":
            self._validate_2bw(model, m)
        if v < 1:
            raise SettingError(Code.RANGE, f"`virtual_stages` must be >= 1, got {v}")
        if v > 1 and self.pp_schedule != "interleaved":
            raise SettingError(Code.VIRTUAL_STAGES_SCHEDULE, (
                f"`virtual_stages` {v} needs `pp_schedule` interleaved (got"
                f" {self.pp_schedule})"))
        if v > 1 and self.pp == 1:
            raise SettingError(Code.VIRTUAL_STAGES_PP, f"`virtual_stages` {v} needs `pp` > 1")
        if self.pp * v > model.num_layers:
            raise SettingError(Code.CHUNK_LAYERS, (
                f"`pp` x `virtual_stages` = {self.pp} x {v} exceeds the model's"
                f" {model.num_layers} layers: every model chunk needs at least one"))
        if self.pp_schedule == "interleaved" and self.pp > 1:
            if m % self.pp:
                raise SettingError(Code.INTERLEAVED_MICRO_BATCHES, (
                    f"`pp_schedule` interleaved needs the micro-batches per step"
                    f" (global batch / (micro-batch x dp) = {m}) divisible by `pp`"
                    f" {self.pp}: change `global_batch` or `micro_batch`"))
            if self.pp_layers is None and model.num_layers % (self.pp * v):
                raise SettingError(Code.INTERLEAVED_LAYERS, (
                    f"`pp_schedule` interleaved needs the {model.num_layers}"
                    f" layers divisible by `pp` x `virtual_stages` = {self.pp} x"
                    f" {v}, or explicit `pp_layers`"))
        if self.pp_layers is not None:
            self.stage_layers(model.num_layers)

    def _validate_2bw(self, model, m: int) -> None:
        if self.pp == 1:
            raise SettingError(Code.TWO_BW_PP, "`pp_schedule` 2bw needs `pp` > 1")
        if m < self.pp:
            raise SettingError(Code.TWO_BW_MICRO_BATCHES, (
                f"`pp_schedule` 2bw needs at least `pp` ({self.pp}) micro-batches per"
                f" step, got global batch / (micro-batch x dp) = {m}: raise"
                " `global_batch` or lower `micro_batch`"))
        if self.precision != "fp32":
            raise SettingError(Code.TWO_BW_PRECISION, (
                f"`pp_schedule` 2bw supports `precision` fp32 only, got"
                f" {self.precision}"))
        if model.moe_experts:
            raise SettingError(Code.TWO_BW_MOE, (
                "`pp_schedule` 2bw does not support MoE layers yet: use"
                " `pp_schedule` 1f1b with `moe_experts`"))
