"""What a run reports: a progress bar on rank 0, metrics.jsonl, TensorBoard (when installed)
and W&B (when asked for)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from meshtrain.checkpointing.resuming import continue_advice
from meshtrain.config.settings import LoggingSettings
from meshtrain.data.corpus import write_atomic
from meshtrain.operations.failures import writing
from meshtrain.planner.hardware import Hardware, device_profile, load_hardware, model_tflops


def read_scalars(scalars: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim device tensors -> Python floats in one device-to-host transfer (each `.item()` of
    its own would wait for the device once per value)."""
    values = torch.stack([value.detach().double() for value in scalars.values()]).tolist()
    return dict(zip(scalars, values, strict=True))


class MetricsLog:
    """Appends one JSON object per row to `metrics.jsonl` (rank 0 only), in batches: rows wait
    in memory until `flush` (the loop flushes every `log_every` steps, at checkpoints and at the
    end), so a step costs no file write. Each row also goes to the `sinks` (TensorBoard, W&B:
    see `metric_sinks`).

    On resume from step N, rows after N (written after the checkpoint by an interrupted run) move
    to metrics.after_step_N.jsonl (`kept_aside`), so the file reads as one uninterrupted run and
    nothing is lost; lines that do not parse (a write cut short by a crash or a full disk) are
    dropped: `damaged` counts them. A failed write is a
    `RunFailure` naming the file, not a traceback.
    """

    def __init__(self, path: Path, *, resume_step: int | None = None, sinks: tuple = ()):
        self.path, self.damaged, self.sinks = path, 0, sinks
        self.kept_aside: Path | None = None
        with writing(path, self._advice):
            if resume_step is not None and path.exists():
                self._truncate(resume_step)
            self._file = open(path, "a")
        self._pending: list[str] = []

    def _advice(self) -> str:
        """After a failed write: the run's checkpoint to continue from, if one verifies."""
        return continue_advice(self.path.parent / "checkpoints")

    def _truncate(self, resume_step: int) -> None:
        """Keep the rows up to `resume_step`; the later ones go, in order, to `kept_aside`
        (metrics.after_step_N.jsonl), never deleted."""
        kept, later = [], []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                self.damaged += bool(line.strip())
                continue
            if isinstance(row, dict) and row.get("step", 0) <= resume_step:
                kept.append(line)
            elif isinstance(row, dict):
                later.append(line)
            else:
                self.damaged += 1
        if later:
            self.kept_aside = self.path.with_name(f"metrics.after_step_{resume_step}.jsonl")
            with open(self.kept_aside, "a") as aside:
                aside.write("".join(line + "\n" for line in later))
        write_atomic(self.path, "".join(line + "\n" for line in kept).encode())

    def write(self, row: dict) -> None:
        self._pending.append(json.dumps(row) + "\n")
        if not self.sinks:  # (the usual case: a step costs one JSON line)
            return
        scalars = {key: value for key, value in row.items()
                   if key != "step" and isinstance(value, int | float)}
        for sink in self.sinks:
            sink.log(scalars, row["step"])

    def flush(self) -> None:
        with writing(self.path, self._advice):
            self._file.write("".join(self._pending))
            self._file.flush()
        self._pending.clear()
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()
        for sink in self.sinks:
            sink.close()


def metric_sinks(out: Path, settings: LoggingSettings, *, resume_step: int | None,
                 config: dict) -> tuple:
    """Where rows go besides metrics.jsonl, named `run_name` (default: `out`'s name):
    TensorBoard under out/tensorboard/NAME when the package is installed, and W&B when
    `wandb_project` is set (`config`: the run's settings, recorded with it)."""
    name = settings.run_name or out.resolve().name
    sinks = []
    if importlib.util.find_spec("tensorboard") is not None:
        sinks.append(_TensorBoard(out / "tensorboard" / name, resume_step))
    if settings.wandb_project is not None:
        sinks.append(_WandB(out, name, settings.wandb_project, config))
    return tuple(sinks)


