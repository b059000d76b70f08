"""The cost model: predicted step time and memory of one layout of one model on one hardware.

Step time = compute + exposed communication + pipeline bubble (the three a user can act on).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.models.family import TransformerConfig
from meshtrain.planner.hardware import Hardware
from meshtrain.planner.layout import Layout

GIB = 2**30


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per device, by kind (the busiest pipeline stage)."""

    parameters: float
    gradients: float
    optimizer_states: float
    """Adam moments and fp32 master weights (ZeRO's K)."""
    activations: float
    """Saved for backward, at the schedule's peak of micro-batches in flight."""
    buffers: float
    """Communication buckets, gathered ZeRO-3 units, logits, workspace."""

    @property
    def total(self) -> float:
        return (self.parameters + self.gradients + self.optimizer_states + self.activations
                + self.buffers)

    def gib(self) -> dict[str, float]:
        return {"parameters": self.parameters / GIB, "gradients": self.gradients / GIB,
                "optimizer_states": self.optimizer_states / GIB,
                "activations": self.activations / GIB, "buffers": self.buffers / GIB,
                "total": self.total / GIB}


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    step_time_s: float
    """compute_s + exposed_comm_s + bubble_s."""
    compute_s: float
    """The busiest pipeline stage's forward, backward (and recompute) time over all
    micro-batches, plus the optimizer step."""
    exposed_comm_s: float
    """Communication not hidden behind compute."""
    bubble_s: float
    """Pipeline idle time of the busiest stage, from the schedule simulator."""
    tflops_per_gpu: float
    """Model FLOPs (the family's `flops_per_token`, no recomputation) per step / step time /
    devices."""
    mfu: float
    """tflops_per_gpu / the hardware's peak in the run's precision."""
    memory: MemoryBreakdown

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB


def predict(model: TransformerConfig, layout: Layout, hardware: Hardware, *, seq_len: int,
            global_batch: int, precision: str = "bf16") -> Prediction:
    """Predict one training step of `model` laid out as `layout` (already valid: the search
    checks layouts with `ParallelPlan.validate` first) on `hardware`."""
    raise NotImplementedError("the cost model lands next")
