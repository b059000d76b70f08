"""3D tensor parallelism (`Cube3D`, q = 2: eight ranks) against the dense layers and models in
fp64: forward outputs are this rank's slice of the dense output, input gradients its slice of
the dense ones, and every parameter gradient, once partial sums are summed over the axes the
layer names and the shards gathered, the dense gradient. Each linear's bytes equal
(q-1)/q^3 (3 B in + 2 B out + 3 in out) e exactly.

Eight-rank calls are the slow part: all layers share one call, both models another."""

import dataclasses
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from grid_models import GPT_SHAPE, LLAMA_SHAPE, check_against_dense, dense_output_layer
from harness import run_on_ranks, worker_mesh
from torch import nn
from torch.testing import assert_close

from meshtrain import ParallelMesh
from meshtrain.errors import Code
from meshtrain.models.gpt import GPTConfig
from meshtrain.models.llama import LlamaConfig
from meshtrain.parallel import CommRecorder
from meshtrain.parallel.communication import comm
from meshtrain.parallel.layers.norms import RMSNorm
from meshtrain.parallel.layers.sharding import unshard_tensor
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schemes.cube import Cube3D, cube_linear
from meshtrain.parallel.schemes.registry import layer_factory

TOL = dict(rtol=1e-10, atol=1e-13)
B, S, H, E = 4, 4, 16, 8  # micro-batch, tokens, hidden; fp64 bytes per element
PLAN = ParallelPlan(tp=8, tp_scheme="3d", micro_batch=B)


def _setup():
    mesh = worker_mesh(tp=8, tp_scheme="3d")
    torch.manual_seed(0)  # the same dense layers and inputs on every rank
    return mesh, layer_factory(PLAN, mesh), mesh.tp_coords()


def _piece(x, batch: int, feature: int, q: int = 2):
    """Batch chunk `batch` of q^2 and last-dimension chunk `feature` of q of a dense tensor."""
    return x.chunk(q * q)[batch].chunk(q, dim=-1)[feature]


def _hidden(x, c):
    """The hidden layout: batch chunk (w, a), hidden chunk o."""
    return _piece(x, 2 * c["tp_weight"] + c["tp_input"], c["tp_output"])


def _leaf(x):
    return x.detach().clone().requires_grad_()


def _full_grads(layer, mesh):
    """Every parameter's gradient summed over its partial axes and gathered whole."""
    for name, axes in getattr(layer, "partial_axes", {}).items():
        for axis in axes:
            comm.all_reduce(getattr(layer, name).grad, mesh.axis(axis))
    return {name: unshard_tensor(p.grad, layer.shards[name], mesh)
            for name, p in layer.named_parameters()}


def _check_grads(layer, dense, mesh):
    grads = _full_grads(layer, mesh)
    assert grads.keys() == dict(dense.named_parameters()).keys()
    for name, grad in grads.items():
        assert_close(grad, getattr(dense, name).grad, **TOL, msg=name)


def _linear_bytes(rec, *, h_in, h_out, in_axis, out_axis, q=2):
    """The recorded bytes by (op, axis) equal each term of the formula, and their sum it."""
    k = Fraction(q - 1, q ** 3) * E
    expect = {("all_gather", in_axis): 2 * k * B * S * h_in,  # forward, and again backward
              ("all_gather", "tp_weight"): 2 * k * h_in * h_out,
              ("reduce_scatter", out_axis): k * B * S * h_out,
              ("all_gather", out_axis): k * B * S * h_out,  # the output's gradient
              ("reduce_scatter", in_axis): k * B * S * h_in,  # the input's gradient
              ("reduce_scatter", "tp_weight"): k * h_in * h_out}  # the weight's gradient
    got = {key: rec.ring_bytes(*key) for key in expect}
    assert got == {key: float(v) for key, v in expect.items()}, got
    total = k * (3 * B * S * h_in + 2 * B * S * h_out + 3 * h_in * h_out)
    assert rec.ring_bytes() == float(total)
    assert rec.ring_bytes() == pytest.approx(cube_linear(B * S, h_in, h_out, q, E).total_bytes,
                                             rel=1e-12)  # the planner charges the same


