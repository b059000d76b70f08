"""The whole-model fp64 check the grid schemes' tests share (test_tp_summa.py, test_tp_cube.py):
a model built by a factory against the dense model of the same seed."""

import torch
from torch.testing import assert_close

from meshtrain import ParallelMesh
from meshtrain.models import family_of
from meshtrain.parallel import CommRecorder, comm, named_full_tensors

TOL = dict(rtol=1e-10, atol=1e-13)
GPT_SHAPE = dict(num_layers=2, hidden_size=16, num_heads=4, vocab_size=37, max_seq_len=16)
LLAMA_SHAPE = GPT_SHAPE | dict(num_kv_heads=2, ffn_hidden_size=24)


def check_against_dense(cfg, factory, batch: int) -> CommRecorder:
    """Weights equal the dense model's, then the loss and, once partial gradients are summed
    over their axes, every gradient of one micro-batch of `batch` sequences of 8 tokens;
    returns the forward and backward's communication."""
    family = family_of(cfg)
    dense = family.model(cfg, mesh=ParallelMesh.local(), seed=3).double()
    model = family.model(cfg, factory=factory, seed=3).double()
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
