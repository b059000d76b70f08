"""Check the CUDA path on a GPU machine: the tp=1 GPT on CUDA equals the CPU model (fp32, TF32
off) in loss and gradients, and a short training run on CUDA lowers the loss.

    python benchmarks/cuda_smoke.py
"""

import time

import torch

from meshtrain import ParallelMesh, preset
from meshtrain.parallel import named_full_tensors
from meshtrain.parallelize import build_model


def main() -> None:
    assert torch.cuda.is_available(), "needs a CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = preset("tiny", vocab_size=251)
    ids = torch.randint(0, 251, (4, 65), generator=torch.Generator().manual_seed(0))
    results = {}
    for device in ("cpu", "cuda"):
        model = build_model(cfg, ParallelMesh.local(device), seed=1)
        x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)
        loss = model.loss(model(x), y)
        loss.backward()
        results[device] = (loss.item(), {n: g.cpu() for n, g in named_full_tensors(model,
                                                                                   grads=True)})
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = results["cpu"], results["cuda"]
    worst = max(((gpu_grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item()
                for n, g in cpu_grads.items())
    print(f"loss cpu {cpu_loss:.7f} cuda {gpu_loss:.7f}; worst relative grad diff {worst:.2e}")
    assert abs(cpu_loss - gpu_loss) / cpu_loss < 1e-5 and worst < 1e-4

    big = build_model(preset("gpt2", vocab_size=50304), ParallelMesh.local("cuda"), seed=0)
    opt = torch.optim.AdamW(big.parameters(), lr=3e-4, fused=True)
    data = torch.randint(0, 50304, (8, 1025), device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        times = []
        for _ in range(8):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                loss = big.loss(big(data[:, :-1]), data[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step_s = sorted(times[3:])[len(times[3:]) // 2]
        flops = 6 * big.cfg.num_parameters() * 8 * 1024 + 12 * 12 * 8 * 1024**2 * 768
        print(f"gpt2 124M, b=8 s=1024, {dtype}: median step {step_s * 1e3:.1f} ms,"
              f" {flops / step_s / 1e12:.1f} TFLOP/s (6*N*tokens + 12*L*b*s^2*h), loss"
              f" {loss.item():.3f}")


if __name__ == "__main__":
    main()