def _check_column(mesh, factory, c):
    dense = nn.Linear(H, 24).double()  # three blocks (q, k, v) of 8
    nn.init.normal_(dense.bias)
    layer = factory.column(dense, blocks=3, heads=2)
    assert layer.weight.shape == (12, 4)  # [out/q, in/q^2]
    x = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True)
    ref = dense(x)
    grad = torch.randn_like(ref)
    ref.backward(grad)

    def out_slice(t):  # batch (w, o); out chunk a of every block
        t = t.chunk(4)[2 * c["tp_weight"] + c["tp_output"]]
        return torch.cat([block.chunk(2, -1)[c["tp_input"]] for block in t.chunk(3, -1)], -1)

    local = _leaf(_hidden(x, c))
    with CommRecorder() as rec:
        y = layer(local)
        y.backward(out_slice(grad))
    assert_close(y, out_slice(ref), **TOL)
    assert_close(local.grad, _hidden(x.grad, c), **TOL)
    _check_grads(layer, dense, mesh)
    _linear_bytes(rec, h_in=H, h_out=24, in_axis="tp_input", out_axis="tp_output")


def _check_row(mesh, factory, c):
    dense = nn.Linear(8, H).double()
    nn.init.normal_(dense.bias)
    layer = factory.row(dense)
    assert layer.weight.shape == (8, 2)
    x = torch.randn(B, S, 8, dtype=torch.float64, requires_grad=True)
    ref = dense(x)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    local = _leaf(_piece(x, 2 * c["tp_weight"] + c["tp_output"], c["tp_input"]))
    with CommRecorder() as rec:
        y = layer(local)
        y.backward(_hidden(grad, c))
    assert_close(y, _hidden(ref, c), **TOL)  # back in the hidden layout
    assert_close(local.grad, _piece(x.grad, 2 * c["tp_weight"] + c["tp_output"],
                                    c["tp_input"]), **TOL)
    _check_grads(layer, dense, mesh)
    _linear_bytes(rec, h_in=8, h_out=H, in_axis="tp_output", out_axis="tp_input")


def _check_norms(mesh, factory, c):
    for dense in (nn.LayerNorm(H, eps=1e-5), RMSNorm(H, eps=1e-6)):
        dense = dense.double()
        for p in dense.parameters():
            nn.init.normal_(p)
        layer = factory.norm(dense)
        x = torch.randn(B, S, H, dtype=torch.float64, requires_grad=True) * 3 + 1
        x.retain_grad()
        ref = dense(x)
        grad = torch.randn_like(ref)
        ref.backward(grad)
        local = _leaf(_hidden(x, c))
        y = layer(local)
        y.backward(_hidden(grad, c))
        assert_close(y, _hidden(ref, c), **TOL)
        assert_close(local.grad, _hidden(x.grad, c), **TOL)
        _check_grads(layer, dense, mesh)


def _check_embeddings(mesh, factory, c):
    """Token lookup plus positions: the hidden layout, and the table gradients."""
    word, position = nn.Embedding(37, H).double(), nn.Embedding(8, H).double()
    layer, pos_layer = factory.vocab_embedding(word), factory.position_embedding(position)
    assert layer.weight.shape == (10, 8)  # vocabulary padded to 40: [40/q^2, h/q]
    ids = torch.randint(0, 37, (B, S))
    ref = word(ids) + position(torch.arange(S))
    grad = torch.randn_like(ref)
    ref.backward(grad)
    with CommRecorder() as rec:
        y = layer(ids) + pos_layer(torch.arange(S))
        y.backward(_hidden(grad, c))
    assert_close(y, _hidden(ref, c), **TOL)
    _check_grads(layer, word, mesh)
    _check_grads(pos_layer, position, mesh)
    # reduce-scatters over tp_weight (B h/q) and tp_input (B h/q^2) forward, their
    # all-gathers backward: 2 (q-1)/q (B h/q + B h/q^2) e
    assert rec.ring_bytes() == 2 * 0.5 * (B * S * H / 2 + B * S * H / 4) * E


def _check_output_layer(mesh, factory, c, tied: bool):
    """Logits (padded vocabulary -inf), the loss of the whole micro-batch on every rank, and
    the gradients; the logits' bytes are the linear formula with out = V_padded."""
    reference = dense_output_layer(B, S, H, 37, tied)
    dense, hidden, targets = reference.dense, reference.hidden, reference.targets
    layer = factory.vocab_embedding(dense) if tied else factory.vocab_head(dense)

    local = _leaf(_hidden(hidden, c))
    with CommRecorder() as fwd:
        logits = layer.logits(local) if tied else layer(local)
    loss = factory.loss(logits, targets, ignore_index=-100)
    with CommRecorder() as bwd:
        (loss * reference.weights).sum().backward()
    assert_close(loss, reference.losses, **TOL)
    padded = F.pad(reference.logits, (0, 3), value=float("-inf"))  # V_padded = 40
    assert_close(logits, _piece(padded, 2 * c["tp_weight"] + c["tp_output"], c["tp_input"]),
                 **TOL)
    assert_close(local.grad, _hidden(hidden.grad, c), **TOL)
    _check_grads(layer, dense, mesh)
    fwd.records += bwd.records
    _linear_bytes(fwd, h_in=H, h_out=40, in_axis="tp_input", out_axis="tp_output")
    assert_close(factory.gather_logits(logits.detach())[..., :37], reference.logits, **TOL)


