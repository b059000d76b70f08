"""Issue 27's GPU check of masked attention: a window or document mask runs flex_attention over a
block mask on CUDA, never a dense s x s mask. One prepared script, under 3 minutes on one GPU:

    python benchmarks/gpu_mask_check.py

1. parity (fp32, TF32 off, s 256-384): the attention core on CUDA (which must pick "flex")
   against a dense masked fp32 reference, the output and the gradients of q, k and v: a window
   with grouped-query heads, documents, and both over cached keys (k_start > 0, s != t);
2. memory (b 1, 8 heads, d 64, s 32768, bf16, window 4096 and documents): the peak of one
   forward + backward, its block mask built inside, above the inputs, against the s x s bytes
   of one dense bool mask (1 GiB): it must stay under a quarter of that;
3. time: the same forward + backward with flex and with SDPA under the dense bool mask (median
   of 5), and the largest difference of their outputs (bf16).
Every check prints a PASS or FAIL line and the run exits 1 on any failure. Without CUDA it prints
"SKIPPED: no CUDA device" and exits 0: nothing was checked.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.layers.attention import AttentionCore, attention_kernel
from meshtrain.parallel.layers.masks import AttentionMask

PARITY = {  # name: (window, documents, key/value heads, queries, keys, k_start)
    "window-gqa": (64, False, 2, 256, 256, 0),
    "documents": (None, True, 8, 256, 256, 0),
    "both-cached-gqa": (64, True, 2, 256, 384, 200),
}
LARGE_S, LARGE_WINDOW, HEADS, HEAD_DIM = 32768, 4096, 8, 64


def _core() -> AttentionCore:
    return AttentionCore(dropout=0.0, eager=False, cp_axis=ParallelMesh.local().cp,
                         cp_mode="ring", recompute=False)


def _documents(length: int, mean: int, seed: int) -> torch.Tensor:
    """`[1, length]` document ids of documents about `mean` tokens long."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(1, length, generator=g) < 1.0 / mean
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=-1).cuda()


def _reference(q, k, v, mask: AttentionMask, k_start: int) -> torch.Tensor:
    """softmax(QK^T/sqrt(d) masked)V with the dense mask, key/value heads repeated."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    k_pos = torch.arange(k_start, k_start + k.shape[-2], device=q.device)
    allowed = mask.allowed(k_pos[len(k_pos) - q.shape[-2]:], k_pos)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v


def _forward_backward(attend, inputs, grad_out) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and the gradients of `inputs` under `grad_out`."""
    for t in inputs:
        t.grad = None
    out = attend(*inputs)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in inputs]


def check_parity(name: str) -> bool:
    window, documents, kv_heads, s, t, k_start = PARITY[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, HEADS, s, HEAD_DIM, device="cuda", generator=g).requires_grad_()
    k, v = (torch.randn(2, kv_heads, t, HEAD_DIM, device="cuda", generator=g).requires_grad_()
            for _ in range(2))
    grad_out = torch.randn(2, HEADS, s, HEAD_DIM, device="cuda", generator=g)
    docs = torch.cat([_documents(k_start + t, 60, seed) for seed in (1, 2)]) if documents \
        else None
    mask = AttentionMask(window, docs)
    kernel = attention_kernel(q.device, mask, 0.0, s, t)
    core = _core()
    flex = _forward_backward(lambda *x: core(*x, None, mask, k_start), [q, k, v], grad_out)
    dense = _forward_backward(lambda *x: _reference(*x, mask, k_start), [q, k, v], grad_out)
    errors = [(a - b).abs().max().item()
              for a, b in zip([flex[0], *flex[1]], [dense[0], *dense[1]], strict=True)]
    ok = kernel == "flex" and max(errors) < 1e-4
    print(f"{'PASS' if ok else 'FAIL'} parity {name}: kernel {kernel}, max |error| out "
          f"{errors[0]:.1e}, dq {errors[1]:.1e}, dk {errors[2]:.1e}, dv {errors[3]:.1e} "
          "(fp32, limit 1e-4)")
    return ok


