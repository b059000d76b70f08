"""Run configuration: typed sections, TOML files, CLI overrides.

Sections (TOML tables of the same names, defined in `settings.py`): model, parallel, train,
data, checkpoint. The layout's settings are the fields of the run's `ParallelPlan` (`plan`),
and AdamW's, its schedule's and clipping's those of its `OptimizerSettings` (`optimizer`), each
in the table its field names (tp in [parallel], micro_batch and lr in [train]). Every setting is a
CLI flag of `meshtrain train` (underscores become dashes) whose help text is the field's `help`.
Precedence: defaults < --config FILE.toml < flags. A run's settings become a model config
(`model_config`, of the preset's family) and its plan; `validate` checks them all before any
rank starts. Errors name settings in backticks; the CLI shows them as flags.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import importlib.util
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshtrain.config.settings import (
    CONFIG_SETTINGS,
    CheckpointSettings,
    DataSettings,
    LoggingSettings,
    ModelSettings,
    ParallelSettings,
    TrainSettings,
    model_arg_key,
)
from meshtrain.data.blend import parse_data_path
from meshtrain.data.corpus import BYTE_VOCAB_SIZE, check_seed
from meshtrain.errors import Code, SettingError
from meshtrain.interop.checkpoint_formats import saved_model
from meshtrain.models import TransformerConfig, preset
from meshtrain.parallel.layers.cp_balance import CP_BALANCES
from meshtrain.parallel.layers.fp8 import check_fp8_device
from meshtrain.parallel.runtime.optim import OptimizerSettings
from meshtrain.parallel.runtime.plan import ParallelPlan, parse_setting
from meshtrain.parallel.runtime.process_groups import check_local_devices, resolve_device

DEFAULT_PRESET = "tiny"
MIN_COLLECTIVE_TIMEOUT_S = 1.0
RUN_PLAN = ParallelPlan(**{f.name: f.metadata["run_default"]
                           for f in dataclasses.fields(ParallelPlan)})
"""A run's layout before any setting: the plan's defaults, and the run's where they differ."""
SPREAD = {"plan": ParallelPlan, "optimizer": OptimizerSettings}
"""`RunConfig`'s settings objects whose fields each name their TOML table (`section`)."""
_OWNERS = {f: owner for owner, cls in SPREAD.items() for f in dataclasses.fields(cls)}


