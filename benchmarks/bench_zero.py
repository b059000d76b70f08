"""One data-parallel training step on two ranks: meshtrain ZeRO 0/1/2/3 against PyTorch DDP,
FSDP2 (`fully_shard`) and DeepSpeed ZeRO 1/2/3, and one process.

Same model (meshtrain's dense GPT, the same weights), same global batch (each rank takes half),
plain AdamW, fp32, alternating contenders in one run (the machinery of bench_tp.py). Memory per
rank is measured from the kernel's resident-set counters, with glibc's mmap threshold pinned so
freed tensors leave resident memory at once: "held" is the growth from before a contender is
built to after its first step (parameters, gradients, optimizer states, buffers), "peak" adds the
largest rise within one step (gathers, gradient buckets, activations).

    python benchmarks/bench_zero.py                 # hidden 512, 4 layers, s=256, V=8192, b=8
    python benchmarks/bench_zero.py --quick         # tiny sizes: a smoke run
    python benchmarks/bench_zero.py --only zero3,fsdp2,single

DeepSpeed is optional (`DS_BUILD_OPS=0 pip install deepspeed==0.19.8`); it runs with its CPU
accelerator over gloo and a client torch AdamW (no compiled ops).
"""

from __future__ import annotations

import functools
import os
import sys

# before torch allocates: freed large tensors go back to the kernel, so RSS follows live bytes
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_tp import (  # noqa: E402
    DDP,
    LR,
    WORLD,
    Contender,
    MeshtrainDP,
    Shape,
    SingleProcess,
    Step,
    Unavailable,
    _global_mean,
    _rank_share,
    dense_weights,
    main,
)

import meshtrain  # noqa: E402
from meshtrain.parallel.runtime.zero import ZeroDataParallel  # noqa: E402


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


@functools.cache
def _warm_up_process(shape: Shape) -> None:
    """Pay torch's, the BLAS's and gloo's one-time allocations before the first contender is
    measured: a step of the benchmark's own model on a rank's share of the batch, since the
    BLAS keeps buffers sized by the matmuls it has run (a tiny model left ~8 MiB of them to
    the first contender at full sizes, whichever it was)."""
    model = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
    ids, targets = _rank_share(shape, 0)
    model.loss(model(ids), targets).backward()
    torch.optim.AdamW(model.parameters()).step()
    if dist.is_initialized():
        dist.all_reduce(torch.zeros(1 << 20))
        dist.barrier()


def measured(build):
    """Wrap a contender's build so its step records held and transient resident memory."""

    def wrapped(self, shape: Shape) -> Step:
        _warm_up_process(shape)
        before = _status("VmRSS")
        step = build(self, shape)
        step()  # the first step creates gradients and optimizer states
        memory = {"held": _status("VmRSS") - before, "transient": 0}

        def timed_step() -> torch.Tensor:
            start = _status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak (VmHWM) to the current resident size
            loss = step()
            memory["transient"] = max(memory["transient"], _status("VmHWM") - start)
            return loss

        timed_step.memory = memory
        return timed_step

    return wrapped


class MeshtrainZero(Contender):
    ranks = WORLD

    def __init__(self, stage: int):
        self.stage = stage
        self.name = f"meshtrain zero={stage} dp=2"
        self.key = f"zero{stage}"

    @measured
    def build(self, shape: Shape) -> Step:
        mesh = meshtrain.init_parallel(dp=WORLD, device="cpu")
        model = meshtrain.build_model(shape.config(), mesh, seed=0)
        units = model.roles().units
        zero = ZeroDataParallel([params for _, params in units], mesh.dp_cp, stage=self.stage)
        if self.stage == 3:
            zero.attach([module for module, _ in units])
        opt = torch.optim.AdamW([piece for _, piece in zero.step_pieces()], lr=LR)
        ids, targets = _rank_share(shape, mesh.dp.rank)

        def step() -> torch.Tensor:
            zero.zero_grad()
            zero.sync = True
            loss = model.loss(model(ids), targets)
            loss.backward()
            zero.wait()
            zero.step(opt)
            return _global_mean(loss.detach())

        return step


class Measured(Contender):
    """A bench_tp contender with memory figures."""

    def __init__(self, inner: Contender):
        self.inner = inner
        self.name, self.key, self.ranks = inner.name, inner.key, inner.ranks
        self.reference = inner.reference

    @measured
    def build(self, shape: Shape) -> Step:
        return self.inner.build(shape)


class FSDP2(Contender):
    name = "PyTorch FSDP2 dp=2"
    key = "fsdp2"
    ranks = WORLD

    @measured
    def build(self, shape: Shape) -> Step:
        from torch.distributed.fsdp import fully_shard

        model = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
        for block in model.layers.values():
            fully_shard(block)
        fully_shard(model)  # embedding, final norm, head: gathered for the whole forward
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        ids, targets = _rank_share(shape, dist.get_rank())

        def step() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = model.loss(model(ids), targets)
            loss.backward()
            opt.step()
            return _global_mean(loss.detach())

        return step


class DeepSpeedZero(Contender):
    ranks = WORLD

    def __init__(self, stage: int):
        self.stage = stage
        self.name = f"DeepSpeed ZeRO-{stage} dp=2"
        self.key = f"deepspeed{stage}"

    @measured
    def build(self, shape: Shape) -> Step:
        try:
            import deepspeed
        except ImportError as exc:
            raise Unavailable(f"deepspeed not installed ({exc})") from None
        model = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
        model.load_state_dict(dense_weights(shape))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        config = {"train_micro_batch_size_per_gpu": shape.batch // WORLD,
                  "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": self.stage},
                  "zero_allow_untested_optimizer": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                               dist_init_required=False)
        ids, targets = _rank_share(shape, dist.get_rank())

        def step() -> torch.Tensor:
            loss = model.loss(engine(ids), targets)
            engine.backward(loss)
            engine.step()
            return _global_mean(loss.detach())

        return step


CANDIDATES: list[Contender] = [
    *(MeshtrainZero(stage) for stage in (1, 2, 3)), Measured(MeshtrainDP()), Measured(DDP()),
    FSDP2(), *(DeepSpeedZero(stage) for stage in (1, 2, 3)), Measured(SingleProcess())]

if __name__ == "__main__":
    sys.exit(main(candidates=CANDIDATES, description=__doc__))
