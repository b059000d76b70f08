"""Experts computed together: each grouped-matmul backend against the per-expert loop, forward
and gradients, with empty and uneven groups, and an MoE layer's experts through each."""

import pytest
import torch
import torch.nn.functional as F
from harness import raises_as_flags
from torch.testing import assert_close

from meshtrain import ParallelMesh, preset
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.parallel.layers import expert, grouped_matmul
from meshtrain.parallel.layers.expert import MoE, grouped_mlp
from meshtrain.parallel.layers.grouped_matmul import expert_gemm, grouped_linear
from meshtrain.parallelize import build_model

TIGHT = {"rtol": 1e-6, "atol": 1e-6}
SIZES = {"uneven with empty": [3, 0, 7, 1], "one takes all": [0, 11, 0, 0],
         "zero rows": [0, 0, 0, 0]}


def _run(backend, sizes, bias, width=16):
    """Output and the gradients of input, weight and bias through `backend`."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(sizes), width, generator=gen, requires_grad=True)
    weight = torch.randn(len(sizes), 8, width, generator=gen, requires_grad=True)
    b = torch.randn(len(sizes), 8, generator=gen, requires_grad=True) if bias else None
    out = grouped_linear(x, weight, b, sizes, backend)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return [out, x.grad, weight.grad] + ([b.grad] if bias else [])


@pytest.mark.parametrize("backend", ["padded", "grouped"])
@pytest.mark.parametrize("case", list(SIZES))
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_backend_matches_per_expert_loop(backend, case, bias):
    sizes = SIZES[case]
    got = _run(backend, sizes, bias)
    for mine, want in zip(got, _run("loop", sizes, bias), strict=True):
        assert mine is not None
        assert_close(mine, want, **TIGHT)
    for g, n in enumerate(sizes):
        assert n or not got[2][g].any()  # an empty expert's weight gradient is zeros


def test_loop_is_each_group_through_its_own_linear():
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = (torch.randn(*s, generator=gen) for s in ((6, 4), (2, 3, 4), (2, 3)))
    want = torch.cat([F.linear(x[:2], weight[0], bias[0]), F.linear(x[2:], weight[1], bias[1])])
    assert torch.equal(grouped_linear(x, weight, bias, [2, 4], "loop"), want)


def test_grouped_with_rows_not_16_byte_aligned_runs_padded():
    sizes = [2, 3, 0]
    for got, want in zip(_run("grouped", sizes, True, width=6), _run("loop", sizes, True, 6),
                         strict=True):
        assert_close(got, want, **TIGHT)


def test_torch_without_grouped_matmul_falls_back(monkeypatch):
    assert expert_gemm("grouped", torch.device("cpu")) == "grouped"
    monkeypatch.delattr(F, "grouped_mm", raising=False)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    assert grouped_matmul.grouped_mm_function() is None
    assert expert_gemm("grouped", torch.device("cpu")) == "padded"


def test_auto_is_the_measured_best_per_device():
    assert expert_gemm("auto", torch.device("cpu")) == "loop"  # docs/benchmarks.md
    assert expert_gemm("auto", torch.device("cuda")) == "grouped"
    assert expert_gemm("loop", torch.device("cpu")) == "loop"


def _moe_step(name, gemm):
    """One MoE model's gradients by name, its experts computed by `gemm`."""
    cfg = preset(name, num_layers=1, moe_experts=4, moe_top_k=2, moe_capacity_factor=0.0,
                 moe_gemm=gemm)
    model = build_model(cfg, ParallelMesh.local(), seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    aux = AuxiliaryOutputs()
    (model.cross_entropy(model(ids, aux=aux), ids) + aux.loss).backward()
    assert any(isinstance(m, MoE) for m in model.modules())
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_moe_experts_together_equal_one_at_a_time(name, monkeypatch):
    """GPT's experts (biased, GELU) and Llama's (SwiGLU): every gradient under each backend
    equals the loop's."""
    together = []
    monkeypatch.setattr(expert, "grouped_mlp", lambda *a: together.append(a) or grouped_mlp(*a))
    loop = _moe_step(name, "loop")
    assert not together
    for gemm in ("padded", "grouped"):
        got = _moe_step(name, gemm)
        assert together[-1][-1] == gemm
        assert got.keys() == loop.keys()
        for param, grad in got.items():
            assert_close(grad, loop[param], **TIGHT, msg=f"{gemm} {param}")


def test_unknown_moe_gemm_is_refused_naming_the_choices():
    with raises_as_flags("--moe-gemm must be auto, loop, padded or grouped, got 'fast'"):
        preset("tiny", moe_experts=4, moe_gemm="fast").validate()
