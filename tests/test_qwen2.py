"""The Qwen2 family (Llama's blocks with q/k/v biases) on the model/strategy seam: its presets,
its refusals, and its loss trajectory at tp 2 x dp 2, pp 2 and 2d equal to one process's.
Hugging Face interop (logits, generation, import/export) is tested with the other families in
test_hf_interop.py."""

import dataclasses
import math

import pytest
from harness import run_on_ranks, worker_mesh

from meshtrain.config.run_config import build_config
from meshtrain.errors import Code, SettingError
from meshtrain.models import get_family, preset
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


def test_sliding_windows_and_bias_free_qwen2_are_refused():
    for fields, setting in (({"use_sliding_window": True}, "use_sliding_window"),
                            ({"qkv_bias": False}, "qkv_bias")):
        with pytest.raises(SettingError) as refused:
            dataclasses.replace(preset("qwen2-tiny"), **fields)
        assert refused.value.code is Code.MODEL_UNSUPPORTED
        assert refused.value.settings == (setting,)


def _losses(corpus, steps: int, degrees: dict, plan: dict) -> list[float]:
    cfg = build_config({}, {"model": QWEN, "train": {
        "steps": steps, "global_batch": 8, "micro_batch": 2, "seq_len": 32, "seed": 5,
        "eval_every": 0, "warmup_steps": 2}, "parallel": {"device": "cpu"},
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
