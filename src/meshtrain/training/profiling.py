"""`profile_steps`: a torch.profiler trace of chosen steps on every rank, in the Chrome trace
format that ui.perfetto.dev and chrome://tracing read."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class StepProfiler:
    """Records the 1-based steps `window` on this rank into out/profile/rank<R>.json. A run
    resumed inside or after the window records nothing (its first step is not the window's)."""

    def __init__(self, window: range, out: Path, rank: int, device: torch.device):
        self.window, self.rank = window, rank
        self.path = out / "profile" / f"rank{rank}.json"
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._profile: profile | None = None

    def before(self, step: int) -> None:
        """Step `step` (1-based) is about to run."""
        if step == self.window.start:
            self._profile = profile(activities=self.activities)
            self._profile.start()

    def after(self, step: int) -> Path | None:
        """Step `step` ran; returns the trace's path once the window's last step has."""
        if self._profile is None or step != self.window.stop - 1:
            return None
        self._profile.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.path))
        self._profile = None
        return self.path
