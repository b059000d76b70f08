"""The Qwen2 family (Llama's blocks with q/k/v biases) on the model/strategy seam: its presets,
its refusals, and its loss trajectory at tp 2 x dp 2, pp 2 and 2d equal to one process's; its
sliding window on the upper layers (FLOPs, plan, trajectories at tp 2, cp 2 and pp 2).
Hugging Face interop (logits, generation, import/export) is tested with the other families in
test_hf_interop.py."""

import dataclasses
import math

import pytest
from harness import run_on_ranks, worker_mesh

from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.errors import Code, SettingError
from meshtrain.models import config_from_dict, get_family, preset
from meshtrain.models.qwen2 import Qwen2Config
from meshtrain.training.trainer import Trainer

QWEN = {"model": "qwen2-tiny"}


def test_presets_have_the_published_shapes_and_biases():
    small = preset("qwen2.5-0.5b")
    assert (small.num_layers, small.hidden_size, small.num_heads, small.kv_heads,
            small.ffn_size, small.vocab_size, small.tie_embeddings, small.qkv_bias) == \
        (24, 896, 14, 2, 4864, 151936, True, True)
    assert 0.49e9 < small.num_parameters() < 0.50e9  # Qwen2.5-0.5B: 0.49B parameters
    assert 7.6e9 < preset("qwen2.5-7b").num_parameters() < 7.7e9  # Qwen2.5-7B: 7.61B
    assert get_family("qwen2").config is Qwen2Config


def test_bias_free_qwen2_and_a_window_start_without_a_window_are_refused():
    for fields, setting, code in (({"qkv_bias": False}, "qkv_bias", Code.MODEL_UNSUPPORTED),
                                  ({"window_start_layer": 2}, "window_start_layer",
                                   Code.MODEL_SHAPE),
                                  ({"window_start_layer": 4, "sliding_window": 8},
                                   "window_start_layer", Code.RANGE)):
        with pytest.raises(SettingError) as refused:
            dataclasses.replace(preset("qwen2-tiny"), **fields)
        assert refused.value.code is code
        assert refused.value.settings[0] == setting


def _losses(corpus, steps: int, degrees: dict, plan: dict, model: dict = QWEN) -> list[float]:
    cfg = build_config({}, {"model": model, "train": {
        "steps": steps, "global_batch": 8, "micro_batch": 2, "seq_len": 32, "seed": 5,
        "eval_every": 0, "warmup_steps": 2}, "parallel": {"device": "cpu"} | {
            key: value for key, value in plan.items() if key in ("cp", "cp_mode")},
        "data": {"data": corpus}, "checkpoint": {"out": "/nonexistent"}})
    cfg.plan = dataclasses.replace(cfg.plan, **plan)
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    return [trainer.train_step(step)["loss"] for step in range(steps)]


STEPS = 4


@pytest.fixture(scope="module")
def reference(corpus) -> list[float]:
    return run_on_ranks(1, _losses, corpus, STEPS, {"dp": 1}, {})[0]


@pytest.mark.parametrize("degrees,plan", [
    ({"tp": 2, "dp": 2}, {}),
    ({"pp": 2, "dp": 1}, {}),
    ({"tp": 4, "dp": 1, "tp_scheme": "2d"}, {"tp_scheme": "2d"}),
], ids=["tp2xdp2", "pp2", "2d"])
def test_loss_trajectory_equals_one_process(corpus, reference, degrees, plan):
    ranks = math.prod(degrees.get(axis, 1) for axis in ("tp", "pp", "dp"))
    results = run_on_ranks(ranks, _losses, corpus, STEPS, degrees, plan)
    losses = results[-1]  # the last rank holds the last pipeline stage
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    assert rel < 1e-5, rel


WINDOWED = {"model": "qwen2-tiny", "model_arg": ["sliding_window=8", "window_start_layer=2"]}
"""Layers 2 and 3 of 4 slide a window of 8 over sequences of 32; layers 0 and 1 attend all."""


def test_a_window_on_the_upper_layers_prices_only_those_and_plan_names_them(capsys):
    big = preset("qwen2.5-7b", sliding_window=4096, window_start_layer=14)
    causal = preset("qwen2.5-7b")
    s = 32768
    weights = 6 * big.matmul_parameters_per_token()
    ratio = (big.flops_per_token(s) - weights) / (causal.flops_per_token(s) - weights)
    assert ratio == pytest.approx((14 + 14 * 4096 / s) / 28, rel=1e-9)
    assert main(["plan", "--model", "qwen2.5-7b", "--model-arg", "sliding_window=4096",
                 "--model-arg", "window_start_layer=14", "--gpus", "8", "--seq-len", str(s),
                 "--global-batch", "64", "--hardware", "h100-80g", "--explain"]) == 0
    assert "attention: sliding window 4096 on layers 14-27 of 28 of sequence 32768: attention" \
        " FLOPs 0.562 of the causal mask's" in capsys.readouterr().out


@pytest.mark.parametrize("degrees,plan", [
    ({"tp": 2, "dp": 1}, {}),
    ({"cp": 2, "dp": 1}, {"cp": 2, "cp_mode": "ring"}),
    ({"cp": 2, "dp": 1}, {"cp": 2, "cp_mode": "all2all"}),
    ({"pp": 2, "dp": 1}, {}),
], ids=["tp2", "cp2-ring", "cp2-all2all", "pp2"])
def test_a_window_on_the_upper_layers_trains_as_one_process(corpus, degrees, plan):
    reference = run_on_ranks(1, _losses, corpus, 3, {"dp": 1}, {}, WINDOWED)[0]
    full = run_on_ranks(1, _losses, corpus, 3, {"dp": 1}, {}, QWEN)[0]
    assert abs(full[0] - reference[0]) > 1e-4  # the window changes the numbers
    losses = run_on_ranks(2, _losses, corpus, 3, degrees, plan, WINDOWED)[-1]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    assert rel < 1e-5, rel


def test_a_checkpoint_of_the_version_with_use_sliding_window_still_loads():
    """Earlier versions recorded Qwen2's refused `use_sliding_window` (always false)."""
    fields = dataclasses.asdict(preset("qwen2-tiny")) | {"use_sliding_window": False}
    assert config_from_dict("qwen2", fields) == preset("qwen2-tiny")
    with pytest.raises(ValueError, match="use_sliding_window are not qwen2 settings"):
        config_from_dict("qwen2", fields | {"use_sliding_window": True})
