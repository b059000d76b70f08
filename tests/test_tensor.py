"""Tensor-parallel layers against their dense counterparts at tp in {1, 2, 4}."""

import pytest
import torch
from harness import run_on_ranks, worker_mesh
from torch import nn
from torch.testing import assert_close

from meshtrain.errors import Code, SettingError
from meshtrain.parallel import (
    ColumnParallelLinear,
    CommRecorder,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from meshtrain.parallel.communication.comm import all_gather, split_along

TOL = dict(rtol=1e-5, atol=1e-6)


def _dense_linear_and_input(in_f, out_f, seed=0):
    torch.manual_seed(seed)
    dense = nn.Linear(in_f, out_f)
    x = torch.randn(3, 5, in_f, requires_grad=True)
    return dense, x


def _check_column(tp, output_blocks, gather_output):
    mesh = worker_mesh(tp=tp)
    in_f, out_f = 8, 12 * output_blocks
    dense, x = _dense_linear_and_input(in_f, out_f)
    torch.manual_seed(0)  # same seed -> the slice of the dense layer, without from_dense
    built = ColumnParallelLinear(in_f, out_f, mesh=mesh, output_blocks=output_blocks)
    layer = ColumnParallelLinear.from_dense(dense, mesh=mesh, output_blocks=output_blocks,
                                            gather_output=gather_output)
    assert_close(built.weight, layer.weight, rtol=0, atol=0)
    assert layer.weight.shape == (out_f // tp, in_f)
    # Rank r holds rows r of every block (q, k, v of a fused projection).
    expect = torch.cat([b.chunk(tp)[mesh.tp.rank] for b in dense.weight.chunk(output_blocks)])
    assert_close(layer.weight, expect, rtol=0, atol=0)

    x_par = x.detach().clone().requires_grad_()
    with CommRecorder() as fwd:
        y = layer(x_par)
    ref = dense(x)
    if gather_output:
        assert_close(y, ref, **TOL)
    else:
        expect_y = torch.cat([b.chunk(tp, -1)[mesh.tp.rank] for b in ref.chunk(output_blocks, -1)],
                             dim=-1)
        assert_close(y, expect_y, **TOL)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    local_grad = grad_out if gather_output else torch.cat(
        [b.chunk(tp, -1)[mesh.tp.rank] for b in grad_out.chunk(output_blocks, -1)], dim=-1)
    with CommRecorder() as bwd:
        y.backward(local_grad)
    assert_close(x_par.grad, x.grad, **TOL)
    assert_close(layer.to_dense().weight, dense.weight, rtol=0, atol=0)
    assert_close(_unshard_grad(layer, "weight"), dense.weight.grad, **TOL)
    assert_close(_unshard_grad(layer, "bias"), dense.bias.grad, **TOL)
    if tp > 1:
        n_out = 1 if gather_output else 0
        assert fwd.count() == n_out and fwd.count("all_gather", "tp") == n_out
        # f: one all-reduce of the input's gradient in backward
        assert bwd.count("all_reduce", "tp") == 1
        assert bwd.payload_bytes("all_reduce", "tp") == x.numel() * 4


def _unshard_grad(layer, name):
    from meshtrain.parallel.layers.tensor import unshard_tensor
    return unshard_tensor(getattr(layer, name).grad, layer.shards[name], layer.tp_axis)


def _check_row(tp, input_is_parallel):
    mesh = worker_mesh(tp=tp)
    dense, x = _dense_linear_and_input(16, 6, seed=1)
    layer = RowParallelLinear.from_dense(dense, mesh=mesh, input_is_parallel=input_is_parallel)
    assert layer.weight.shape == (6, 16 // tp)
    assert_close(layer.weight, dense.weight.chunk(tp, dim=1)[mesh.tp.rank], rtol=0, atol=0)
    x_in = split_along(x.detach(), mesh.tp, dim=-1) if input_is_parallel else x.detach().clone()
    x_in.requires_grad_()
    with CommRecorder() as fwd:
        y = layer(x_in)
    ref = dense(x)
    assert_close(y, ref, **TOL)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    with CommRecorder() as bwd:
        y.backward(grad_out)
    expect_xgrad = split_along(x.grad, mesh.tp, dim=-1) if input_is_parallel else x.grad
    assert_close(x_in.grad, expect_xgrad, **TOL)
    assert_close(_unshard_grad(layer, "weight"), dense.weight.grad, **TOL)
    assert_close(layer.bias.grad, dense.bias.grad, **TOL)
    assert_close(layer.to_dense().weight, dense.weight, rtol=0, atol=0)
    if tp > 1:
        # g: one all-reduce of the [.., out] partial sums forward, nothing else
        assert fwd.count() == 1 and fwd.payload_bytes("all_reduce", "tp") == ref.numel() * 4
        assert bwd.count("all_reduce") == 0
        assert bwd.count("all_gather") == (0 if input_is_parallel else 1)


def _check_embedding(tp, vocab):
    mesh = worker_mesh(tp=tp)
    torch.manual_seed(5)
    dense = nn.Embedding(vocab, 8)
    torch.manual_seed(5)
    built = VocabParallelEmbedding(vocab, 8, mesh=mesh)
    layer = VocabParallelEmbedding.from_dense(dense, mesh=mesh)
    assert_close(built.weight, layer.weight, rtol=0, atol=0)
    padded = -(-vocab // tp) * tp
    assert layer.weight.shape == (padded // tp, 8)
    start = mesh.tp.rank * (padded // tp)
    real = max(0, min(padded // tp, vocab - start))
    assert torch.count_nonzero(layer.weight[real:]) == 0  # padded rows are zero
    ids = torch.arange(vocab).repeat(2, 1)  # every id, including those at shard edges
    with CommRecorder() as fwd:
        out = layer(ids)
    ref = dense(ids)
    assert_close(out, ref, **TOL)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    out.backward(grad)
    assert_close(_unshard_grad(layer, "weight"), dense.weight.grad, **TOL)
    assert torch.count_nonzero(layer.weight.grad[real:]) == 0
    assert layer.to_dense().weight.shape == (vocab, 8)
    assert_close(layer.to_dense().weight, dense.weight, rtol=0, atol=0)
    # As the output layer: padded logits are -inf, so they take no probability or gradient.
    h = torch.randn(2, 3, 8, requires_grad=True)
    logits = layer.logits(h)
    full = all_gather(logits.detach(), mesh.tp, dim=-1)
    assert torch.isinf(full[..., vocab:]).all()
    assert_close(full[..., :vocab], h.detach() @ dense.weight.detach().T, **TOL)
    if tp > 1:
        assert fwd.count() == 1 and fwd.payload_bytes("all_reduce", "tp") == ref.numel() * 4


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("output_blocks,gather_output", [(1, False), (1, True), (3, False),
                                                          (3, True)])
def test_column_parallel_linear(tp, output_blocks, gather_output):
    run_on_ranks(tp, _check_column, tp, output_blocks, gather_output)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("input_is_parallel", [False, True])
def test_row_parallel_linear(tp, input_is_parallel):
    run_on_ranks(tp, _check_row, tp, input_is_parallel)


@pytest.mark.parametrize("tp,vocab", [(1, 10), (2, 11), (4, 10), (4, 13)])
def test_vocab_parallel_embedding(tp, vocab):
    run_on_ranks(tp, _check_embedding, tp, vocab)


def test_invalid_shapes_raise():
    run_on_ranks(4, _check_invalid_4)


def _check_invalid_4():
    mesh = worker_mesh(tp=4)
    with pytest.raises(ValueError, match=r"out_features \(6\) must be divisible by tp"):
        ColumnParallelLinear(8, 6, mesh=mesh)
    with pytest.raises(ValueError, match=r"in_features \(6\) must be divisible by tp"):
        RowParallelLinear(6, 8, mesh=mesh)
    with pytest.raises(ValueError,
                       match=r"out_features \(18\) must be divisible by 3 blocks x tp \(4\)"):
        ColumnParallelLinear(8, 18, mesh=mesh, output_blocks=3)  # q, k, v of 6 rows, 4 ranks
    # the defaults compose in their natural order; an input of the wrong width is one line
    dense_fc, x = _dense_linear_and_input(8, 16)
    dense_proj = nn.Linear(16, 8)
    fc = ColumnParallelLinear.from_dense(dense_fc, mesh=mesh)
    proj = RowParallelLinear.from_dense(dense_proj, mesh=mesh)
    assert_close(proj(torch.relu(fc(x))), dense_proj(torch.relu(dense_fc(x))), **TOL)
    with pytest.raises(SettingError, match=r"^RowParallelLinear\(16, 8\) with `input_is_parallel`"
                       r"=True at tp 4 takes inputs of last dim 4, got 16: pass"
                       r" `input_is_parallel`=False$") as refused:
        proj(torch.randn(2, 16))
    assert refused.value.code is Code.LAYER_INPUT


def _check_column_group(tp, sequence_parallel):
    """A query projection and a key/value projection (two blocks, replicated over tp / 2
    ranks when tp exceeds the 2 key/value heads) computed as one column group: outputs, input
    gradient and weight gradients (replicas summed over their tp_block) equal the dense
    layers'; one input communication each way; the joined weight is not saved for backward."""
    from meshtrain.memory import saved_activation_bytes
    from meshtrain.parallel.communication.comm import all_reduce
    from meshtrain.parallel.layers.sharding import GridPosition, is_primary, shard_pieces
    from meshtrain.parallel.layers.tensor import ColumnParallelGroup

    mesh = worker_mesh(tp=tp)
    rank, heads, head_dim = mesh.tp.rank, 2, 2
    replicas = max(1, tp // heads)
    torch.manual_seed(1)
    dense_q, dense_kv = nn.Linear(8, 8, bias=False), nn.Linear(8, 2 * heads * head_dim,
                                                                bias=False)
    x = torch.randn(2, 4, 8, requires_grad=True)
    group = ColumnParallelGroup(
        q=ColumnParallelLinear.from_dense(dense_q, mesh=mesh,
                                          sequence_parallel=sequence_parallel),
        kv=ColumnParallelLinear.from_dense(dense_kv, mesh=mesh, output_blocks=2,
                                           replicas=replicas, sequence_parallel=sequence_parallel))
    split = sequence_parallel and tp > 1  # the input is this rank's part of the sequence
    local_x = (x.detach().chunk(tp, dim=1)[rank] if split else x.detach()).clone()
    local_x.requires_grad_()
    with CommRecorder() as fwd:
        saved, (q, kv) = saved_activation_bytes(lambda: group(local_x), group.parameters())
    assert saved == local_x.numel() * 4  # only the (local) input, not the joined weight
    assert fwd.count() == (1 if split else 0)
    ref_q, ref_kv = dense_q(x), dense_kv(x)
    part = rank // replicas  # this rank's key/value head

    def mine(t):
        return torch.cat([b.chunk(tp // replicas, -1)[part] for b in t.chunk(2, -1)], -1)

    assert_close(q, ref_q.chunk(tp, -1)[rank], **TOL)
    assert_close(kv, mine(ref_kv), **TOL)
    gq, gkv = torch.randn_like(ref_q), torch.randn_like(ref_kv)
    (ref_q * gq).sum().add((ref_kv * gkv).sum()).backward()
    # each replica passes back 1/replicas of its head's gradient: the sums are the dense ones
    with CommRecorder() as bwd:
        torch.autograd.backward([q, kv], [gq.chunk(tp, -1)[rank], mine(gkv) / replicas])
    assert bwd.count() == (0 if tp == 1 else 2 if split else 1)  # SP: re-gather the input
    assert_close(local_x.grad, x.grad.chunk(tp, dim=1)[rank] if split else x.grad, **TOL)
    kv_grad = group.kv.weight.grad.clone()
    all_reduce(kv_grad, mesh.tp_block(replicas))
    expect = torch.cat([b.chunk(tp // replicas)[part] for b in dense_kv.weight.grad.chunk(2)])
    assert_close(kv_grad, expect, **TOL)
    assert_close(group.kv.to_dense().weight, dense_kv.weight, rtol=0, atol=0)
    shard = group.kv.shards["weight"]
    position = GridPosition.of(mesh)
    assert is_primary(shard, position) == (rank % replicas == 0)
    assert [start for _, start, _ in shard_pieces(shard, position)] == \
        [part * head_dim, heads * head_dim + part * head_dim]


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (4, False),
                                                  (4, True)])
def test_column_group_with_replicated_parts(tp, sequence_parallel):
    run_on_ranks(tp, _check_column_group, tp, sequence_parallel)
