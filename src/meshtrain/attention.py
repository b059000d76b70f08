"""Causal self-attention with heads split over TP, and optionally the sequence split over CP.

The attention core (softmax(QK^T)V) runs one of: torch's SDPA, an explicit eager path (whose
saved tensors match the activation-memory formulas), ring attention or Ulysses all-to-all over
the context-parallel axis. Selective recomputation recomputes only this core in backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.context import ring_attention, ulysses_attention
from meshtrain.parallel.plan import ParallelPlan
from meshtrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from meshtrain.random import TENSOR_PARALLEL, RNGTracker
from meshtrain.recompute import recomputed


def eager_attention(q, k, v, p: float) -> torch.Tensor:
    """Explicit causal attention `[b, a, s, d]`: saves the s x s probabilities (and mask)."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # [b, a/tp, s, s]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).triu_(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    if p > 0.0:
        probs = F.dropout(probs, p, training=True)
    return probs @ v


class Attention(nn.Module):
    """Each TP rank owns num_heads/tp heads: fused QKV column-parallel (split per head), output
    projection row-parallel. Its input and output are `[b, s/tp, h]` under sequence parallelism."""

    def __init__(self, qkv: nn.Linear, proj: nn.Linear, *, num_heads: int, dropout: float,
                 eager: bool, mesh: ParallelMesh, plan: ParallelPlan):
        super().__init__()
        sp = plan.sequence_parallel
        self.qkv = ColumnParallelLinear.from_dense(qkv, mesh=mesh, output_blocks=3,
                                                   sequence_parallel=sp)
        self.proj = RowParallelLinear.from_dense(proj, mesh=mesh, input_is_parallel=True,
                                                 sequence_parallel=sp)
        self.num_local_heads = num_heads // mesh.tp.size
        self.head_dim = qkv.in_features // num_heads
        self.dropout, self.eager = dropout, eager
        self.cp_axis, self.cp_mode = mesh.cp, plan.cp_mode
        self.recompute_core = plan.recompute == "selective"

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.cp_axis.size > 1:
            seq_len = q.shape[-2] * self.cp_axis.size
            if self.cp_mode == "ring":
                return ring_attention(q, k, v, self.cp_axis, seq_len)
            return ulysses_attention(q, k, v, self.cp_axis, seq_len, self._local)
        return self._local(q, k, v, p)

    def _local(self, q, k, v, p: float = 0.0) -> torch.Tensor:
        if self.eager:
            return eager_attention(q, k, v, p)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    def forward(self, x: torch.Tensor, rng: RNGTracker) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, 3h/tp] (the whole local sequence, also under SP)
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.num_local_heads, self.head_dim).permute(2, 0, 3, 1, 4)

        def core(q, k, v):
            if not (self.dropout and self.training):  # nothing random: skip the RNG swap
                return self._core(q, k, v)
            with rng.fork(TENSOR_PARALLEL):  # heads differ per TP rank, so do their masks
                return self._core(q, k, v)

        out = recomputed(core, rng, q, k, v) if self.recompute_core and self.training \
            else core(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))  # proj input [b, s, h/tp]
