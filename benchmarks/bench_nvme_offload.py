"""ZeRO optimizer states offloaded to NVMe against CPU offload, on one rank.

Per target (cpu, nvme) a fresh process trains a GPT a few steps at `--zero 1` and reports the
median step time, the time of the optimizer step, and the peak resident memory (the kernel's
VmHWM). For nvme it also reports the bytes read and written per step and their rate over the
optimizer step, beside the disk's sequential read and write bandwidth measured in the same run on
the same folder (one file, 8 MiB direct transfers where the filesystem allows, else buffered
with fsync; a buffered read may be served by the page cache: the line says which). The check of
every read against the run's last write (CRC-32 per 8 MiB chunk) is measured side by side: the
same nvme run with the check off (`nvme-unchecked`, `NvmeStore.verify = False`).

The memory formula: nvme holds no master shard, no moments and no full fp32 gradient copy
between or during steps (CPU offload makes the copy for the step), only a window of slabs:
    saved = 12 P / N + 4 P / N - WINDOW x 12 x (largest bucket shard)

    python benchmarks/bench_nvme_offload.py                       # hidden 768, 6 layers
    python benchmarks/bench_nvme_offload.py --quick               # a smoke run
    python benchmarks/bench_nvme_offload.py --check-only          # the read check's cost alone
    python benchmarks/bench_nvme_offload.py --dir /mnt/nvme/tmp   # the disk to measure
    python benchmarks/bench_nvme_offload.py --deepspeed /tmp/ds_venv/bin/python  # + ZeRO-Infinity
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))


def sequential_bandwidth(folder: Path, nbytes: int) -> dict:
    """GB/s writing then reading one file in 8 MiB transfers, direct I/O where allowed."""
    chunk = 8 * 2**20
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(chunk))
    path = folder / "sequential.bin"
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | direct, 0o600)
    except OSError:
        fd, direct = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600), 0
    try:
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.pwritev(fd, [buffer], offset)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        for offset in range(0, nbytes, chunk):
            os.preadv(fd, [buffer], offset)
        read = nbytes / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)
        path.unlink()
    return {"write_GBps": write, "read_GBps": read, "direct": bool(direct)}


def check_cost(folder: Path, nbytes: int, rounds: int) -> dict:
    """Seconds per pass over a store of `nbytes` of states (every bucket read, stepped by a
    no-op and written back, as an optimizer step does) with the read check on and off, in
    alternating rounds on the same files (a shared host's load then weighs on both alike)."""
    import torch

    from meshtrain.parallel.runtime.nvme_offload import STATE_BYTES, NvmeStore

    shard = 8 * 2**20 // 4  # the benchmark's --bucket-mb 8 of fp32 values
    sizes = [shard] * max(1, nbytes // (STATE_BYTES * shard))
    store = NvmeStore(folder / "check_cost", sizes)
    for k, n in enumerate(sizes):
        store.create(k, torch.randn(n))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for verify in (True, False):
            store.verify = verify
            store.load(0)  # a pass with digests of this setting's writes
            store.release(0, dirty=True)
            store.flush()
            start = time.perf_counter()
            store.prefetch(0)
            for k in range(len(sizes)):
                store.load(k)
                if k + 1 < len(sizes):
                    store.prefetch(k + 1)
                store.release(k, dirty=True)
            store.flush()
            times[verify].append(time.perf_counter() - start)
    moved = 2 * sum(store.nbytes)
    store.close()
    return {"bytes": moved, "on": statistics.median(times[True]),
            "off": statistics.median(times[False])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(target: str, folder: str, quick: bool, steps: int, zero: int) -> dict:
    """One target's run in this process; prints its figures as JSON."""
    import torch

    from meshtrain.config.run_config import build_config
    from meshtrain.parallel.runtime.nvme_offload import NvmeStore
    from meshtrain.parallel.runtime.process_groups import init_parallel
    from meshtrain.training.trainer import Trainer

    label = target
    if target == "nvme-unchecked":
        target, NvmeStore.verify = "nvme", False

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = {"num_layers": 2, "hidden_size": 256, "num_heads": 4} if quick else \
        {"num_layers": 6, "hidden_size": 768, "num_heads": 12}
    parallel = {"device": "cpu", "zero": zero, "bucket_mb": 8.0, "offload_optimizer": target}
    if target == "nvme":
        parallel["offload_dir"] = folder
    with tempfile.TemporaryDirectory() as out:
        cfg = build_config({}, {"model": model, "parallel": parallel, "checkpoint": {"out": out},
                                "train": {"steps": steps, "global_batch": 2, "micro_batch": 2,
                                          "seq_len": 64, "warmup_steps": 1}})
        mesh = init_parallel(dp=1, device="cpu")
        trainer = Trainer.build(cfg, mesh)
        sync = trainer.sync
        optimizer_times = []
        step = sync.step

        def timed_step(lr):
            start = time.perf_counter()
            step(lr)
            optimizer_times.append(time.perf_counter() - start)

        sync.step = timed_step
        times = []
        for s in range(steps):
            start = time.perf_counter()
            trainer.train_step(s)
            times.append(time.perf_counter() - start)
        store = sync.reducers[0].states.files
        # creation wrote every bucket once before the first step
        moved = (store.bytes_read, store.bytes_written - sum(store.nbytes)) if store else (0, 0)
        params = sum(p.numel() for p in trainer.model.parameters())
        window = len(store.slabs) * store.slabs[0].tensor.numel() * 4 if store else 0
        direct = all(store.direct) if store else None
        sync.close()
    hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
               if line.startswith("VmHWM"))
    return {"target": label, "params": params, "step_s": statistics.median(times[1:]),
            "optimizer_s": statistics.median(optimizer_times[1:]), "vmhwm": hwm,
            "read_per_step": moved[0] / steps, "written_per_step": (moved[1] / steps),
            "window": window, "direct": direct}


def deepspeed_child(folder: str, quick: bool, steps: int) -> dict:
    """DeepSpeed ZeRO-Infinity (stage 3, `offload_optimizer.device: nvme`, its `async_io` op)
    on the same GPT and batch, one rank over gloo with its CPU accelerator."""
    import deepspeed
    import torch

    import meshtrain

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    deepspeed.init_distributed(dist_backend="gloo")
    layers, hidden, heads = (2, 256, 4) if quick else (6, 768, 12)
    cfg = meshtrain.GPTConfig(num_layers=layers, hidden_size=hidden, num_heads=heads,
                              vocab_size=256, max_seq_len=64)
    model = meshtrain.build_model(cfg, meshtrain.ParallelMesh.local(), seed=0)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "offload_optimizer": {
                  "device": "nvme", "nvme_path": folder, "pin_memory": False}},
              "aio": {"block_size": 8 * 2**20, "queue_depth": 8, "thread_count": 4},
              "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
    engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 256, (2, 64))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.backward(model.loss(engine(ids), ids))
        engine.step()
        times.append(time.perf_counter() - start)
    hwm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
               if line.startswith("VmHWM"))
    return {"target": "deepspeed", "params": sum(p.ds_numel for p in model.parameters()),
            "step_s": statistics.median(times[1:]), "vmhwm": hwm}