def _check_refusals(factory):
    with pytest.raises(ValueError, match="splits attention heads q = 2 ways: 3 heads"):
        factory.column(nn.Linear(H, 24), heads=3)
    with pytest.raises(ValueError, match="splits the input features 4 ways: 6 is not") as e:
        factory.column(nn.Linear(6, 8))
    assert e.value.code is Code.GRID_SHAPE
    with pytest.raises(ValueError, match="splits LayerNorm and RMSNorm, not GroupNorm"):
        factory.norm(nn.GroupNorm(2, H))
    with pytest.raises(ValueError, match="output layers have no bias") as e:
        factory.vocab_head(nn.Linear(H, 37))
    assert e.value.code is Code.MODEL_UNSUPPORTED


def _check_layers():
    mesh, factory, c = _setup()
    assert isinstance(factory, Cube3D) and factory.head_parts == 2
    assert factory.hidden_shape(B, S, H) == (1, S, 8)
    for check in (_check_column, _check_row, _check_norms, _check_embeddings):
        check(mesh, factory, c)
    _check_output_layer(mesh, factory, c, tied=True)
    _check_output_layer(mesh, factory, c, tied=False)
    _check_refusals(factory)


def test_layers_match_dense():
    run_on_ranks(8, _check_layers)


GPT_CFG = GPTConfig(**GPT_SHAPE)
LLAMA_CFG = LlamaConfig(**LLAMA_SHAPE)


def _gpt_step_bytes(s: int, q: int = 2) -> Fraction:
    """GPT_CFG's forward + backward bytes per rank at 3d, from the formula table of
    docs/design.md: embedding, per layer four linears and two LayerNorms, the final norm, the
    tied logits and the loss."""
    ring, tokens, k = Fraction(q - 1, q), B * s, Fraction(q - 1, q ** 3) * E
    per_rank = Fraction(tokens, q * q)
    h, f, vocab = 16, 64, 40  # the vocabulary padded to a multiple of q^2

    def linear(h_in, h_out):
        return k * (3 * tokens * h_in + 2 * tokens * h_out + 3 * h_in * h_out)

    norm = 8 * ring * per_rank * E  # two all-reduces of [T, 1] forward, one of [T, 2] backward
    layer = linear(h, 3 * h) + linear(h, h) + linear(h, f) + linear(f, h) + 2 * norm
    embedding = 2 * ring * (tokens * h / q + tokens * h / q ** 2) * E
    loss = 2 * ring * 3 * per_rank * E  # the max, then the stacked sums, over tp_input
    loss += (q - 1) * per_rank * E + ring * tokens * E  # gathered over tp_output, tp_weight
    return embedding + GPT_CFG.num_layers * layer + norm + linear(h, vocab) + loss


def _check_model(cfg, recompute):
    """The model at 3D (with `recompute`) against the dense one: weights, loss, gradients;
    GPT's bytes per step against the formulas."""
    mesh = worker_mesh(tp=8, tp_scheme="3d")
    factory = layer_factory(dataclasses.replace(PLAN, recompute=recompute), mesh)
    rec = check_against_dense(cfg, factory, B)
    if cfg is GPT_CFG and recompute == "none":
        assert rec.ring_bytes() == float(_gpt_step_bytes(8))


def _check_models():
    for cfg, recompute in ((GPT_CFG, "none"), (LLAMA_CFG, "none"), (GPT_CFG, "full"),
                           (LLAMA_CFG, "selective")):
        _check_model(cfg, recompute)


def test_gpt_and_llama_match_dense():
    run_on_ranks(8, _check_models)


def test_needs_a_3d_mesh():
    with pytest.raises(ValueError, match="`tp_scheme` 3d needs a mesh with a q x q x q TP grid"):
        Cube3D(PLAN, ParallelMesh.local())
