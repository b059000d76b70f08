"""Model TFLOP/s and MFU in the metrics: the documented formula applied to the measured tokens/s,
against the peak of the run's hardware profile."""

import dataclasses
import os

import pytest
import torch
from harness import run_on_ranks

from meshtrain.cli.main import check_train
from meshtrain.config.run_config import build_config
from meshtrain.models import preset
from meshtrain.planner.hardware import BUILT_IN, device_profile
from meshtrain.training.metrics import Utilization
from meshtrain.training.trainer import run_training

SEQ = 32
TINY = dataclasses.replace(preset("tiny"), vocab_size=256)  # a byte corpus's vocabulary


def _gpt_flops_per_token(cfg, seq_len: int) -> int:
    """The guide's formula for GPT, written out: 6 x (12 l h^2 + V h) + 12 l s h."""
    layers, h, v = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    return 6 * (12 * layers * h * h + v * h) + 12 * layers * seq_len * h


def _cfg(corpus: str, out: str, **parallel):
    return build_config({}, {"train": {"steps": 3, "global_batch": 4, "micro_batch": 2,
                                       "seq_len": SEQ, "eval_every": 0},
                             "parallel": {"device": "cpu"} | parallel,
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _rows(corpus: str, out: str, parallel: dict) -> tuple[list[dict], int]:
    return run_training(_cfg(corpus, out, **parallel)), torch.get_num_threads()


def _cpu_rank_peak(threads: int, local_ranks: int) -> float:
    """cpu-gloo's fp32 peak is one one-thread rank's share with 4 ranks on 2 cores: half a core."""
    cores = min(threads, (os.cpu_count() or 1) / local_ranks)
    return BUILT_IN["cpu-gloo"].fp32_peak_tflops * cores / 0.5


@pytest.mark.parametrize("hardware", [None, "h100-80g"])
def test_each_row_carries_tflops_and_mfu_of_its_tokens_per_s(corpus, tmp_path, hardware):
    parallel = {} if hardware is None else {"hardware": hardware}
    rows, threads = run_on_ranks(2, _rows, corpus, str(tmp_path), parallel)[0]  # rank 0's
    peak = 494.0 if hardware else _cpu_rank_peak(threads, local_ranks=2)  # h100: TF32
    flops = _gpt_flops_per_token(TINY, SEQ)
    assert flops == TINY.flops_per_token(SEQ)  # the one definition the planner uses too
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        tflops = flops * row["tokens_per_s"] / 2 / 1e12  # per rank: 2 ranks share the tokens
        assert row["tflops"] == pytest.approx(tflops, rel=1e-12)
        assert row["mfu"] == pytest.approx(tflops / peak, rel=1e-12)


def test_a_cpu_rank_s_peak_is_its_share_of_the_cores_the_calibration_measured():
    """The README's one-process run on 2 cores once showed 134.7% MFU against a quarter of the
    machine's peak: a calibrated CPU profile's peaks scale with the cores a rank computes on."""
    cpu = BUILT_IN["cpu-gloo"]  # 4 one-thread ranks on 2 cores: each has half a core
    assert cpu.for_cpu_rank(0.5) == cpu
    whole = cpu.for_cpu_rank(2.0)  # one rank with both cores' threads
    assert whole.peak_for("fp32") == pytest.approx(4 * cpu.peak_for("fp32"))
    assert whole.peak_for("bf16") == pytest.approx(4 * cpu.peak_for("bf16"))
    assert whole.peak_for("fp16") == pytest.approx(4 * cpu.peak_for("fp16"))
    assert BUILT_IN["h100-80g"].for_cpu_rank(2.0) is BUILT_IN["h100-80g"]  # a data sheet's
    one = Utilization.of_run(1.0, ranks=1, precision="fp32", device=torch.device("cpu"),
                             hardware=None, local_ranks=1)
    cores = min(torch.get_num_threads(), os.cpu_count() or 1)
    assert one.hardware.peak_for("fp32") == pytest.approx(_cpu_rank_peak(cores, 1))


def test_utilization_fields():
    h100 = Utilization(1e9, ranks=8, precision="bf16", hardware=BUILT_IN["h100-80g"])
    assert h100.fields(4e6) == pytest.approx({"tflops": 500.0, "mfu": 500.0 / 989.0})
    fp32 = dataclasses.replace(h100, precision="fp32")
    assert fp32.fields(4e6)["mfu"] == pytest.approx(500.0 / 494.0)
    assert dataclasses.replace(h100, precision="fp64").fields(4e6) == {"tflops": 500.0}
    assert dataclasses.replace(h100, hardware=None).fields(4e6) == {"tflops": 500.0}


def test_the_profile_is_the_setting_else_the_device_s():
    cpu = torch.device("cpu")
    of_run = Utilization.of_run
    assert of_run(1.0, ranks=1, precision="fp32", device=cpu, hardware=None).hardware.name \
        == "cpu-gloo"
    assert of_run(1.0, ranks=1, precision="fp32", device=cpu, hardware="a100-40g").hardware \
        is BUILT_IN["a100-40g"]
    assert device_profile("NVIDIA H100 80GB HBM3") is BUILT_IN["h100-80g"]
    assert device_profile("NVIDIA A100-SXM4-80GB") is BUILT_IN["a100-80g-selene"]
    assert device_profile("NVIDIA GeForce RTX 4090") is None  # no MFU rather than a guess


def test_a_bad_hardware_setting_is_refused_before_ranks_start(corpus, tmp_path):
    with pytest.raises(ValueError, match="`hardware` 'nope' is neither a built-in profile"):
        check_train(_cfg(corpus, str(tmp_path / "run"), hardware="nope"), 1)
    assert not (tmp_path / "run").exists()
