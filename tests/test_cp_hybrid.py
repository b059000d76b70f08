"""Hybrid context parallelism (`cp_mode` hybrid): all-to-all over `cp_a2a` ranks inside, the
ring over cp / cp_a2a outside. The core against a dense masked reference (causal, window,
documents) at cp 4 = 2 x 2, the mesh's two sub-axes, the bytes each part sends against the
formula, training against one process, the refusals, and the planner's price."""

import math

import pytest
import torch
from harness import run_on_ranks, worker_mesh

from meshtrain.parallel import CommRecorder
from meshtrain.parallel.layers.attention import AttentionCore
from meshtrain.parallel.layers.context_parallel import context_parallel_positions
from meshtrain.parallel.layers.masks import AttentionMask

S, HEADS, KV_HEADS, D = 32, 4, 2, 8


def _qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, KV_HEADS, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _documents() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    starts = torch.rand(2, S, generator=g) < 0.2
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=-1)


def _dense(q, k, v, mask: AttentionMask):
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    positions = torch.arange(S)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(D)
    scores = scores.masked_fill(~mask.allowed(positions, positions), float("-inf"))
    return scores.softmax(-1) @ v


def _hybrid_core(a2a: int, window, documents: bool):
    """This rank's output and q/k/v gradients against the dense reference (largest error)."""
    mesh = worker_mesh(cp=4, cp_a2a=a2a)
    inner, outer = mesh.axis("cp_a2a"), mesh.axis("cp_ring")
    assert mesh.cp.rank == outer.rank * a2a + inner.rank  # the all-to-all innermost
    mask = AttentionMask(window, _documents() if documents else None)
    full = [t.requires_grad_() for t in _qkv()]
    reference = _dense(*full, mask)
    reference.pow(2).sum().backward()
    mine = context_parallel_positions(S, 4, mesh.cp.rank)
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in full]
    core = AttentionCore(dropout=0.0, eager=False, cp_axis=mesh.cp, cp_mode="hybrid",
                         recompute=False, cp_split=(inner, outer))
    out = core(*local, None, mask)
    out.pow(2).sum().backward()
    errors = [(out - reference[:, :, mine]).abs().max().item()]
    errors += [(t.grad - f.grad[:, :, mine]).abs().max().item()
               for t, f in zip(local, full, strict=True)]
    return max(errors)


def test_hybrid_attention_follows_the_mask():
    """cp 4 = 2 all-to-all x 2 ring, under a window over documents (the hardest mask)."""
    assert max(run_on_ranks(4, _hybrid_core, 2, 5, True)) < 1e-12


@pytest.mark.extended
@pytest.mark.parametrize("a2a,window,documents", [
    (2, None, False), (2, 5, False), (2, None, True), (4, 5, True), (1, 5, True)])
def test_hybrid_attention_follows_every_mask(a2a, window, documents):
    assert max(run_on_ranks(4, _hybrid_core, a2a, window, documents)) < 1e-12
