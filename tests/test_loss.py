"""Vocab-parallel cross-entropy against torch's dense cross-entropy."""

import pytest
import torch
import torch.nn.functional as F
from harness import run_on_ranks, worker_mesh
from torch.testing import assert_close

from meshtrain.parallel import CommRecorder, vocab_parallel_cross_entropy
from meshtrain.parallel.communication.comm import split_along


def _check_loss(tp, vocab, scale, dtype):
    mesh = worker_mesh(tp=tp)
    padded = -(-vocab // tp) * tp
    torch.manual_seed(11)
    b, s = 3, 7
    logits = (torch.randn(b, s, vocab, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, vocab, (b, s))
    targets[0, :3] = -100  # ignored positions
    targets[1, 0] = vocab - 1  # the last real id, next to the padding
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.double().view(-1, vocab), targets.view(-1),
                          reduction="none").view(b, s)
    grad_loss = torch.rand(b, s, dtype=torch.float64)
    ref.backward(grad_loss)

    # Pad as the vocab-parallel head does: -inf logits for ids >= vocab.
    full = torch.cat([logits, torch.full((b, s, padded - vocab), float("-inf"), dtype=dtype)], -1)
    local = split_along(full, mesh.tp, dim=-1).requires_grad_()
    with CommRecorder() as fwd:
        loss = vocab_parallel_cross_entropy(local, targets, mesh=mesh)
    with CommRecorder() as bwd:
        loss.backward(grad_loss.to(loss.dtype))

    assert loss.shape == targets.shape and loss.dtype == torch.float32
    assert (loss[0, :3] == 0).all()
    assert torch.isfinite(loss).all()
    assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6 * scale)
    expect_grad = split_along(torch.cat([ref_logits.grad, torch.zeros(b, s, padded - vocab,
                                                                      dtype=torch.float64)], -1),
                              mesh.tp, dim=-1)
    assert local.grad.dtype == dtype
    assert_close(local.grad.double(), expect_grad, rtol=1e-5, atol=1e-6)
    if tp > 1:
        # O(b*s): a MAX of b*s floats, then a SUM of the stacked (sum-exp, target logit).
        assert [(r.op, r.payload_bytes) for r in fwd.records] == [
            ("all_reduce", b * s * 4), ("all_reduce", 2 * b * s * 4)]
    assert bwd.count() == 0


@pytest.mark.parametrize("tp,vocab", [(1, 10), (2, 11), (4, 10), (4, 17)])
@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_vocab_parallel_cross_entropy(tp, vocab, scale):
    run_on_ranks(tp, _check_loss, tp, vocab, scale, torch.float32)


def test_vocab_parallel_cross_entropy_bf16_logits():
    run_on_ranks(2, _check_loss_bf16)


def _check_loss_bf16():
    mesh = worker_mesh(tp=2)
    logits = torch.randn(2, 3, 8).to(torch.bfloat16)
    targets = torch.randint(0, 8, (2, 3))
    local = split_along(logits, mesh.tp, dim=-1).requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, mesh=mesh)
    ref = F.cross_entropy(logits.float().view(-1, 8), targets.view(-1), reduction="none")
    assert_close(loss.view(-1), ref, rtol=1e-5, atol=1e-6)  # computed in fp32
    loss.sum().backward()
    assert local.grad.dtype == torch.bfloat16