def run_child(target: str, folder: Path, quick: bool, steps: int,
              python: str = sys.executable, zero: int = 1) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parents[1] / "src"),
                                                   env.get("PYTHONPATH")) if p)
    cmd = [python, __file__, "--child", target, "--dir", str(folder), "--steps", str(steps),
           "--zero", str(zero)] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="the disk to offload to")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child")
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--check-only", action="store_true", help="only the read check's cost:"
                        " passes over 491 MiB of states with it on and off, alternating")
    parser.add_argument("--deepspeed", metavar="PYTHON", help="a Python with deepspeed (e.g."
                        " /tmp/ds_venv/bin/python): also ZeRO-3 against ZeRO-Infinity")
    args = parser.parse_args()
    if args.child == "deepspeed":
        print(json.dumps(deepspeed_child(args.dir, args.quick, args.steps)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.quick, args.steps, args.zero)))
        return
    folder = Path(args.dir) / "bench_nvme_offload"
    folder.mkdir(parents=True, exist_ok=True)
    if args.check_only:
        sys.path.insert(0, str(Path(__file__).parents[1] / "src"))  # as the children do
        cost = check_cost(folder, 491 * 2**20, rounds=7)
        extra = cost["on"] - cost["off"]
        print(f"read check: a pass moving {cost['bytes'] / 2**20:.0f} MiB (read + written) takes"
              f" {cost['on']:.3f} s checked, {cost['off']:.3f} s unchecked (medians of 7"
              f" alternating rounds): {extra * 1e3:+.0f} ms, {extra / cost['off']:+.1%}")
        shutil.rmtree(folder, ignore_errors=True)  # the store removed its files
        return
    disk = sequential_bandwidth(folder, (256 if args.quick else 1024) * 2**20)
    print(f"disk {folder}: sequential write {disk['write_GBps']:.2f} GB/s, read"
          f" {disk['read_GBps']:.2f} GB/s ({'direct' if disk['direct'] else 'buffered'} I/O)")
    cpu = run_child("cpu", folder, args.quick, args.steps)
    nvme = run_child("nvme", folder, args.quick, args.steps)
    unchecked = run_child("nvme-unchecked", folder, args.quick, args.steps)
    p = cpu["params"]
    print(f"model: {p / 1e6:.1f}M parameters, zero 1, one rank, {args.steps} steps"
          f" (medians over steps 2..{args.steps})")
    for r in (cpu, nvme, unchecked):
        print(f"  {r['target']:>14}: step {r['step_s']:.3f} s, optimizer step"
              f" {r['optimizer_s']:.3f} s, peak RSS (VmHWM) {r['vmhwm'] / 2**20:.0f} MiB")
    read_rate = nvme["read_per_step"] / nvme["optimizer_s"] / 1e9
    write_rate = nvme["written_per_step"] / nvme["optimizer_s"] / 1e9
    print(f"  nvme files ({'direct' if nvme['direct'] else 'buffered'} I/O): per step"
          f" {nvme['read_per_step'] / 2**20:.0f} MiB read, {nvme['written_per_step'] / 2**20:.0f}"
          f" MiB written; over the optimizer step {read_rate:.2f} GB/s read"
          f" ({read_rate / disk['read_GBps']:.2f}x sequential), {write_rate:.2f} GB/s written"
          f" ({write_rate / disk['write_GBps']:.2f}x sequential)")
    print(f"  step time nvme / cpu: {nvme['step_s'] / cpu['step_s']:.2f}x")
    extra = nvme["optimizer_s"] - unchecked["optimizer_s"]
    print(f"  the read check (CRC-32 of every byte written and read): optimizer step"
          f" {extra * 1e3:+.0f} ms ({extra / unchecked['optimizer_s']:+.1%}), step"
          f" {nvme['step_s'] / unchecked['step_s'] - 1:+.1%}, over"
          f" {(nvme['read_per_step'] + nvme['written_per_step']) / 2**20:.0f} MiB hashed a step")
    formula = 16 * p - nvme["window"]
    saved = cpu["vmhwm"] - nvme["vmhwm"]
    print(f"  peak RSS saved: {saved / 2**20:.0f} MiB measured, formula 16 P - window ="
          f" {formula / 2**20:.0f} MiB (window {nvme['window'] / 2**20:.0f} MiB):"
          f" ratio {saved / formula:.2f}")
    if args.deepspeed:
        runs = {"meshtrain cpu offload": run_child("cpu", folder, args.quick, args.steps, zero=3),
                "meshtrain nvme offload": run_child("nvme", folder, args.quick, args.steps,
                                                    zero=3),
                "DeepSpeed ZeRO-Infinity": run_child("deepspeed", folder, args.quick, args.steps,
                                                     python=args.deepspeed)}
        ours, theirs = runs["meshtrain nvme offload"], runs["DeepSpeed ZeRO-Infinity"]
        print(f"zero 3 ({theirs['params'] / 1e6:.1f}M parameters in DeepSpeed's count):")
        for name, r in runs.items():
            print(f"  {name:>23}: step {r['step_s']:.3f} s, peak RSS {r['vmhwm'] / 2**20:.0f}"
                  " MiB")
        print(f"  step time meshtrain / DeepSpeed: {ours['step_s'] / theirs['step_s']:.2f}x")
    shutil.rmtree(folder)  # DeepSpeed leaves its swap folders


if __name__ == "__main__":
    main()
