"""What a run reports: a progress bar on rank 0, metrics.jsonl (and TensorBoard if installed)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from meshtrain.data.corpus import write_atomic
from meshtrain.operations.failures import writing


def read_scalars(scalars: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim device tensors -> Python floats in one device-to-host transfer (each `.item()` of
    its own would wait for the device once per value)."""
    values = torch.stack([value.detach().double() for value in scalars.values()]).tolist()
    return dict(zip(scalars, values, strict=True))


class MetricsLog:
    """Appends one JSON object per row to `metrics.jsonl` (rank 0 only), in batches: rows wait
    in memory until `flush` (the loop flushes every `log_every` steps, at checkpoints and at the
    end), so a step costs no file write.

    On resume from step N, rows after N (written after the checkpoint by an interrupted run) are
    dropped so the file reads as one uninterrupted run, and so are lines that do not parse (a
    write cut short by a crash or a full disk): `damaged` counts them. A failed write is a
    `RunFailure` naming the file, not a traceback.
    """

    def __init__(self, path: Path, *, resume_step: int | None = None):
        self.path, self.damaged = path, 0
        with writing(path):
            if resume_step is not None and path.exists():
                self._truncate(resume_step)
            self._file = open(path, "a")
        self._pending: list[str] = []
        self._tensorboard = _tensorboard_writer(path.parent / "tensorboard", resume_step)

    def _truncate(self, resume_step: int) -> None:
        kept = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                self.damaged += bool(line.strip())
                continue
            if isinstance(row, dict) and row.get("step", 0) <= resume_step:
                kept.append(line)
            else:
                self.damaged += not isinstance(row, dict)
        write_atomic(self.path, "".join(line + "\n" for line in kept).encode())

    def write(self, row: dict) -> None:
        self._pending.append(json.dumps(row) + "\n")
        if self._tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._tensorboard.add_scalar(key, value, row["step"])

    def flush(self) -> None:
        with writing(self.path):
            self._file.write("".join(self._pending))
            self._file.flush()
        self._pending.clear()
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _tensorboard_writer(log_dir: Path, resume_step: int | None):
    """A writer that, on resume from step N, hides the events an interrupted run wrote after N
    (TensorBoard's `purge_step`), as metrics.jsonl drops its rows."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    purge = None if resume_step is None else resume_step + 1
    return SummaryWriter(str(log_dir), purge_step=purge)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """Progress over optimizer steps showing loss and tokens/s (silent off rank 0): a tqdm bar
    on a terminal; otherwise (a log file, a scheduler's capture) one line every `interval`
    steps instead of carriage-return redraws."""

    def __init__(self, *, total: int, initial: int, enabled: bool, interval: int = 1):
        self.enabled, self.total, self.interval = enabled, total, interval
        self.lines = enabled and not sys.stderr.isatty()
        self._bar = tqdm(total=total, initial=initial, disable=not enabled or self.lines,
                         unit="step", dynamic_ncols=True, file=sys.stderr, desc="train")

    def update(self, *, step: int, loss: float, tokens_per_s: float) -> None:
        if self.lines and (step % self.interval == 0 or step == self.total):
            print(f"train: step {step}/{self.total}, loss {loss:.4f}, {tokens_per_s:,.0f}"
                  " tokens/s", file=sys.stderr, flush=True)
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self._bar.update(1)

    def write(self, message: str) -> None:
        if self.enabled:
            self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()


class StepTimer:
    def __init__(self) -> None:
        self._start = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        elapsed, self._start = now - self._start, now
        return elapsed
