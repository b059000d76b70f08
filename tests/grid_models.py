"""What the grid schemes' tests share (test_tp_summa.py, test_tp_cube.py): the dense output
layer their vocabulary layers are checked against, and the whole-model fp64 check of a model
built by a factory against the dense model of the same seed."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from meshtrain import ParallelMesh
from meshtrain.models import family_of
from meshtrain.parallel import CommRecorder, named_full_tensors
from meshtrain.parallel.communication import comm
from meshtrain.parallelize import build_model

TOL = dict(rtol=1e-10, atol=1e-13)
GPT_SHAPE = dict(num_layers=2, hidden_size=16, num_heads=4, vocab_size=37, max_seq_len=16)
LLAMA_SHAPE = GPT_SHAPE | dict(num_kv_heads=2, ffn_hidden_size=24)


@dataclass
class DenseOutputLayer:
    """A dense fp64 output layer's logits for `hidden` and its per-token losses, whose
    backward of (losses * weights).sum() has run: the reference of the grid output layers."""
    dense: nn.Module
    hidden: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    logits: torch.Tensor
    losses: torch.Tensor


def dense_output_layer(b: int, s: int, h: int, vocab: int, tied: bool) -> DenseOutputLayer:
    """A tied (embedding table) or untied (bias-free linear) output layer with one ignored
    target, as the grid schemes' layer tests check theirs against."""
    dense = nn.Embedding(vocab, h).double() if tied else nn.Linear(h, vocab, bias=False).double()
    hidden = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, vocab, (b, s))
    targets[0, 1] = -100
    weights = torch.randn(b, s, dtype=torch.float64)
    logits = hidden @ dense.weight.T
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    (losses.view(b, s) * weights).sum().backward()
    return DenseOutputLayer(dense, hidden, targets, weights, logits.detach(), losses.view(b, s))


def check_against_dense(cfg, factory, batch: int) -> CommRecorder:
    """Weights equal the dense model's, then the loss and, once partial gradients are summed
    over their axes, every gradient of one micro-batch of `batch` sequences of 8 tokens;
    returns the forward and backward's communication."""
    family = family_of(cfg)
    dense = build_model(cfg, ParallelMesh.local(), seed=3).double()
    model = family.model(cfg, factory, seed=3).double()
    dense_params = dict(named_full_tensors(dense))
    for name, full in named_full_tensors(model):
        assert torch.equal(full, dense_params.pop(name)), name
    assert not dense_params

    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, 9))
    ref_loss = dense.loss(dense(ids[:, :-1]), ids[:, 1:])
    ref_loss.backward()
    with CommRecorder() as recorder:
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
    assert_close(loss, ref_loss, **TOL)
    for axis, params in factory.partial_gradients(model, exclude=set()):
        for p in params:
            comm.all_reduce(p.grad, axis)
    dense_grads = dict(named_full_tensors(dense, grads=True))
    for name, grad in named_full_tensors(model, grads=True):
        assert_close(grad, dense_grads.pop(name), **TOL, msg=name)
    assert not dense_grads
    return recorder
