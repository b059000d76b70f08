"""2D and 2.5D tensor parallelism (`Summa2D`: 2d q = 2 on four ranks, 2.5d q = 2 and d = 2 on
eight) against the dense layers and models in fp64: forward outputs are this rank's slice of the
dense output, input gradients its slice of the dense ones, and every parameter gradient, once
partial sums are summed over the axes the layer names and the shards gathered, the dense
gradient. Each linear's bytes equal 3 (q-1)/q^2 (B in/d + in out) e exactly, the output
layer's (q-1)/q^2 (2 B V/d + 3 V h) e.

Eight-rank calls are the slow part: the 2.5d layers share one call, both models another."""

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from grid_models import GPT_SHAPE, LLAMA_SHAPE, check_against_dense, dense_output_layer
from harness import run_on_ranks, worker_mesh
from torch import nn
from torch.testing import assert_close

from meshtrain import ParallelMesh
from meshtrain.models.gpt import GPTConfig
from meshtrain.models.llama import LlamaConfig
from meshtrain.parallel import CommRecorder
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.norms import RMSNorm
from meshtrain.parallel.layers.sharding import unshard_tensor
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schemes.registry import layer_factory
from meshtrain.parallel.schemes.summa import Summa2D, summa_linear, summa_logits

TOL = dict(rtol=1e-10, atol=1e-13)
B, S, H, E, Q = 4, 4, 16, 8, 2  # micro-batch, tokens, hidden; fp64 bytes; grid side
DEPTHS = {"2d": 1, "2.5d": 2}


def _setup(scheme):
    d = DEPTHS[scheme]
    mesh = worker_mesh(tp=Q * Q * d, tp_scheme=scheme)
    plan = ParallelPlan(tp=Q * Q * d, tp_scheme=scheme, micro_batch=B)
    torch.manual_seed(0)  # the same dense layers and inputs on every rank
    return mesh, layer_factory(plan, mesh), mesh.tp_coords(), d


def _batch(c, d):
    """This rank's batch chunk: l q + i of d q."""
    return c.get("tp_depth", 0) * Q + c["tp_row"], d * Q


def _hidden(x, c, d, blocks=1):
    """The hidden layout: batch chunk l q + i, last-dimension chunk j (of every block)."""
    index, parts = _batch(c, d)
    x = x.chunk(parts)[index]
    return torch.cat([b.chunk(Q, -1)[c["tp_col"]] for b in x.chunk(blocks, -1)], -1)


def _leaf(x):
    return x.detach().clone().requires_grad_()


def _check_grads(layer, dense, mesh):
    """Every parameter's gradient summed over its partial axes and gathered whole."""
    for name, axes in getattr(layer, "partial_axes", {}).items():
        for axis in axes:
            comm.all_reduce(getattr(layer, name).grad, mesh.axis(axis))
    grads = {name: unshard_tensor(p.grad, layer.shards[name], mesh)
             for name, p in layer.named_parameters()}
    assert grads.keys() == dict(dense.named_parameters()).keys()
    for name, grad in grads.items():
        assert_close(grad, getattr(dense, name).grad, **TOL, msg=name)


def _linear_bytes(rec, d, *, h_in, h_out):
    """The recorded bytes by (op, axis) equal each term of the formula, and their sum it."""
    k, tokens = Fraction(Q - 1, Q * Q) * E, Fraction(B * S, d)
    expect = {("broadcast", "tp_col"): 2 * k * tokens * h_in,  # X blocks, forward + backward
              ("broadcast", "tp_row"): 2 * k * h_in * h_out,  # W blocks, forward + backward
              ("reduce", "tp_col"): k * tokens * h_in,  # the input's gradient
              ("reduce", "tp_row"): k * h_in * h_out}  # the weight's gradient
    got = {key: rec.ring_bytes(*key) for key in expect}
    assert got == {key: float(v) for key, v in expect.items()}, got
    assert rec.ring_bytes() == float(3 * k * (tokens * h_in + h_in * h_out))
    # the planner charges the same
    assert rec.ring_bytes() == pytest.approx(summa_linear(B * S, h_in, h_out, Q, d, E)
                                             .total_bytes, rel=1e-12)