@dataclass
class RunConfig:
    model: ModelSettings = field(default_factory=ModelSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    data: DataSettings = field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    plan: ParallelPlan = field(default_factory=lambda: RUN_PLAN)
    """The layout: its fields are settings of the tables their `section` names."""
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    """AdamW, its learning-rate schedule and clipping: its fields are settings of [train]."""

    @property
    def run_name(self) -> str:
        """The run's name in every logger and in `offload_dir` (default: `out`'s name)."""
        return self.logging.run_name or Path(self.checkpoint.out).resolve().name

    @property
    def offload_run_folder(self) -> Path | None:
        """This run's folder in `offload_dir` under `offload_optimizer` nvme: the run name
        (separators and other odd characters as `_`) and a short hash of the resolved `out`,
        so runs into `a/r` and `b/r` never share one and the same run resumed finds its own."""
        if self.plan.offload_optimizer != "nvme":
            return None
        out = Path(self.checkpoint.out).resolve()
        tag = hashlib.sha256(os.fsencode(out)).hexdigest()[:8]
        name = re.sub(r"[^\w.-]", "_", self.run_name)
        return Path(self.plan.offload_dir) / f"{name}-{tag}"

    def offload_folder(self, rank: int) -> Path | None:
        """Where rank `rank` keeps ZeRO's states under `offload_optimizer` nvme."""
        folder = self.offload_run_folder
        return None if folder is None else folder / f"rank{rank}"

    def resolved(self, model: TransformerConfig, plan: ParallelPlan) -> RunConfig:
        """This config with what the run decided where the settings left it open: the model
        preset (unless `init_from` names the model), every model setting at the model's value
        (those `model_arg` sets stay there, not given twice), and the degrees (dp filled in),
        so config.toml names them."""
        m = self.model
        name = m.model if self.checkpoint.init_from else m.model or DEFAULT_PRESET
        by_arg = {model_arg_key(item) for item in m.model_arg or []}
        values = {key: getattr(model, key) for key in CONFIG_SETTINGS if key not in by_arg}
        return dataclasses.replace(self, model=dataclasses.replace(m, model=name, **values),
                                   plan=plan)

    def sections(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in SPREAD}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        tables = {name: dataclasses.asdict(sec) for name, sec in self.sections().items()}
        for f, owner in _OWNERS.items():
            value = getattr(getattr(self, owner), f.name)
            tables[f.metadata["section"]][f.name] = \
                ",".join(map(str, value)) if isinstance(value, tuple) else value
        return tables

    def to_toml(self) -> str:
        lines = []
        for name, values in self.to_dict().items():
            lines.append(f"[{name}]")
            for key, value in values.items():
                if value is not None:
                    lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)

    def model_config(self, vocab_size: int) -> TransformerConfig:
        """The `init_from` checkpoint's model (`_init_from_model`), or the preset's with the
        model settings given; one not given keeps the preset's value, except the vocabulary
        (the data's: `vocab_size`) and the positions (at least `seq_len`)."""
        if self.checkpoint.init_from:
            return self._init_from_model()
        m = self.model
        base = preset(m.model or DEFAULT_PRESET)
        given = self._given_model_settings(base, f"`model` {m.model or DEFAULT_PRESET!r}")
        given.setdefault("vocab_size", vocab_size)
        given.setdefault("max_seq_len", max(self.train.seq_len, base.max_seq_len))
        return dataclasses.replace(base, **given)

    def _given_model_settings(self, base: TransformerConfig, label: str) -> dict[str, Any]:
        """The model settings that are set (flags or TOML keys, and `model_arg`'s KEY=VALUE
        items for any field of `base`'s family); each key at most once."""
        m = self.model
        given = {key: getattr(m, key) for key in CONFIG_SETTINGS if getattr(m, key) is not None}
        fields = {f.name: f for f in dataclasses.fields(base)}
        by_arg: set[str] = set()
        for item in m.model_arg or []:
            key, sep, text = (part.strip() for part in item.partition("="))
            if not sep or key not in fields:
                raise SettingError(Code.MODEL_FIELDS,
                                   f"`model_arg` {item!r} is not KEY=VALUE with KEY a setting of"
                                   f" the {label}: one of {', '.join(fields)}")
            if key in given:
                also = "twice" if key in by_arg else f"twice: as `{key}` too"
                raise SettingError(Code.GIVEN_TWICE, f"`model_arg` {key} is given {also}; give"
                                                     " it once")
            given[key] = _typed_value(fields[key], text, f"`model_arg` {key}")
            by_arg.add(key)
        return given

    def _init_from_model(self) -> TransformerConfig:
        """The `init_from` checkpoint's model: its family and tensor shapes, which a `model`
        preset or shape setting must not change; the others (dropout, attention kernel, MoE
        routing) are the checkpoint's unless set. Positions without a table (rotary) grow to
        `seq_len`."""
        path = self.checkpoint.init_from
        saved = saved_model(path, num_heads=self.model.num_heads, setting="init_from")
        label = f"{type(saved).__name__.removesuffix('Config')} model in `init_from` {path}"
        chosen = preset(self.model.model) if self.model.model else saved
        if type(chosen) is not type(saved) or any(
                getattr(chosen, key) != getattr(saved, key) for key in saved.SHAPE_FIELDS
                if key not in ("vocab_size", "max_seq_len")):
            raise SettingError(Code.INIT_FROM_SHAPE,
                               f"`model` {self.model.model} is not the shape of the {label}: omit"
                               " `model`")
        given = self._given_model_settings(saved, label)
        for name, value in given.items():
            trial = dataclasses.replace(saved, **{name: value})
            changed = [key for key in saved.SHAPE_FIELDS
                       if getattr(trial, key) != getattr(saved, key)]
            if changed:
                raise SettingError(Code.INIT_FROM_SHAPE,
                                   f"`{name}` {value} would change the {changed[0]}"
                                   f" ({getattr(saved, changed[0])}) of the {label}: omit"
                                   f" `{name}`")
        if "max_seq_len" not in given and "max_seq_len" not in saved.SHAPE_FIELDS:
            given["max_seq_len"] = max(self.train.seq_len, saved.max_seq_len)
        return dataclasses.replace(saved, **given)


