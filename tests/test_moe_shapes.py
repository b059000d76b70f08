"""Shapes of modern MoEs: an expert width of its own, shared experts (ungated and sigmoid-gated),
which layers are MoE (every n-th, the first k dense, a list), and how the planner prices them."""

import dataclasses
import math
import re

import pytest
import torch
from harness import raises_as_flags
from torch.testing import assert_close

from meshtrain import ParallelMesh, preset
from meshtrain.cli.main import _train_config, main
from meshtrain.cli.parsers import parse_command_line
from meshtrain.config.run_config import build_config
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.models.layer_pattern import LayerPattern
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model
from meshtrain.planner.costs import _expert_comm
from meshtrain.planner.hardware import BUILT_IN
from meshtrain.planner.run_fit import measured_imbalance
from meshtrain.planner.workload import Workload

SHAPES = [
    ("tiny", {"moe_ffn_size": 16, "moe_shared_ffn_size": 24, "moe_shared_gate": "sigmoid",
              "moe_first_dense": 1}),
    ("llama-tiny", {"moe_ffn_size": 32, "moe_shared_ffn_size": 64, "moe_shared_gate": "none",
                    "moe_layers": (0, 2)}),
]


def test_layer_pattern_every_first_and_list():
    assert LayerPattern(every=2).indices(6) == [1, 3, 5]
    assert LayerPattern(every=1, first=2).indices(5) == [2, 3, 4]
    assert LayerPattern(every=2, first=2).indices(6) == [3, 5]
    listed = LayerPattern(layers=(0, 4))
    assert listed.indices(6) == [0, 4] and listed.count(6) == 2
    assert listed.describe(6) == "2 of 6 layers (0, 4)"
    assert LayerPattern().describe(3) == "all 3 layers"


@pytest.mark.parametrize("model,shape", SHAPES, ids=["gpt-gated-first-dense", "llama-ungated-list"])
def test_shapes_build_with_their_names_and_counts(model, shape):
    cfg = preset(model, vocab_size=64, moe_experts=4, moe_top_k=2, **shape)
    net = build_model(cfg, ParallelMesh.local(), seed=3)
    held = {name: tuple(p.shape) for name, p in net.named_parameters()}
    assert held == cfg.parameter_shapes()
    assert sum(p.numel() for p in net.parameters()) == cfg.num_parameters()
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert moe == ([1, 2, 3] if "moe_first_dense" in shape else [0, 2])
    h, fe, fs = cfg.hidden_size, shape["moe_ffn_size"], shape["moe_shared_ffn_size"]
    mlp = {"tiny": lambda f: 2 * h * f + f + h, "llama-tiny": lambda f: 3 * h * f}[model]
    gate = h if shape["moe_shared_gate"] == "sigmoid" else 0
    dense = cfg.num_parameters() - len(moe) * (4 * h + gate + mlp(fs) + 4 * mlp(fe)) \
        - (cfg.num_layers - len(moe)) * mlp(cfg.ffn_size)
    assert dense == cfg.other_parameters() + cfg.num_layers * cfg.attention_parameters()
    active = cfg.matmul_parameters_per_token() - cfg.vocab_size * h \
        - cfg.num_layers * cfg.attention_parameters(weights_only=True)
    weights = {"tiny": lambda f: 2 * h * f, "llama-tiny": lambda f: 3 * h * f}[model]
    assert active == len(moe) * (4 * h + gate + weights(fs) + 2 * weights(fe)) \
        + (cfg.num_layers - len(moe)) * weights(cfg.ffn_size)
    ids = torch.randint(0, 64, (2, 8))
    aux = AuxiliaryOutputs()
    (net.cross_entropy(net(ids, aux=aux), ids) + aux.loss).backward()
    assert all(p.grad is not None for p in net.parameters())


@pytest.mark.parametrize("gate", ["none", "sigmoid"])
def test_shared_expert_adds_to_the_routed_output(gate):
    cfg = preset("tiny", vocab_size=64, moe_experts=4, moe_top_k=2, moe_shared_ffn_size=24,
                 moe_shared_gate=gate)
    moe = build_model(cfg, ParallelMesh.local(), seed=3).layers["0"].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(2, 8, cfg.hidden_size)
    out = moe(x, AuxiliaryOutputs())
    shared, moe.shared_expert = moe.shared_expert, None
    routed = moe(x, AuxiliaryOutputs())
    scale = torch.sigmoid(moe.shared_expert_gate(x)) if gate == "sigmoid" else 1.0
    assert (moe.shared_expert_gate is None) == (gate == "none")
    assert_close(out, routed + shared(x) * scale)


