"""Cross-entropy over vocabulary-parallel logits, without ever gathering them.

Each TP rank holds logits for its slice of the vocabulary, `[b, s, V/tp]`. The loss needs only
three numbers per token from the whole vocabulary: the max (for stability), the sum of
exp(logit - max) and the target's logit. They move in two all-reduces of O(b*s) elements
(a MAX of b*s, then one SUM of the stacked 2*b*s), instead of the O(b*s*V) a gather would move.
The backward is local: softmax minus one-hot on this rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import comm
from meshtrain.precision import wide_dtype

IGNORE_INDEX = -100
"""The target id the loss skips (torch's and Hugging Face's convention)."""


def _local_target_logits(shifted: torch.Tensor, targets: torch.Tensor, vocab_start: int):
    """Target logit where this rank owns the target (0 elsewhere), and the ownership mask."""
    local = targets - vocab_start
    owned = (local >= 0) & (local < shifted.shape[-1])
    local = local.masked_fill(~owned, 0)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(~owned, 0.0), local, owned


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, axis: MeshAxis, ignore_index: int):
        ctx.logits_dtype = logits.dtype
        logits = logits.to(wide_dtype(logits.dtype))
        vocab_start = axis.rank * logits.shape[-1]
        ignored = targets == ignore_index
        targets = targets.masked_fill(ignored, 0)

        max_logit = logits.amax(dim=-1)  # [b, s]
        comm.all_reduce(max_logit, axis, op=dist.ReduceOp.MAX)
        exp = logits - max_logit.unsqueeze(-1)  # a fresh tensor we may overwrite
        target_logit, local_targets, owned = _local_target_logits(exp, targets, vocab_start)
        exp.exp_()
        stats = torch.stack([exp.sum(dim=-1), target_logit])  # [2, b, s]
        comm.all_reduce(stats, axis)
        sum_exp, target_logit = stats[0], stats[1]

        loss = (torch.log(sum_exp) - target_logit).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax of this rank's slice
        ctx.save_for_backward(exp, local_targets, owned, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_targets, owned, ignored = ctx.saved_tensors
        grad = softmax  # reuse the buffer: backward runs once
        grad.scatter_add_(-1, local_targets.unsqueeze(-1),
                          -owned.unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, *,
                                 mesh: ParallelMesh | MeshAxis,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross-entropy (shape of `targets`, 0 where ignored) of vocab-split logits.

    Communicates over the TP axis only: exact and stable for logits of any magnitude.
    The computation runs in fp32, or the logits' dtype when wider (fp64 parity tests); the
    gradient has the logits' dtype.
    """
    axis = mesh if isinstance(mesh, MeshAxis) else mesh.tp
    return _VocabParallelCrossEntropy.apply(local_logits, targets, axis, ignore_index)
