"""One Qwen3-MoE-shaped layer, forward + backward: meshtrain's MoE against transformers' own
`Qwen3MoeSparseMoeBlock` holding the same weights, in one run (`bench_moe.py --layer`).

Shape scaled to this CPU: hidden 512, 64 SwiGLU experts of width 128, top-8, dropless, softmax
scores with the top-8 renormalised (transformers' `norm_topk_prob`, meshtrain's rule for k >= 2),
4096 tokens, fp32. meshtrain's layer is the Llama family's MoE layer built from a preset with
`moe_ffn_size` 128 (the experts' width) and `moe_top_k` 8.
transformers' block runs under its default experts implementation (`grouped_mm`, what
`PreTrainedModel` selects when it can) and its `eager` one (a loop over the hit experts).
Outputs and input gradients are checked equal to transformers' before timing.

Contenders alternate within each round (A B C ... A B C ...), so load from other work on the
host hits them alike; each one's time is its median step, reported as a ratio to transformers'
default of the same run. One process runs at 2 threads; ep 2 is 2 gloo ranks x 1 thread, each
rank stepping half the tokens (its micro-batch) with 32 of the experts, time = slowest rank.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing import assert_close

from meshtrain import ParallelMesh, preset
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallelize import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import RankPool  # noqa: E402

HIDDEN, EXPERTS, TOP_K, WIDTH, TOKENS = 512, 64, 8, 128, 4096
QUICK = (64, 8, 4, 32, 256)
WARMUP = 1
EP2_GEMM = "padded"  # the fastest here (see the table)
EP2 = f"meshtrain {EP2_GEMM}, ep 2"


def meshtrain_layer(mesh: ParallelMesh, gemm: str, sizes=None) -> MoE:
    """The Llama family's MoE layer (SwiGLU experts) on `mesh`, seed 0."""
    h, e, k, f, _ = sizes or (HIDDEN, EXPERTS, TOP_K, WIDTH, TOKENS)
    cfg = preset("llama-tiny", num_layers=1, hidden_size=h, num_heads=8, num_kv_heads=8,
                 moe_ffn_size=f, moe_experts=e, moe_top_k=k, moe_capacity_factor=0.0,
                 moe_aux_loss_coef=0.0, moe_gemm=gemm)
    return build_model(cfg, mesh, seed=0).layers["0"].mlp


def transformers_block(layer: MoE, implementation: str, sizes=None):
    """transformers' Qwen3-MoE sparse block holding `layer`'s weights (one process: every
    expert)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    h, e, k, f, _ = sizes or (HIDDEN, EXPERTS, TOP_K, WIDTH, TOKENS)
    config = Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k,
                            moe_intermediate_size=f, norm_topk_prob=True, hidden_act="silu")
    config._experts_implementation = implementation
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        for i in range(e):
            expert = layer.experts[str(i)]
            block.experts.gate_up_proj[i].copy_(expert.fc.weight)  # [gate; up], as swiglu
            block.experts.down_proj[i].copy_(expert.proj.weight)
    return block


def inputs(tokens: int, hidden: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, tokens, hidden, generator=gen),
            torch.randn(1, tokens, hidden, generator=gen))


def step_fn(module, x: torch.Tensor, grad: torch.Tensor, *, ours: bool):
    """Forward + backward of `module` on `x` (a fresh leaf each time); returns (out, x.grad)."""
    def step():
        module.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        out = module(leaf, AuxiliaryOutputs()) if ours else module(leaf)
        out.backward(grad)
        return out.detach(), leaf.grad
    return step


def stacking_ms(layer: MoE, repeats: int = 5) -> float:
    """Median time to stack the layer's expert weights as a forward does (both projections)."""
    experts = list(layer.experts.values())

    def stack():
        with torch.no_grad():
            for name in ("fc", "proj"):
                torch.stack([getattr(e, name).weight for e in experts])
    return statistics.median(timed(stack, repeats)) * 1e3


def timed(step, n: int, sync=None) -> list[float]:
    times = []
    for _ in range(n):
        if sync is not None:
            sync()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


_ranked = {}