def test_unset_shapes_are_todays_model():
    today = preset("tiny", vocab_size=64, moe_experts=4, moe_every=2)
    same = dataclasses.replace(today, moe_ffn_size=today.ffn_size)
    nets = [dict(build_model(c, ParallelMesh.local(), seed=1).named_parameters())
            for c in (today, same)]
    assert nets[0].keys() == nets[1].keys()
    assert all(torch.equal(nets[0][n], nets[1][n]) for n in nets[0])
    assert today.num_moe_layers() == 2 and today.num_parameters() == same.num_parameters()


@pytest.mark.parametrize("shape,message", [
    ({"moe_shared_ffn_size": 32}, "--moe-shared-ffn-size 32 needs --moe-shared-gate: none"),
    ({"moe_shared_gate": "sigmoid"}, "--moe-shared-ffn-size is 0: set both or neither"),
    ({"moe_shared_ffn_size": 8, "moe_shared_gate": "relu"}, "--moe-shared-gate must be none or"
                                                           " sigmoid, got 'relu'"),
    ({"moe_ffn_size": -1}, "--moe-ffn-size must be >= 0"),
    ({"moe_shared_ffn_size": -8, "moe_shared_gate": "none"}, "--moe-shared-ffn-size must be >= 0"),
    ({"moe_first_dense": 4}, "--moe-first-dense must be 0 .. num_layers - 1 = 3, got 4"),
    ({"moe_layers": (3, 1)}, "--moe-layers must be increasing layer indices in 0 .. 3"),
    ({"moe_layers": (1, 4)}, "--moe-layers must be increasing layer indices in 0 .. 3"),
    ({"moe_layers": ()}, "--moe-layers must be increasing"),
    ({"moe_layers": (1,), "moe_every": 2}, "--moe-layers lists the layers itself: drop"),
    ({"moe_experts": 0, "moe_ffn_size": 8}, "and --moe-experts is 0: set --moe-experts"),
])
def test_bad_shapes_are_one_line(shape, message):
    with raises_as_flags(re.escape(message)):
        preset("tiny", **{"moe_experts": 4} | shape)


def test_wider_shapes_are_checked_against_tp():
    with raises_as_flags(re.escape("the expert width (6) must be divisible by tp (4)")):
        preset("tiny", moe_experts=4, moe_ffn_size=6).validate_for_tp(4)


def test_moe_layers_list_from_toml_and_flag():
    toml = build_config({"model": {"moe_experts": 4, "moe_layers": [1, 3]}},
                        {"checkpoint": {"out": "/nonexistent"}})
    assert toml.model_config(256).moe_layers == (1, 3)
    assert "moe_layers = [1, 3]" in toml.resolved(toml.model_config(256), toml.plan).to_toml()
    args = parse_command_line(["train", "--moe-experts", "4", "--moe-layers", "0,2", "--out",
                               "/nonexistent"])
    cfg = _train_config(args).model_config(256)
    assert cfg.moe_layers == (0, 2) and [cfg.is_moe_layer(i) for i in range(4)] == \
        [True, False, True, False]


def test_checkpoint_keeps_the_moe_layers_list(corpus, tmp_path):
    from meshtrain.checkpointing.checkpoint import latest_checkpoint, read_manifest
    from meshtrain.training.trainer import Trainer

    cfg = build_config({"model": {"moe_experts": 2, "moe_layers": [1], "moe_ffn_size": 8,
                                  "moe_shared_ffn_size": 8, "moe_shared_gate": "sigmoid"}},
                       {"train": {"steps": 1, "global_batch": 2, "micro_batch": 1,
                                  "seq_len": 8},
                        "parallel": {"device": "cpu"}, "data": {"data": corpus},
                        "checkpoint": {"out": str(tmp_path)}})
    trainer = Trainer.build(cfg, ParallelMesh.local())
    trainer.save(tmp_path, 1)
    manifest = read_manifest(latest_checkpoint(tmp_path / "checkpoints"), trainer.model.cfg)
    assert manifest["model"]["moe_layers"] == [1]


# -- the planner ------------------------------------------------------------------------------

PLANNED = preset("tiny", vocab_size=64, moe_experts=8, moe_top_k=2, moe_ffn_size=16,
                 moe_shared_ffn_size=48, moe_shared_gate="sigmoid", moe_first_dense=1,
                 moe_capacity_factor=0.0)