def _check_linear(mesh, factory, c, d):
    dense = nn.Linear(H, 24).double()  # three blocks (q, k, v) of 8
    nn.init.normal_(dense.bias)
    layer = factory.column(dense, blocks=3, heads=2)
    assert layer.weight.shape == (12, 8)  # [out/q, in/q]
    x = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    ref = dense(x)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    local = _leaf(_hidden(x, c, d))
    with CommRecorder() as rec:
        y = layer(local)
        y.backward(_hidden(grad, c, d, blocks=3))
    assert_close(y, _hidden(ref, c, d, blocks=3), **TOL)
    assert_close(local.grad, _hidden(x.grad, c, d), **TOL)
    _check_grads(layer, dense, mesh)
    _linear_bytes(rec, d, h_in=H, h_out=24)
    assert factory.row(nn.Linear(8, H)).weight.shape == (8, 4)  # the same SUMMA linear


def _check_norms(mesh, factory, c, d):
    for dense in (nn.LayerNorm(H, eps=1e-5), RMSNorm(H, eps=1e-6)):
        dense = dense.double()
        for p in dense.parameters():
            nn.init.normal_(p)
        layer = factory.norm(dense)
        x = torch.randn(B, S, H, dtype=torch.float64) * 3 + 1
        x.requires_grad_()
        ref = dense(x)
        grad = torch.randn_like(ref)
        ref.backward(grad)
        local = _leaf(_hidden(x, c, d))
        y = layer(local)
        y.backward(_hidden(grad, c, d))
        assert_close(y, _hidden(ref, c, d), **TOL)
        assert_close(local.grad, _hidden(x.grad, c, d), **TOL)
        _check_grads(layer, dense, mesh)


def _check_embeddings(mesh, factory, c, d):
    """Token lookup plus positions: the hidden layout, and the table gradients."""
    word, position = nn.Embedding(37, H).double(), nn.Embedding(8, H).double()
    layer, pos_layer = factory.vocab_embedding(word), factory.position_embedding(position)
    assert layer.weight.shape == (19, 8)  # vocabulary padded to 38: [38/q, h/q]
    ids = torch.randint(0, 37, (B, S))
    ref = word(ids) + position(torch.arange(S))
    grad = torch.randn_like(ref)
    ref.backward(grad)
    with CommRecorder() as rec:
        y = layer(ids) + pos_layer(torch.arange(S))
        y.backward(_hidden(grad, c, d))
    assert_close(y, _hidden(ref, c, d), **TOL)
    _check_grads(layer, word, mesh)
    _check_grads(pos_layer, position, mesh)
    # a reduce-scatter over tp_row forward, its all-gather backward: 2 (q-1)/q B h/(d q) e
    assert rec.ring_bytes() == 2 * (Q - 1) / Q * B * S * H / (d * Q) * E


def _check_output_layer(mesh, factory, c, d, tied: bool):
    """Logits (padded vocabulary -inf), the loss of the whole micro-batch on every rank, and
    the gradients; the logits' bytes (q-1)/q^2 (2 B V/d + 3 V h) e, V padded."""
    reference = dense_output_layer(B, S, H, 37, tied)
    dense, hidden, targets = reference.dense, reference.hidden, reference.targets
    layer = factory.vocab_embedding(dense) if tied else factory.vocab_head(dense)

    local = _leaf(_hidden(hidden, c, d))
    with CommRecorder() as rec:
        logits = layer.logits(local) if tied else layer(local)
    loss = factory.loss(logits, targets, ignore_index=-100)
    with CommRecorder() as bwd:
        (loss * reference.weights).sum().backward()
    rec.records += bwd.records
    assert_close(loss, reference.losses, **TOL)
    padded = F.pad(reference.logits, (0, 1), value=float("-inf"))  # V_padded = 38
    assert_close(logits, _hidden(padded, c, d), **TOL)
    assert_close(local.grad, _hidden(hidden.grad, c, d), **TOL)
    _check_grads(layer, dense, mesh)
    k, tokens = Fraction(Q - 1, Q * Q) * E, Fraction(B * S, d)
    assert rec.ring_bytes() == float(k * (2 * tokens * 38 + 3 * 38 * H))
    assert rec.ring_bytes() == pytest.approx(summa_logits(B * S, H, 38, Q, d, E).total_bytes,
                                             rel=1e-12)  # the planner's
    assert_close(factory.gather_logits(logits.detach())[..., :37], reference.logits, **TOL)


