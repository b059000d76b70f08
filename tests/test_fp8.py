"""FP8 training (`fp8`): which layers get float8 matmuls, that a converted layer computes what
torchao's `Float8Linear` computes, that parameters and checkpoints do not change, and what is
refused. On a CPU the float8 matmuls run emulated (or through torch's CPU scaled matmul), so
these tests check the numbers, not the speed; the 200-step loss against bf16 is a GPU check.
Tests that convert need torchao (`pip install 'meshtrain[fp8]'`) and skip without it."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from harness import run_on_ranks, worker_mesh
from torch import nn

from meshtrain import ParallelMesh, preset
from meshtrain.cli.main import main
from meshtrain.errors import Code, SettingError
from meshtrain.parallel import named_full_tensors
from meshtrain.parallel.layers import fp8
from meshtrain.parallel.layers.fp8 import Float8Gemm, check_fp8_device, convert_to_float8
from meshtrain.parallel.layers.sharding import parameter_shards
from meshtrain.parallel.layers.tensor import DENSE, ColumnParallelLinear, RowParallelLinear
from meshtrain.parallel.layers.weight_grads import WeightGradients, accumulate_deferred
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model

CONVERTED = {"tiny": ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"],
             "llama-tiny": ["attn.qkv.q", "attn.qkv.kv", "attn.proj", "mlp.fc", "mlp.proj"]}
"""Each layer's linears that get float8 matmuls at tp 1 (all their dims are multiples of 16)."""


@pytest.fixture
def float8():
    return pytest.importorskip("torchao.float8", reason="torchao is not installed: pip install"
                                                        " 'meshtrain[fp8]'")


def _batch(b=2, s=32, vocab=256, seed=0):
    ids = torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _gemms(model: nn.Module) -> dict[str, object]:
    """Every tensor-parallel layer's matmuls by module name."""
    return {name: m.gemm for name, m in model.named_modules() if hasattr(m, "gemm")}


@pytest.mark.parametrize("name", CONVERTED)
def test_conversion_targets_the_attention_and_mlp_linears_only(name, float8):
    model = build_model(preset(name), ParallelMesh.local())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shards = parameter_shards(model)
    converted = convert_to_float8(model, "tensorwise")
    assert converted == [f"layers.{i}.{layer}" for i in range(4) for layer in CONVERTED[name]]
    gemms = _gemms(model)
    assert {k for k, g in gemms.items() if isinstance(g, Float8Gemm)} == set(converted)
    assert {k for k, g in gemms.items() if g is DENSE} == \
        {"embedding.word"} | ({"head"} if name == "llama-tiny" else set())  # GPT ties them
    after = model.state_dict()  # names, dtypes, values and shard specs: what a checkpoint holds
    assert list(after) == list(before) and parameter_shards(model) == shards
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())


def test_moe_routers_and_experts_keep_their_matmuls(float8):
    model = build_model(preset("tiny", moe_experts=2), ParallelMesh.local())
    converted = convert_to_float8(model, "rowwise")
    assert converted == [f"layers.{i}.{layer}" for i in range(4)
                         for layer in ("attn.qkv", "attn.proj")]
    assert all(not isinstance(m.gemm, Float8Gemm) for name, m in model.named_modules()
               if ".mlp." in name and hasattr(m, "gemm"))


def test_state_dicts_load_between_converted_and_unconverted_models_bitwise(float8):
    cfg = preset("llama-tiny")
    converted = build_model(cfg, ParallelMesh.local(), seed=1).to(torch.bfloat16)
    convert_to_float8(converted, "rowwise")
    plain = build_model(cfg, ParallelMesh.local(), seed=2).to(torch.bfloat16)
    plain.load_state_dict(converted.state_dict())
    again = build_model(cfg, ParallelMesh.local(), seed=3).to(torch.bfloat16)
    convert_to_float8(again, "tensorwise")
    again.load_state_dict(plain.state_dict())
    for model in (plain, again):
        for (name, a), b in zip(converted.state_dict().items(), model.state_dict().values(),
                                strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "scaled_mm"])
def test_a_converted_layer_computes_what_torchaos_float8_linear_does(recipe, emulate, float8):
    """Forward, input gradient and weight gradient of a column- and a row-parallel layer at
    tp 1 equal torchao's `Float8Linear` bitwise (same casts, same matmuls); the plain layer's
    differ (the matmuls did go through float8)."""
    torch.manual_seed(0)
    dense = nn.Linear(64, 48).to(torch.bfloat16)
    x, grad = torch.randn(2, 16, 64, dtype=torch.bfloat16), torch.randn(2, 16, 48,
                                                                      dtype=torch.bfloat16)
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe),
                                 emulate=emulate)
    reference = float8.convert_to_float8_training(nn.Sequential(nn.Linear(64, 48)),
                                                  config=config)[0].to(torch.bfloat16)
    reference.load_state_dict(dense.state_dict())

    def run(layer):
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(grad)
        return out, inputs.grad, layer.weight.grad, layer.bias.grad

    expected = run(reference)
    plain = run(dense)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls.from_dense(dense, mesh=ParallelMesh.local())
        layer.gemm = Float8Gemm(recipe, emulate=emulate)
        got = run(layer)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert not any(torch.equal(a, b) for a, b in zip(got[:3], plain[:3], strict=True))