def _typed_value(f: dataclasses.Field, text: str, where: str) -> Any:
    """A model config field's value from text, by the field's declared type."""
    kinds = str(f.type).split(" | ")
    if "None" in kinds and text.lower() in ("none", "null"):
        return None
    for kind, convert in (("bool", _boolean), ("int", int), ("float", float), ("str", str)):
        if kind in kinds:
            try:
                value = convert(text)
            except ValueError:
                raise SettingError(Code.SETTING_TYPE,
                                   f"{where} must be of type {f.type}, got {text!r}") from None
            if kind == "float" and not math.isfinite(value):
                raise SettingError(Code.RANGE, f"{where} must be a finite number, got {text!r}")
            return value
    raise SettingError(Code.SETTING_TYPE, f"{where}: {f.type} settings are not set from text")


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError(text)
    return text.lower() in ("true", "1")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):  # (a tuple: layer indices or counts)
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def flag_fields() -> list[tuple[str, dataclasses.Field]]:
    """(section, field) for every setting, in a stable order (used to build the CLI): each
    section's own settings, then the plan's and the optimizer's fields of that section."""
    return [(name, f) for name, cls in (("model", ModelSettings), ("parallel", ParallelSettings),
                                         ("train", TrainSettings), ("data", DataSettings),
                                         ("checkpoint", CheckpointSettings),
                                         ("logging", LoggingSettings))
            for f in (*dataclasses.fields(cls),
                      *(f for f in _OWNERS if f.metadata["section"] == name))]


class ConfigFileError(ValueError):
    """A `config` TOML file that cannot be read: missing or not TOML."""


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        raise ConfigFileError(f"`config` {path}: no such file; pass an existing TOML file")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigFileError(f"`config` {path} is not valid TOML ({e}); fix the file") from None


def build_config(file_values: dict[str, dict[str, Any]], overrides: dict[str, dict[str, Any]]
                 ) -> RunConfig:
    """Defaults, then the TOML file's tables, then CLI overrides; unknown keys are errors."""
    cfg = RunConfig()
    known = {section: {f.name: f for s, f in flag_fields() if s == section}
             for section in cfg.sections()}
    spread: dict[str, dict[str, Any]] = {owner: {} for owner in SPREAD}
    for source, values in (("config file", file_values), ("flags", overrides)):
        for section, entries in values.items():
            if section not in known or not isinstance(entries, dict):
                raise SettingError(Code.UNKNOWN_SETTING,
                                   f"{source}: unknown section [{section}]; known:"
                                   f" {', '.join(cfg.sections())}")
            for key, value in entries.items():
                if key not in known[section]:
                    raise SettingError(Code.UNKNOWN_SETTING,
                                       f"{source}: unknown setting {section}.{key}; known:"
                                       f" {', '.join(known[section])}")
                f = known[section][key]
                value = coerce_setting(f"{section}.{key}", f, value)
                if f in _OWNERS:
                    spread[_OWNERS[f]][key] = value
                else:
                    setattr(getattr(cfg, section), key, value)
    for owner, values in spread.items():
        setattr(cfg, owner, dataclasses.replace(getattr(cfg, owner), **values))
    if cfg.checkpoint.out is not None and not cfg.checkpoint.out.strip():
        raise SettingError(Code.OUT_PATH,
                           "`out` is empty, which would write the run into the current directory:"
                           " name a directory, or leave `out` out for runs/<date-time>")
    if cfg.checkpoint.out is None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if "RANK" in os.environ and not run_id:
            raise SettingError(Code.SETTING_MISSING,
                               "`out` is required under this launcher: ranks cannot agree on a"
                               " default directory; pass `out` DIR")
        # Under torchrun every rank must name the same directory: use the shared run id.
        stamp = run_id if run_id and "RANK" in os.environ else \
            datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg.checkpoint.out = "runs/" + stamp
    return cfg