def _large_inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, HEADS, LARGE_S, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
               .requires_grad_() for _ in range(3))
    return [q, k, v], torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)


def _large_mask() -> AttentionMask:
    return AttentionMask(LARGE_WINDOW, _documents(LARGE_S, 6000, 3))


def _flex_large(q, k, v):
    """A new mask per call, so its block mask is built (and timed) here, as once per forward
    in a model."""
    return _core()(q, k, v, None, _large_mask())


def _dense_large(q, k, v):
    positions = torch.arange(LARGE_S, device="cuda")
    return F.scaled_dot_product_attention(q, k, v,
                                          attn_mask=_large_mask().allowed(positions, positions))


def _peak_above(fn, inputs, grad_out) -> tuple[int, torch.Tensor]:
    """Peak allocated bytes above what was allocated before one forward + backward of `fn`."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, _ = _forward_backward(fn, inputs, grad_out)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


def _median_ms(fn, inputs, grad_out, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _forward_backward(fn, inputs, grad_out)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def check_large() -> bool:
    inputs, grad_out = _large_inputs()
    kernel = attention_kernel(inputs[0].device, _large_mask(), 0.0, LARGE_S, LARGE_S)
    _forward_backward(_flex_large, inputs, grad_out)  # compiles
    peak, flex_out = _peak_above(_flex_large, inputs, grad_out)
    dense_bytes = LARGE_S * LARGE_S
    ok = kernel == "flex" and peak < dense_bytes / 4
    print(f"{'PASS' if ok else 'FAIL'} memory s {LARGE_S}: kernel {kernel}, peak "
          f"{peak / 2**20:.0f} MiB above the inputs for forward + backward, one dense bool "
          f"mask {dense_bytes / 2**20:.0f} MiB (limit a quarter of it)")
    flex_ms = _median_ms(_flex_large, inputs, grad_out)
    try:
        dense_peak, dense_out = _peak_above(_dense_large, inputs, grad_out)
        dense_ms = _median_ms(_dense_large, inputs, grad_out)
    except torch.OutOfMemoryError:
        print(f"INFO time s {LARGE_S}: flex {flex_ms:.1f} ms forward + backward; SDPA with the "
              "dense mask ran out of memory")
        return ok
    difference = (flex_out.float() - dense_out.float()).abs().max().item()
    same = difference < 2e-2
    print(f"{'PASS' if same else 'FAIL'} flex against the dense mask at s {LARGE_S}: max "
          f"|difference| {difference:.1e} (bf16, limit 2e-2)")
    print(f"INFO time s {LARGE_S} forward + backward (median of 5): flex {flex_ms:.1f} ms, "
          f"SDPA with the dense mask {dense_ms:.1f} ms ({dense_ms / flex_ms:.1f}x); SDPA's "
          f"peak {dense_peak / 2**20:.0f} MiB above the inputs")
    return ok and same


def _run(name: str, check, *args) -> bool:
    """One check; an exception is its failure, and the others still run."""
    torch.compiler.reset()  # each check compiles afresh (static shapes, no recompile limit)
    started = time.perf_counter()
    try:
        ok = check(*args)
    except Exception:  # every failure is reported, then the run exits non-zero
        traceback.print_exc()
        print(f"FAIL {name}: raised (above)")
        ok = False
    print(f"  ({name}: {time.perf_counter() - started:.0f} s)")
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA device (gpu_mask_check checks the GPU's flex_attention path; "
              "nothing was checked)")
        return 0
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    torch.set_float32_matmul_precision("highest")  # no TF32: parity compares fp32 with fp32
    results = [_run(f"parity {name}", check_parity, name) for name in PARITY]
    results.append(_run("memory and time", check_large))
    print("ALL PASSED" if all(results) else f"FAILED {results.count(False)} of {len(results)}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
