"""The Mistral family (Llama's blocks with a sliding window): its presets and window setting, the
planner's attention FLOPs under the window, and its loss trajectory at tp 2, cp 2 (ring and
all-to-all) and pp 2 equal to one process's on sequences longer than the window. Hugging Face
interop (logits at tp 1/2, pp 2 and cp 2, generation, import/export) is in test_hf_interop.py;
the window in every attention path in test_masks.py."""

import dataclasses

import pytest
from harness import run_on_ranks, worker_mesh

from meshtrain.cli.main import _train_config, main
from meshtrain.cli.parsers import build_parser
from meshtrain.config.run_config import build_config
from meshtrain.errors import SettingError
from meshtrain.models import preset
from meshtrain.planner.workload import CAUSAL_FRACTION
from meshtrain.training.trainer import Trainer


def test_presets_have_the_published_shapes_and_window():
    big = preset("mistral-7b-v0.1")
    assert (big.num_layers, big.hidden_size, big.num_heads, big.kv_heads, big.ffn_size,
            big.vocab_size, big.sliding_window, big.tie_embeddings) == \
        (32, 4096, 32, 8, 14336, 32000, 4096, False)
    assert 7.2e9 < big.num_parameters() < 7.3e9  # Mistral 7B: 7.24B parameters
    with pytest.raises(SettingError, match="`sliding_window` must be positive"):
        preset("mistral-tiny", sliding_window=0)


def test_attention_flops_under_the_window():
    """At s = 32768 the window (4096) leaves W/s of the causal mask's attention FLOPs."""
    windowed = preset("mistral-7b-v0.1")
    causal = dataclasses.replace(windowed, sliding_window=None)
    s = 32768
    weights = 6 * windowed.matmul_parameters_per_token()
    ratio = (windowed.flops_per_token(s) - weights) / (causal.flops_per_token(s) - weights)
    assert ratio == pytest.approx(4096 / s, rel=0.01)
    # what a kernel computes: nearly W keys a query, against (s + 1) / 2 under the causal mask
    assert windowed.attended_keys(s) == pytest.approx(4096 * (1 - 4096 / (2 * s)), rel=1e-3)
    assert causal.attended_keys(s) == pytest.approx(CAUSAL_FRACTION * s, rel=1e-3)


def test_the_window_is_a_model_setting_and_plan_explains_it(capsys, tmp_path):
    flags = ["train", "--model", "mistral-tiny", "--model-arg", "sliding_window=9",
             "--out", str(tmp_path)]
    assert _train_config(build_parser().parse_args(flags)).model_config(256).sliding_window == 9
    assert main(["plan", "--model", "mistral-7b-v0.1", "--gpus", "8", "--seq-len", "32768",
                 "--global-batch", "64", "--hardware", "h100-80g", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "attention: sliding window 4096 of sequence 32768: attention FLOPs 0.125 of the" \
        " causal mask's" in out


def _losses(corpus: str, degrees: dict, parallel: dict) -> list[float]:
    cfg = build_config({}, {"model": {"model": "mistral-tiny", "num_layers": 2}, "train": {
        "steps": 3, "global_batch": 4, "micro_batch": 2, "seq_len": 48, "seed": 5,
        "eval_every": 0, "warmup_steps": 1}, "parallel": {"device": "cpu"} | parallel,
        "data": {"data": corpus}, "checkpoint": {"out": "/nonexistent"}})
    cfg.plan = dataclasses.replace(cfg.plan, **degrees)
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    return [trainer.train_step(step)["loss"] for step in range(3)]


def test_loss_trajectory_equals_one_process(corpus):
    """Sequences of 48 under a window of 16: every layout trains the same numbers."""
    reference = run_on_ranks(1, _losses, corpus, {"dp": 1}, {})[0]
    for degrees, parallel in [({"tp": 2, "dp": 1}, {}), ({"pp": 2, "dp": 1}, {"pp": 2}),
                              ({"cp": 2, "dp": 1}, {"cp": 2, "cp_mode": "ring"}),
                              ({"cp": 2, "dp": 1}, {"cp": 2, "cp_mode": "all2all"})]:
        losses = run_on_ranks(2, _losses, corpus, degrees, parallel)[-1]
        rel = max(abs(a - b) / b for a, b in zip(losses, reference, strict=True))
        assert rel < 1e-5, (parallel, rel)
