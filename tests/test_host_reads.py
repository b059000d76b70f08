"""A training step reads the device once: every conversion of a tensor to a Python value made by
meshtrain's code inside `train_step` is counted (on a GPU each one waits for the device), and a
step may make exactly one, or one more per MoE layer forward (its all-to-all split sizes)."""

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from harness import run_on_ranks, worker_mesh

import meshtrain
from meshtrain.config.run_config import build_config
from meshtrain.data.corpus import to_device
from meshtrain.parallel.layers.expert import MoE
from meshtrain.training.trainer import Trainer

PACKAGE = str(Path(meshtrain.__file__).parent)
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
         "nonzero")


@contextlib.contextmanager
def counted_reads():
    """Calls of `READS` on tensors made directly from meshtrain's modules, by caller."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(PACKAGE):
                calls.append(f"{name} in {caller.co_name} ({Path(caller.co_filename).name})")
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _cfg(corpus: str, model: dict | None = None, train: dict | None = None,
         parallel: dict | None = None):
    return build_config({}, {
        "model": {"model": "tiny", "num_layers": 2, "hidden_size": 32, "num_heads": 4}
        | (model or {}),
        "train": {"steps": 3, "global_batch": 4, "micro_batch": 1, "seq_len": 16}
        | (train or {}),
        "parallel": {"device": "cpu"} | (parallel or {}), "data": {"data": corpus},
        "checkpoint": {"out": "/nonexistent"}})


def _reads_per_step(cfg, degrees: dict) -> tuple[list[list[str]], int]:
    """The reads of steps 2 and 3 (step 1 builds optimizer state), and the MoE layer forwards
    of one step on this rank."""
    trainer = Trainer.build(cfg, worker_mesh(**degrees))
    forwards = []
    for moe in (m for m in trainer.model.modules() if isinstance(m, MoE)):
        moe.register_forward_hook(lambda *_: forwards.append(1))
    trainer.train_step(0)
    reads = []
    for step in (1, 2):
        forwards.clear()
        with counted_reads() as calls:
            trainer.train_step(step)
        reads.append(calls)
    return reads, len(forwards)


@pytest.mark.parametrize("train", [{}, {"precision": "fp16"}, {"precision": "bf16"}],
                         ids=["fp32", "fp16", "bf16"])
def test_one_read_per_step_in_one_process(corpus, train):
    reads, _ = _reads_per_step(_cfg(corpus, train=train), {})
    assert [len(calls) for calls in reads] == [1, 1], reads


@pytest.mark.parametrize("degrees,parallel", [
    ({"tp": 2}, {"sequence_parallel": True}),
    ({"pp": 2}, {"pp_schedule": "1f1b"}),
    ({"dp": 2}, {"zero": 3}),
], ids=["tp2-sp", "pp2-1f1b", "dp2-zero3"])
def test_one_read_per_step_in_parallel_layouts(corpus, degrees, parallel):
    for reads, _ in run_on_ranks(2, _reads_per_step, _cfg(corpus, parallel=parallel), degrees):
        assert [len(calls) for calls in reads] == [1, 1], reads


def test_moe_reads_once_per_layer_forward(corpus):
    """Expert parallelism: one read per MoE layer forward (its split sizes) and the step's."""
    cfg = _cfg(corpus, model={"moe_experts": 4, "moe_top_k": 2, "moe_every": 1,
                              "moe_capacity_factor": 1.0})
    for reads, forwards in run_on_ranks(2, _reads_per_step, cfg, {"dp": 2, "ep": 2}):
        assert forwards == 2 * 2  # two MoE layers, two micro-batches per data-parallel rank
        assert [len(calls) for calls in reads] == [1 + forwards] * 2, reads


def test_micro_batches_reach_the_device_in_one_transfer(monkeypatch):
    """Off the CPU the step's micro-batches are stacked, pinned and copied once without the host
    waiting (here the meta device stands in for a GPU, and pinning for the missing CUDA)."""
    batches = [(torch.arange(6).view(2, 3) + i, torch.arange(6).view(2, 3) - i) for i in range(3)]
    copies = []
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        copies.append(kwargs.get("non_blocking"))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.Tensor, "to", to)
    moved = to_device(batches, torch.device("meta"))
    assert copies == [True]
    assert [(x.device.type, x.shape, y.shape) for x, y in moved] == \
        [("meta", (2, 3), (2, 3))] * 3
    assert to_device(batches, torch.device("cpu")) is batches  # nothing to move