def _build_ranked(gemm: str, sizes) -> None:
    """On each rank: the ep 2 layer (dp 2 x ep 2) and this rank's half of the tokens."""
    from meshtrain.parallel.runtime.process_groups import init_parallel
    mesh = init_parallel(tp=1, dp=2, ep=2, device="cpu")
    layer = meshtrain_layer(mesh, gemm, sizes)
    x, grad = inputs(sizes[-1], sizes[0])
    half = sizes[-1] // 2
    rows = slice(mesh.dp.rank * half, (mesh.dp.rank + 1) * half)
    _ranked["step"] = step_fn(layer, x[:, rows], grad[:, rows], ours=True)
    _ranked["want"] = rows


def _time_ranked(n: int) -> list[float]:
    return timed(_ranked["step"], n, dist.barrier)


def _ranked_output() -> tuple[slice, torch.Tensor, torch.Tensor]:
    out, x_grad = _ranked["step"]()
    return _ranked["want"], out, x_grad


def main(rounds: int, steps: int, *, quick: bool = False) -> int:
    sizes = QUICK if quick else (HIDDEN, EXPERTS, TOP_K, WIDTH, TOKENS)
    torch.set_num_threads(2)
    local = ParallelMesh.local()
    x, grad = inputs(sizes[-1], sizes[0])
    base = meshtrain_layer(local, "loop", sizes)
    steps_by_name = {f"transformers {impl}": step_fn(transformers_block(base, impl, sizes), x,
                                                     grad, ours=False)
                     for impl in ("grouped_mm", "eager")}
    for gemm in ("loop", "padded", "grouped"):  # (auto is loop on a CPU)
        steps_by_name[f"meshtrain {gemm}"] = step_fn(meshtrain_layer(local, gemm, sizes), x,
                                                     grad, ours=True)
    want_out, want_grad = steps_by_name["transformers grouped_mm"]()
    for name, step in steps_by_name.items():  # the same numbers first
        out, x_grad = step()
        assert_close(out, want_out, rtol=1e-5, atol=1e-5, msg=name)
        assert_close(x_grad, want_grad, rtol=1e-5, atol=1e-5, msg=name)
    times = {name: [] for name in [*steps_by_name, EP2]}
    with RankPool(2) as pool:
        pool.run(_build_ranked, EP2_GEMM, sizes, timeout=3600)
        for rows, out, x_grad in pool.run(_ranked_output, timeout=3600):
            assert_close(out, want_out[:, rows], rtol=1e-5, atol=1e-5, msg="ep 2")
            assert_close(x_grad, want_grad[:, rows], rtol=1e-5, atol=1e-5, msg="ep 2")
        for measured in [False] + [True] * rounds:
            for name, step in steps_by_name.items():
                got = timed(step, steps if measured else WARMUP)
                times[name] += got if measured else []
            per_rank = pool.run(_time_ranked, steps if measured else WARMUP, timeout=3600)
            times[EP2] += [max(t) for t in zip(*per_rank, strict=True)] if measured else []
    report(sizes, rounds, steps, times)
    print(f"stacking the {sizes[1]} experts' weights (both projections), part of each padded or"
          f" grouped step above: {stacking_ms(base):.1f} ms")
    return 0


def report(sizes, rounds: int, steps: int, times: dict[str, list[float]]) -> None:
    h, e, k, f, tokens = sizes
    print(f"command: python benchmarks/bench_moe.py {' '.join(sys.argv[1:])}")
    print(f"layer: hidden {h}, {e} SwiGLU experts of width {f}, top-{k} (softmax, renormalised),"
          f" dropless, {tokens} tokens, fp32, forward + backward")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; 1 process: 2 threads; ep 2: 2 gloo"
          f" ranks x 1 thread, {tokens // 2} tokens each; {rounds} rounds x {steps} steps,"
          " contenders alternating; outputs and input gradients equal transformers' (1e-5)")
    baseline = statistics.median(times["transformers grouped_mm"])
    one = statistics.median(times[f"meshtrain {EP2_GEMM}"])
    print(f"\n{'contender':28} {'median ms':>10} {'/ transformers grouped_mm':>26}")
    for name, ts in times.items():
        median = statistics.median(ts)
        print(f"{name:28} {median * 1e3:10.1f} {median / baseline:26.2f}")
    ep2 = statistics.median(times[EP2])
    print(f"\nep 2 step / one-process step (meshtrain {EP2_GEMM}): {ep2 / one:.2f}")