def coerce_setting(name: str, f: dataclasses.Field, value: Any) -> Any:
    """A setting's value of the field's type from a flag's text or a TOML value."""
    kind = f.type if isinstance(f.type, str) else str(f.type)
    if value is None:
        return None
    if kind.startswith("tuple"):  # layer counts: "3,5" (a flag, TOML) or [3, 5] (TOML)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            return tuple(value)
        return parse_setting(f, value if isinstance(value, str) else repr(value),
                             where=f"`{f.name}`")
    if kind.startswith("list"):  # flag values or a TOML list; numbers (weights) as their text
        if not isinstance(value, list) or not all(isinstance(v, str | int | float)
                                                  and not isinstance(v, bool) for v in value):
            raise SettingError(Code.SETTING_TYPE,
                               f"{name} must be a list of strings, got {value!r}")
        return [v if isinstance(v, str) else repr(v) for v in value]
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise SettingError(Code.SETTING_TYPE, f"{name} must be true or false, got {value!r}")
        return value
    if kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SettingError(Code.SETTING_TYPE, f"{name} must be an integer, got {value!r}")
        return value
    if kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SettingError(Code.SETTING_TYPE, f"{name} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise SettingError(Code.SETTING_TYPE, f"{name} must be a string, got {value!r}")
    return value


def world_size_of(cfg: RunConfig, env_world: int | None) -> int:
    """Ranks this run uses: torchrun's world, else --nproc, else the product of the degrees."""
    if env_world is not None:
        return env_world
    if cfg.parallel.nproc is not None:
        return cfg.parallel.nproc
    plan = cfg.plan
    return plan.tp * plan.pp * plan.cp * (plan.dp or 1)


def local_ranks(cfg: RunConfig, world_size: int) -> int:
    """The ranks on this machine: torchrun's local world, else all of them (`nproc`)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.nproc or world_size))


def validate(cfg: RunConfig, world_size: int) -> ParallelPlan:
    """Check every setting before any rank starts; returns the resolved plan."""
    t, p = cfg.train, cfg.parallel
    if p.nproc is not None and p.nproc < 1:
        raise SettingError(Code.RANGE, f"`nproc` must be positive, got {p.nproc}")
    if p.threads is not None and p.threads < 1:
        raise SettingError(Code.RANGE, f"`threads` must be positive, got {p.threads}")
    if p.threads is not None and p.threads > (cores := os.cpu_count() or 1):
        raise SettingError(Code.RANGE,
                           f"`threads` {p.threads} is more than this machine's {cores} cores:"
                           f" give at most {cores} (more threads only wait for one another)")
    plan = cfg.plan.resolved(world_size)
    plan.check_trainable()
    check_local_devices(p.device, local_ranks(cfg, world_size))
    _validate_train(t)
    cfg.optimizer.validate()
    if cfg.checkpoint.keep_last < 0:
        raise SettingError(Code.RANGE, f"`keep_last` must be >= 0 (0 keeps every checkpoint), got"
                                       f" {cfg.checkpoint.keep_last}")
    if not MIN_COLLECTIVE_TIMEOUT_S <= p.collective_timeout < 1e7:
        raise SettingError(Code.RANGE, f"`collective_timeout` must be a number of seconds from"
                                       f" {MIN_COLLECTIVE_TIMEOUT_S:g} (below, a collective of a"
                                       f" healthy run times out), got {p.collective_timeout}")
    _validate_restarts(cfg)
    _validate_stragglers(p)
    _validate_logging(cfg.logging, t.stop_at or t.steps)
    _validate_data(cfg.data)
    model = cfg.model_config(vocab_size=cfg.model.vocab_size or BYTE_VOCAB_SIZE)
    if t.seq_len > model.max_seq_len:
        raise SettingError(Code.SEQ_LEN_MAX, f"`seq_len` {t.seq_len} exceeds `max_seq_len`"
                                             f" {model.max_seq_len}: raise `max_seq_len` or"
                                             " shorten `seq_len`")
    _validate_packing(cfg, plan)
    if p.trace and not plan.schedule.flushes:
        raise SettingError(Code.TRACE_SCHEDULE,
                           f"`trace` draws one flush step; a {plan.pp_schedule} step overlaps its"
                           " neighbours (no flush): trace `pp_schedule` 1f1b instead")
    groups = p.replica_groups if p.fault_tolerance else 1  # each group trains its share
    if groups > 1 and t.global_batch % (groups * plan.micro_batch * plan.dp):
        raise SettingError(Code.REPLICA_GROUPS,
                           f"`global_batch` {t.global_batch} must be divisible by"
                           f" `replica_groups` x `micro_batch` x dp = {groups} x"
                           f" {plan.micro_batch} x {plan.dp}: each group trains an equal share")
    plan = plan.validate(model, world_size=world_size, global_batch=t.global_batch // groups,
                         seq_len=t.seq_len)
    if plan.fp8 != "none":  # the one plan setting that depends on the device
        check_fp8_device(resolve_device(p.device), plan.fp8)
    return plan


def _validate_stragglers(p: ParallelSettings) -> None:
    if p.straggler_window < 0:
        raise SettingError(Code.RANGE, f"`straggler_window` must be >= 0 steps (0: off), got"
                                       f" {p.straggler_window}")
    if not 1.0 < p.straggler_threshold < float("inf"):
        raise SettingError(Code.RANGE, f"`straggler_threshold` must be a number above 1 (a"
                                       f" rank's compute over the median), got"
                                       f" {p.straggler_threshold}")
    if p.drop_stragglers < 0:
        raise SettingError(Code.RANGE, f"`drop_stragglers` must be >= 0 windows (0: off), got"
                                       f" {p.drop_stragglers}")
    if p.drop_stragglers and not (p.fault_tolerance and p.straggler_window):
        raise SettingError(Code.FT_SETTING, "`drop_stragglers` restarts a replica group: it needs"
                                            " `fault_tolerance` and `straggler_window`")


def _validate_logging(log: LoggingSettings, steps: int) -> None:
    """Profiler steps within the run; the W&B package present when a project is named."""
    if log.profile_steps is not None:
        profile_window(log.profile_steps, steps)
    if log.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise SettingError(Code.WANDB_PACKAGE,
                           "`wandb_project` needs the wandb package: pip install"
                           " 'meshtrain[wandb]' (or drop `wandb_project`)")


def profile_window(spec: str, steps: int) -> range:
    """The 1-based steps `profile_steps` ("A:B") names, checked against the run's `steps`."""
    first, _, last = spec.partition(":")
    try:
        window = range(int(first), int(last or first) + 1)
    except ValueError:
        window = range(0)
    if not window or window.start < 1 or window.stop - 1 > steps:
        raise SettingError(Code.RANGE,
                           f"`profile_steps` {spec!r} must be A:B with 1 <= A <= B <= the run's"
                           f" {steps} steps, e.g. 5:7")
    return window


def _validate_data(d: DataSettings) -> None:
    """The data settings' own values (the files are read, and checked, before any rank starts:
    `Blend`)."""
    if not 0.0 < d.val_fraction < 1.0:
        raise SettingError(Code.RANGE, f"`val_fraction` must be in (0, 1), got {d.val_fraction}")
    if d.data is not None and d.data_path is not None:
        raise SettingError(Code.DATA_BLEND, "`data` and `data_path` exclude each other: put"
                                            " every file in `data_path` (one FILE, or W1 FILE1"
                                            " W2 FILE2 ...) and drop `data`")
    if d.data_path is not None:
        parse_data_path(d.data_path)
    if d.cp_balance not in CP_BALANCES:
        raise SettingError(Code.CHOICE, f"`cp_balance` must be one of {', '.join(CP_BALANCES)},"
                                        f" got {d.cp_balance}")


def _validate_packing(cfg: RunConfig, plan: ParallelPlan) -> None:
    """Packed-document settings the layout can run (whether the data marks documents is
    checked where it is read: `check_packing`)."""
    d = cfg.data
    if d.reset_positions and not d.document_mask:
        raise SettingError(Code.RESET_POSITIONS_MASK,
                           "`reset_positions` restarts positions at documents that attention still"
                           " crosses: add `document_mask`")
    if d.document_mask and plan.batch_parts > 1:
        raise SettingError(Code.DOCUMENT_MASK_SPLIT,
                           f"`document_mask` needs whole micro-batches on every rank; `tp_scheme`"
                           f" {plan.tp_scheme} splits them {plan.batch_parts} ways: use"
                           " `tp_scheme` 1d")


def check_packing(cfg: RunConfig, eod_id: int | None) -> None:
    """Refuse packed-document settings on data that records no end-of-document token."""
    wanted = [name for name in ("document_mask", "reset_positions", "eod_mask_loss")
              if getattr(cfg.data, name)]
    if wanted and eod_id is None:
        d, where = cfg.data, "the built-in corpus"
        if d.data is not None:
            where = f"`data` {d.data}"
        elif d.data_path is not None:
            where = f"`data_path` {' '.join(d.data_path)}"
        raise SettingError(Code.DOCUMENTS_WITHOUT_EOD,
                           f"`{wanted[0]}` needs documents, and {where} marks none (no eod_id):"
                           " prepare the text with `meshtrain prepare`, which ends every document"
                           f" with its end-of-document token, or drop `{wanted[0]}`")


def _validate_restarts(cfg: RunConfig) -> None:
    c = cfg.checkpoint
    if c.save_every < 0:
        raise SettingError(Code.RANGE, f"`save_every` must be >= 0, got {c.save_every}")
    if not 0.0 <= c.save_every_minutes < float("inf"):
        raise SettingError(Code.RANGE,
                           f"`save_every_minutes` must be >= 0, got {c.save_every_minutes}")
    if c.resume and c.auto_resume:
        raise SettingError(Code.SETTINGS_EXCLUSIVE,
                           "`resume` and `auto_resume` exclude each other: `auto_resume` resumes"
                           " when there is a checkpoint; pass one of them")
    if cfg.parallel.max_restarts < 0:
        raise SettingError(Code.RANGE,
                           f"`max_restarts` must be >= 0, got {cfg.parallel.max_restarts}")
    if cfg.parallel.max_restarts and not (c.auto_resume or cfg.parallel.fault_tolerance):
        raise SettingError(Code.MAX_RESTARTS_RESUME,
                           "`max_restarts` restarts the ranks with the same flags: add"
                           " `auto_resume` so they continue from the newest checkpoint")


def _validate_train(t: TrainSettings) -> None:
    for name in ("steps", "global_batch", "seq_len", "eval_batches", "log_every",
                 "max_nonfinite_steps"):
        if getattr(t, name) < 1:
            raise SettingError(Code.RANGE, f"`{name}` must be positive, got {getattr(t, name)}")
    if t.eval_every < 0:
        raise SettingError(Code.RANGE, f"`eval_every` must be >= 0, got {t.eval_every}")
    if t.stop_at is not None and not 1 <= t.stop_at <= t.steps:
        raise SettingError(Code.RANGE,
                           f"`stop_at` must be between 1 and `steps` ({t.steps}), got {t.stop_at}")
    if t.loss_scale_window < 1:
        raise SettingError(Code.RANGE,
                           f"`loss_scale_window` must be positive, got {t.loss_scale_window}")
    check_seed(t.seed)
