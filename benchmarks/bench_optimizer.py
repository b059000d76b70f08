"""Fused against foreach AdamW: one optimizer step on this host's CPU, one thread (as each rank
runs here), over the fp32 parameters of a few model sizes laid out as meshtrain steps them:
`per-tensor` (every parameter its own tensor, in the decay and no-decay groups of `build_adamw`:
the replicated sync, and the fp32 masters of bf16/fp16 runs and 2BW) and `zero` (1-D pieces of
one flat fp32 shard, as ZeRO's optimizer steps them at dp 1, offloaded or not).

The two optimizers are timed alternately, step for step, on identical copies (same gradients),
so a change in the host's load reaches both. Each line: the median step time of each, their
ratio, and the time of each as bytes per parameter at this host's measured copy bandwidth
(`dst.copy_(src)` of 2^26 fp32 elements, reading and writing 8 bytes per element): the unit the
planner prices the optimizer in (`planner/costs.py`, `OPTIMIZER_BYTES_PER_PARAMETER`).

    python benchmarks/bench_optimizer.py              # tiny, gpt2 with 4 layers, gpt2 (124M)
    python benchmarks/bench_optimizer.py --quick      # tiny only, few repetitions: a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from torch import nn

from meshtrain.models import preset
from meshtrain.parallel.runtime.optim import OptimizerSettings, build_adamw

SIZES = {"tiny": ("tiny", {}), "gpt2-4-layers": ("gpt2", {"num_layers": 4}),
         "gpt2": ("gpt2", {})}
"""Name -> (preset, overrides of its fields)."""
LAYOUTS = ("per-tensor", "zero")


def _parameters(shapes: list[tuple[int, ...]], layout: str,
                seed: int) -> tuple[list[nn.Parameter], set[int] | None]:
    """Parameters of `shapes` with gradients, and (zero) the ids of those that skip decay."""
    gen = torch.Generator().manual_seed(seed)
    numel = [torch.Size(s).numel() for s in shapes]
    flat = torch.randn(sum(numel), generator=gen)
    grads = torch.randn(sum(numel), generator=gen)
    if layout == "per-tensor":
        params = [nn.Parameter(part.view(shape).clone())
                  for part, shape in zip(flat.split(numel), shapes, strict=True)]
        for param, part in zip(params, grads.split(numel), strict=True):
            param.grad = part.view(param.shape).clone()
        return params, None
    pieces = [nn.Parameter(part) for part in flat.split(numel)]  # views of one flat shard
    for piece, part in zip(pieces, grads.split(numel), strict=True):
        piece.grad = part
    return pieces, {id(p) for p, s in zip(pieces, shapes, strict=True) if len(s) < 2}


def _optimizer(shapes, layout: str, kernel: str) -> torch.optim.AdamW:
    params, no_decay = _parameters(shapes, layout, seed=0)
    optimizer = build_adamw(params, OptimizerSettings(lr=3e-4, weight_decay=0.1),
                            no_decay=no_decay)
    for group in optimizer.param_groups:  # the kernel under test, whatever build_adamw picks
        group["fused"], group["foreach"] = kernel == "fused", kernel == "foreach"
    optimizer.defaults["fused"] = kernel == "fused"
    optimizer.step()  # the moments exist before timing
    return optimizer


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second one `copy_` reads and writes (the best of `repeats`)."""
    src, dst = torch.randn(2**26), torch.empty(2**26)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def compare(shapes, layout: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of each kernel, alternating."""
    optimizers = {kernel: _optimizer(shapes, layout, kernel) for kernel in ("fused", "foreach")}
    times: dict[str, list[float]] = {kernel: [] for kernel in optimizers}
    for _ in range(repeats):
        for kernel, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[kernel].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = {"tiny": SIZES["tiny"]} if args.quick else SIZES
    bandwidth = copy_bandwidth()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread,"
          f" {torch.backends.cpu.get_cpu_capability()}; copy bandwidth {bandwidth / 1e9:.2f} GB/s")
    print(f"{'model':<15} {'params':>8} {'layout':<10} {'fused ms':>9} {'foreach ms':>10}"
          f" {'foreach/fused':>13} {'fused B/p':>9} {'foreach B/p':>11}")
    for name, (base, overrides) in sizes.items():
        cfg = dataclasses.replace(preset(base), **overrides)
        shapes = list(cfg.parameter_shapes().values())
        numel = sum(torch.Size(s).numel() for s in shapes)
        repeats = args.repeats or (3 if args.quick else max(5, min(50, int(2e8 // numel))))
        for layout in LAYOUTS:
            times = compare(shapes, layout, repeats)
            fused, foreach = (statistics.median(times[k]) for k in ("fused", "foreach"))
            print(f"{name:<15} {numel / 1e6:7.2f}M {layout:<10} {fused * 1e3:9.2f}"
                  f" {foreach * 1e3:10.2f} {foreach / fused:13.2f}"
                  f" {fused * bandwidth / numel:9.1f} {foreach * bandwidth / numel:11.1f}",
                  flush=True)
    print("median of alternating steps; B/p: step time x copy bandwidth / parameters")


if __name__ == "__main__":
    main()