def test_deferred_weight_gradients_equal_the_fused_ones(float8):
    """A zero-bubble schedule's split backward computes the same float8 weight gradient."""
    torch.manual_seed(0)
    dense, x = nn.Linear(32, 32), torch.randn(2, 16, 32)
    grads = []
    for defer in (False, True):
        layer = ColumnParallelLinear.from_dense(dense, mesh=ParallelMesh.local())
        layer.gemm = Float8Gemm("rowwise", emulate=True)
        layer.weight_grads = WeightGradients() if defer else None
        out = layer(x)
        if defer:
            with layer.weight_grads.deferred() as queue:
                out.sum().backward()
            assert layer.weight.grad is None
            accumulate_deferred([], queue)  # the W
            grads.append(layer.weight.grad)
        else:
            out.sum().backward()
            grads.append(layer.weight.grad)
    assert torch.equal(*grads)


def _loss_and_grads(model):
    inputs, targets = _batch()
    loss = model.loss(model(inputs), targets)
    loss.backward()
    return loss.detach(), dict(named_full_tensors(model, grads=True))


def _close_to_dense(cfg, model, converted):
    """(relative loss difference, largest relative gradient difference of a converted
    weight) of `model` against the unconverted single-process model."""
    dense_loss, dense_grads = _loss_and_grads(build_model(cfg, ParallelMesh.local(), seed=0))
    loss, grads = _loss_and_grads(model)
    errors = [(grads[f"{n}.weight"] - dense_grads[f"{n}.weight"]).norm()
              / dense_grads[f"{n}.weight"].norm() for n in converted]
    return (abs(loss - dense_loss) / dense_loss).item(), max(errors).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_converted_model_trains_close_to_the_unconverted_one(recipe, float8):
    """fp32 tiny GPT, one forward/backward against the unconverted model: measured here, the
    loss within 7e-5 relative, each converted weight's gradient within 11% in norm (tensorwise;
    rowwise 8%: the output gradients keep 2 or 3 mantissa bits)."""
    cfg = preset("tiny")
    model = build_model(cfg, ParallelMesh.local(), seed=0)
    converted = convert_to_float8(model, recipe, emulate=True)
    loss_error, grad_error = _close_to_dense(cfg, model, converted)
    assert loss_error < 1e-3 and 0 < grad_error < 0.15, (loss_error, grad_error)


def _check_tp2(layout: dict):
    mesh = worker_mesh(tp=2)
    cfg = preset("llama-tiny")
    model = build_model(cfg, mesh, ParallelPlan(tp=2, **layout), seed=0)
    converted = convert_to_float8(model, "rowwise", emulate=True)
    return converted, _close_to_dense(cfg, model, converted)


@pytest.mark.parametrize("layout", [{}, {"sequence_parallel": True},
                                    {"sequence_parallel": True, "tp_overlap": True}],
                         ids=["tp2", "tp2_sp", "tp2_sp_overlap"])
def test_tp2_converts_the_local_shapes_and_stays_close(layout, float8):
    """At tp 2 Llama's MLP down projection holds 176 / 2 = 88 input features, not a multiple
    of 16: it keeps its matmul; the rest run in float8 through the TP collectives (measured:
    loss within 1.1e-4 relative, gradients within 8.2%, with and without sequence
    parallelism; the overlapped layers scale each chunk of their matmuls on its own)."""
    (converted, (loss_error, grad_error)), again = run_on_ranks(2, _check_tp2, layout)
    assert again[0] == converted == [f"layers.{i}.{layer}" for i in range(4)
                                     for layer in CONVERTED["llama-tiny"][:-1]]
    assert loss_error < 1e-3 and 0 < grad_error < 0.15, (loss_error, grad_error)


@pytest.mark.parametrize("plan,code", [
    (ParallelPlan(tp=4, tp_scheme="2d", micro_batch=2, fp8="tensorwise"), Code.FP8_SCHEME),
    (ParallelPlan(precision="fp64", fp8="rowwise"), Code.FP8_PRECISION),
    (ParallelPlan(micro_batch=1, fp8="tensorwise"), Code.FP8_TOKENS),
])
def test_layouts_float8_cannot_run_are_refused(plan, code):
    with pytest.raises(SettingError) as refused:
        plan.validate(preset("tiny"), world_size=plan.tp, global_batch=8, seq_len=40)
    assert refused.value.code is code and "fp8" in refused.value.settings


def test_devices_without_fp8_tensor_cores_are_refused(monkeypatch):
    with pytest.raises(SettingError, match="device is the CPU") as refused:
        check_fp8_device(torch.device("cpu"), "tensorwise")
    assert refused.value.code is Code.FP8_DEVICE
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100")
    for capability, ok in (((8, 0), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        if ok:
            check_fp8_device(torch.device("cuda", 0), "rowwise")
        else:
            with pytest.raises(SettingError, match="A100 has 8.0"):
                check_fp8_device(torch.device("cuda", 0), "rowwise")


def test_a_missing_torchao_is_named(monkeypatch):
    monkeypatch.setattr(fp8, "importlib", SimpleNamespace(
        util=SimpleNamespace(find_spec=lambda name: None)))
    fp8._torchao.cache_clear()
    try:
        with pytest.raises(SettingError, match=r"pip install 'meshtrain\[fp8\]'") as refused:
            Float8Gemm("tensorwise")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
        with pytest.raises(SettingError, match=r"pip install 'meshtrain\[fp8\]'"):
            check_fp8_device(torch.device("cuda", 0), "rowwise")  # before ranks start
    finally:
        fp8._torchao.cache_clear()
    assert refused.value.code is Code.FP8_PACKAGE


def test_the_command_line_refuses_fp8_on_the_cpu_in_one_line(corpus, tmp_path, capsys):
    code = main(["train", "--device", "cpu", "--data", corpus, "--out", str(tmp_path / "run"),
                 "--fp8", "tensorwise"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err == ("meshtrain: error: --fp8 tensorwise needs a GPU with FP8 tensor cores (CUDA"
                   " capability 8.9 or newer) and this run's device is the CPU: drop --fp8")
    assert not (tmp_path / "run").exists()
