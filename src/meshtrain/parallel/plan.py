"""How a model is executed across the mesh, beyond its shape (GPTConfig) and degrees (mesh)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ParallelPlan:
    """Execution choices that change what is communicated or stored, not the math."""

    sequence_parallel: bool = False
    """Megatron SP: LayerNorm/dropout/residual regions hold s/tp of the sequence."""
    cp_mode: Literal["ring", "all2all"] = "ring"
    """Context-parallel attention: K/V passed around a ring, or Ulysses all-to-all over heads."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Recompute in backward: nothing, the attention core, or whole transformer layers."""
    recompute_layers: int | None = None
    """With full recompute, only the first k layers (None: all)."""


def validate_plan(plan: ParallelPlan, *, tp: int, cp: int, num_heads: int, seq_len: int,
                  dropout: float, moe: bool) -> None:
    """Raise ValueError (one line naming the flag and the fix) for a plan that cannot run."""
    if plan.cp_mode not in ("ring", "all2all"):
        raise ValueError(f"--cp-mode must be ring or all2all, got {plan.cp_mode!r}")
    if plan.recompute not in ("none", "selective", "full"):
        raise ValueError(f"--recompute must be none, selective or full, got {plan.recompute!r}")
    if plan.recompute_layers is not None and plan.recompute_layers < 0:
        raise ValueError(f"--recompute-layers must be >= 0, got {plan.recompute_layers}")
    if plan.recompute_layers is not None and plan.recompute != "full":
        raise ValueError("--recompute-layers applies to --recompute full only: add it or drop"
                         " --recompute-layers")
    if plan.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tp > 1 (it splits the sequence over the"
                         " tensor-parallel ranks)")
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"--seq-len {seq_len} must be divisible by 2 x cp = {2 * cp} (each rank"
                         " holds 2 of 2 x cp chunks): choose a multiple")
    local = seq_len // cp  # tokens per CP rank, split again over TP by sequence parallelism
    if plan.sequence_parallel and local % tp:
        raise ValueError(f"--seq-len {seq_len} / cp ({cp}) = {local} tokens per rank must be"
                         f" divisible by tp ({tp}) for --sequence-parallel: choose a multiple")
    if cp > 1 and dropout > 0:
        raise ValueError("attention dropout with --cp > 1 is not supported: use --dropout 0")
    if cp > 1 and plan.cp_mode == "all2all" and (num_heads // tp) % cp:
        raise ValueError(f"--cp-mode all2all needs heads per TP rank ({num_heads // tp}) divisible"
                         f" by --cp {cp}: use --cp-mode ring or another --cp")
    if moe and (plan.sequence_parallel or cp > 1):
        raise ValueError("--moe-experts with --sequence-parallel or --cp > 1 is not supported:"
                         " routing assumes every TP/CP rank holds the whole micro-batch")