@pytest.mark.parametrize("imbalance", [1.0, 1.5])
def test_planner_prices_expert_width_shared_expert_and_dense_layers(imbalance):
    m, lay = PLANNED, ParallelPlan(dp=4, ep=2, micro_batch=2)
    work = Workload(m, lay, 64, 8, "fp32", imbalance)
    h, tokens, fe, fs = m.hidden_size, 2 * 64, 16, 48
    dense, moe = work.layer(0), work.layer(1)
    attention = 4 * h * h
    assert sum(dense.weight_matmuls) == pytest.approx(2 * tokens * (attention + 2 * h * m.ffn_size))
    # router [8, h], gate [1, h], the shared expert, k = 2 experts' rows x the busiest rank's load
    mlp = 8 * h + h + 2 * h * fs + 2 * imbalance * 2 * h * fe
    assert sum(moe.weight_matmuls) == pytest.approx(2 * tokens * (attention + mlp))
    held = 8 * h + h + (2 * h * fs + fs + h) + 4 * (2 * h * fe + fe + h)  # 8 experts / ep 2
    assert moe.parameters == m.attention_parameters() + held
    assert dense.parameters == m.attention_parameters() + m.mlp_parameters()
    forward, backward = _expert_comm(work, BUILT_IN["h100-80g"], 1)
    assert _expert_comm(work, BUILT_IN["h100-80g"], 0) == (0.0, 0.0)  # a dense layer
    base = _expert_comm(dataclasses.replace(work, moe_imbalance=1.0), BUILT_IN["h100-80g"], 1)
    assert (backward > base[1]) == (imbalance > 1)


def test_all_to_all_bytes_scale_with_the_imbalance_capped_by_capacity():
    hw = dataclasses.replace(BUILT_IN["h100-80g"], collective_latency_s=0.0)
    lay = ParallelPlan(dp=4, ep=2, micro_batch=2)
    for factor, imbalance, load in ((0.0, 1.5, 1.5), (1.25, 1.5, 1.25), (1.25, 1.1, 1.1)):
        m = dataclasses.replace(PLANNED, moe_capacity_factor=factor)
        one, more = (_expert_comm(Workload(m, lay, 64, 8, "fp32", x), hw, 1)[1]
                     for x in (1.0, imbalance))
        assert more == pytest.approx(load * one)
    single = Workload(PLANNED, ParallelPlan(dp=4, micro_batch=2), 64, 8, "fp32", 2.0)
    assert single.expert_load == 1.0  # one rank computes every row


def test_model_flops_count_the_shapes():
    m, s = PLANNED, 64
    h, layers = m.hidden_size, m.num_layers
    weights = layers * 4 * h * h + 2 * h * m.ffn_size \
        + (layers - 1) * (8 * h + h + 2 * h * 48 + 2 * 2 * h * 16) + m.vocab_size * h
    assert m.flops_per_token(s) == pytest.approx(6 * weights + 12 * layers * s * h)


def test_plan_states_the_moe_shape_and_load(capsys):
    flags = ["plan", "--gpus", "4", "--model", "tiny", "--moe-experts", "4", "--moe-ffn-size",
             "32", "--moe-shared-ffn-size", "64", "--moe-shared-gate", "sigmoid",
             "--moe-layers", "1,3", "--hardware", "h100-80g", "--top", "1", "--explain"]
    assert main([*flags, "--moe-imbalance", "1.25"]) == 0
    out = capsys.readouterr().out
    assert "MoE: 2 of 4 layers (1, 3), 4 experts of width 32, top-1, a shared expert of width" \
           " 64 (gate: sigmoid)" in out
    assert "max/mean expert load 1.25 (--moe-imbalance)" in out
    assert "--moe-layers 1,3" in out  # the command to train it
    for bad, message in ((["--moe-imbalance", "0.5"], "--moe-imbalance is a max/mean expert"
                                                       " load, a finite number >= 1, got 0.5"),
                         (["--moe-imbalance", "nan"], "got nan")):
        assert main([*flags, *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert main(["plan", "--gpus", "4", "--moe-imbalance", "1.2"]) == 2
    assert "--moe-imbalance prices MoE layers" in capsys.readouterr().err


def test_a_runs_measured_imbalance():
    rows = [{"moe_tokens_per_expert_max": 30.0, "moe_tokens_per_expert_mean": 20.0},
            {"moe_tokens_per_expert_max": 24.0, "moe_tokens_per_expert_mean": 20.0},
            {"moe_tokens_per_expert_max": 26.0, "moe_tokens_per_expert_mean": 20.0}]
    assert measured_imbalance(rows) == pytest.approx(1.3)
    assert measured_imbalance([{"step_time_s": 1.0}]) == 1.0
    assert not math.isnan(measured_imbalance([]))