def _check_layers(scheme):
    mesh, factory, c, d = _setup(scheme)
    assert isinstance(factory, Summa2D) and factory.head_parts == Q
    assert factory.hidden_shape(B, S, H) == (B // (d * Q), S, H // Q)
    for check in (_check_linear, _check_norms, _check_embeddings):
        check(mesh, factory, c, d)
    _check_output_layer(mesh, factory, c, d, tied=True)
    _check_output_layer(mesh, factory, c, d, tied=False)
    with pytest.raises(ValueError, match="splits attention heads q = 2 ways: 3 heads"):
        factory.column(nn.Linear(H, 24), heads=3)
    with pytest.raises(ValueError, match="splits LayerNorm and RMSNorm, not GroupNorm"):
        factory.norm(nn.GroupNorm(2, H))


@pytest.mark.parametrize("scheme", DEPTHS)
def test_layers_match_dense(scheme):
    run_on_ranks(Q * Q * DEPTHS[scheme], _check_layers, scheme)


GPT_CFG = GPTConfig(**GPT_SHAPE)
LLAMA_CFG = LlamaConfig(**LLAMA_SHAPE)


def _gpt_step_bytes(d: int, s: int) -> Fraction:
    """GPT_CFG's forward + backward bytes per rank at 2d/2.5d (q = 2), from the formula table
    of docs/design.md: embedding, per layer four linears and two LayerNorms, the final norm,
    the tied logits and the loss."""
    ring, tokens = Fraction(Q - 1, Q), Fraction(B * s, d)
    per_rank, k = tokens / Q, Fraction(Q - 1, Q * Q) * E
    h, f, vocab = 16, 64, 38  # the vocabulary padded to a multiple of q

    def linear(h_in, h_out):
        return 3 * k * (tokens * h_in + h_in * h_out)

    norm = 8 * ring * per_rank * E  # two all-reduces of [T, 1] forward, one of [T, 2] backward
    layer = linear(h, 3 * h) + linear(h, h) + linear(h, f) + linear(f, h) + 2 * norm
    embedding = 2 * ring * tokens * h / Q * E  # reduce-scatter over tp_row, then all-gather
    logits = k * (2 * tokens * vocab + 3 * vocab * h)
    loss = 2 * ring * 3 * per_rank * E  # the max, then the stacked sums, over tp_col
    loss += (Q - 1) * per_rank * E + Fraction(d - 1, d) * B * s * E  # gathered over row, depth
    return embedding + GPT_CFG.num_layers * layer + norm + logits + loss


def _check_model(scheme, cfg, recompute):
    """The model (with `recompute`) against the dense one: weights, loss, gradients; GPT's
    bytes per step against the formulas."""
    d = DEPTHS[scheme]
    mesh = worker_mesh(tp=Q * Q * d, tp_scheme=scheme)
    factory = layer_factory(ParallelPlan(tp=Q * Q * d, tp_scheme=scheme, micro_batch=B,
                                         recompute=recompute), mesh)
    rec = check_against_dense(cfg, factory, B)
    if cfg is GPT_CFG and recompute == "none":
        assert rec.ring_bytes() == float(_gpt_step_bytes(d, 8))


def _check_models(scheme):
    for cfg, recompute in ((GPT_CFG, "none"), (LLAMA_CFG, "none"), (GPT_CFG, "full"),
                           (LLAMA_CFG, "selective")):
        _check_model(scheme, cfg, recompute)


@pytest.mark.parametrize("scheme", ["2d", pytest.param("2.5d", marks=pytest.mark.extended)])
def test_gpt_and_llama_match_dense(scheme):
    run_on_ranks(Q * Q * DEPTHS[scheme], _check_models, scheme)


def test_needs_a_grid_mesh():
    with pytest.raises(ValueError, match="`tp_scheme` 2d needs a mesh with a q x q"):
        Summa2D(ParallelPlan(tp=4, tp_scheme="2d"), ParallelMesh.local())
