"""What a run reports: a progress bar on rank 0, metrics.jsonl (and TensorBoard if installed)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm


class MetricsLog:
    """Appends one JSON object per row to `metrics.jsonl` (rank 0 only).

    On resume from step N, rows after N (written after the checkpoint by an interrupted run) are
    dropped so the file reads as one uninterrupted run.
    """

    def __init__(self, path: Path, *, resume_step: int | None = None):
        self.path = path
        if resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        self._file = open(path, "a")
        self._tensorboard = _tensorboard_writer(path.parent / "tensorboard")

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, int | float):
                    self._tensorboard.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(log_dir))


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Progress:
    """tqdm bar over optimizer steps showing loss and tokens/s (silent off rank 0)."""

    def __init__(self, *, total: int, initial: int, enabled: bool):
        self.enabled = enabled
        self._bar = tqdm(total=total, initial=initial, disable=not enabled, unit="step",
                         dynamic_ncols=True, file=sys.stderr, desc="train")

    def update(self, *, loss: float, tokens_per_s: float) -> None:
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