class _TensorBoard:
    """Scalars as TensorBoard events; on resume from step N the events an interrupted run wrote
    after N are hidden (`purge_step`), as metrics.jsonl drops its rows."""

    def __init__(self, log_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(str(log_dir), purge_step=purge)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """A Weights & Biases run whose id is kept in out/wandb/run_id, so a resumed (or restarted)
    run goes on logging to the same W&B run."""

    def __init__(self, out: Path, name: str, project: str, config: dict):
        import wandb

        id_file = out / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if not id_file.exists():
            write_atomic(id_file, uuid.uuid4().hex[:12].encode())
        self.run = wandb.init(project=project, name=name, id=id_file.read_text().strip(),
                              resume="allow", dir=str(out), config=config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def flush(self) -> None:
        """W&B sends in the background."""

    def close(self) -> None:
        self.run.finish()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Utilization:
    """What a step's tokens/s make of the hardware: model TFLOP/s per rank (per GPU on CUDA,
    one GPU a rank; `hardware.model_tflops`: the family's `flops_per_token` in Megatron-LM's
    convention, forward and backward, recomputation not counted) and MFU, those over the
    `hardware` profile's matmul peak in the run's `precision` (none without a profile or a
    peak)."""

    flops_per_token: float
    ranks: int
    precision: str
    hardware: Hardware | None

    @classmethod
    def of_run(cls, flops_per_token: float, *, ranks: int, precision: str,
               device: torch.device, hardware: str | None, local_ranks: int = 1) -> Utilization:
        """`hardware`: the run's `hardware` setting (a built-in name or a TOML file); None: the
        built-in profile of `device` (a CUDA device's by its name, none when no profile matches
        it; the CPU's, `cpu-gloo`), as `layout` auto plans with. On a CPU the peak is what this
        rank's threads can have of the machine's cores beside its `local_ranks` - 1 peers."""
        if hardware is not None:
            profile = load_hardware(hardware)
        else:
            profile = device_profile(torch.cuda.get_device_name(device)
                                     if device.type == "cuda" else None)
        if profile is not None and device.type == "cpu":
            cores = os.cpu_count() or 1
            profile = profile.for_cpu_rank(min(torch.get_num_threads(), cores / local_ranks))
        return cls(flops_per_token, ranks, precision, profile)

    def fields(self, tokens_per_s: float) -> dict[str, float]:
        """A metrics row's `tflops` and, where a peak is known, `mfu`."""
        tflops = model_tflops(self.flops_per_token, tokens_per_s, self.ranks)
        mfu = self.hardware.mfu(tflops, self.precision) if self.hardware is not None else None
        return {"tflops": tflops} | ({} if mfu is None else {"mfu": mfu})


class Progress:
    """Progress over optimizer steps showing loss and tokens/s (silent off rank 0): a tqdm bar
    on a terminal; otherwise (a log file, a scheduler's capture) one line every `interval`
    steps instead of carriage-return redraws, with the model TFLOP/s per rank, the MFU when
    known (`Utilization`) and an ETA from the mean time of the steps after this run's first
    (which pays for compilation, warm-up and allocation, and would inflate it)."""

    def __init__(self, *, total: int, initial: int, enabled: bool, interval: int = 1):
        self.enabled, self.total, self.interval = enabled, total, interval
        self.lines = enabled and not sys.stderr.isatty()
        self._bar = tqdm(total=total, initial=initial, disable=not enabled or self.lines,
                         unit="step", dynamic_ncols=True, file=sys.stderr, desc="train")
        self._initial, self._started = initial, time.perf_counter()
        self._steady: tuple[int, float] | None = None  # (step, time) the first step ended

    def update(self, *, step: int, loss: float, tokens_per_s: float, tflops: float,
               mfu: float | None = None, moe_load: float | None = None) -> None:
        """`moe_load`: the worst MoE layer's max/mean expert load, shown when given."""
        shown_mfu = "" if mfu is None else f", {mfu:.1%} MFU"
        shown_mfu += "" if moe_load is None else f", expert load max/mean {moe_load:.2f}"
        if self._steady is None:
            self._steady = (step, time.perf_counter())
        if self.lines and (step % self.interval == 0 or step == self.total):
            eta = _clock(self._per_step(step) * (self.total - step))
            print(f"train: step {step}/{self.total}, loss {loss:.4f}, {tokens_per_s:,.0f}"
                  f" tokens/s, {tflops:.3g} TFLOP/s per rank{shown_mfu}, ETA {eta}",
                  file=sys.stderr, flush=True)
        postfix = {"loss": f"{loss:.4f}", "tok_s": f"{tokens_per_s:,.0f}"}
        if mfu is not None:
            postfix["mfu"] = f"{mfu:.1%}"
        if moe_load is not None:
            postfix["load"] = f"{moe_load:.2f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def _per_step(self, step: int) -> float:
        """Seconds per step: the mean after the first step, or the first one's alone."""
        now = time.perf_counter()
        first, at = self._steady
        if step > first:
            return (now - at) / (step - first)
        return (now - self._started) / max(1, step - self._initial)

    def write(self, message: str) -> None:
        if self.enabled:
            self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


def _clock(seconds: float) -> str:
    """h:mm:ss, as tqdm writes its ETA."""
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class StepTimer:
    def __init__(self) -> None:
        self._start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._start = now - self._start, now
        return elapsed
