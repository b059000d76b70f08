"""Measure the machine this runs on and fit a `Hardware` profile to it, for the backend in use.

Every number is measured with `ranks` processes running at once (one thread each on a CPU, one
device each on CUDA), so it describes one rank of a run of that many ranks sharing the host: on
a 2-core machine, 4 ranks share 2 cores, and that is the machine the planner predicts. The fits
are the cost model's own formulas, so a calibrated profile predicts the measured times back:

- matmul, `costs._matmul`: t(w) = w / (peak x eff(w)), eff(w) = E x w / (w + H), w in GFLOP.
  peak is the best rate of its dtype (bf16: `peak_tflops`, fp32: `fp32_peak_tflops`, fp16:
  `fp16_peak_tflops`); then
  t(w) = (w + H) / (peak x E) is linear in 1/E and H/E, fitted over every shape of both dtypes
  by least squares on the relative error (`matmul_efficiency` = E, `matmul_half_gflop` = H).
- memory: bytes moved / time of large elementwise adds and copies (`memory_efficiency` 1).
- collectives, `collectives.py`: t = steps x alpha + moved / bandwidth, with each op's steps and
  bytes moved per rank taken from that module; alpha and 1/bandwidth by least squares on the
  relative error (`network_efficiency` 1; one host: intra-node = inter-node bandwidth).
- overlap: an all-reduce started asynchronously behind W seconds of matmuls ends X seconds late;
  the cost model's exposed = comm - overlap x W gives overlap = (comm - X) / W, clamped to [0, 1].
- a real layer: a small transformer layer's forward + backward at two micro-batch sizes, every
  rank at once, t(b) = 3 x overhead + k x the model's compute (the overhead charged once in the
  forward and twice in the backward): k rescales the compute rates fitted above (what a layer
  adds around its matmuls: small kernels, autograd, contention), the rest is
  `layer_overhead_s`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.models import TransformerConfig, get_family
from meshtrain.parallel.communication import comm
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.runtime.process_groups import destroy_parallel, free_port, init_parallel
from meshtrain.parallelize import build_model
from meshtrain.planner import collectives as coll
from meshtrain.planner.costs import chunk_costs
from meshtrain.planner.hardware import COLLECTIVE_STEPS, Hardware
from meshtrain.planner.run_fit import scaled
from meshtrain.planner.workload import Workload

MATMUL_SHAPES = ((128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
                 (512, 128, 384), (512, 128, 512), (512, 512, 128), (2048, 256, 1024),
                 (2048, 1024, 256))
"""(m, k, n): squares, and a small transformer's QKV, MLP and their backward shapes."""
QUICK_MATMUL_SHAPES = ((128, 128, 128), (512, 512, 512), (512, 128, 384), (2048, 256, 1024))
COLLECTIVE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
QUICK_COLLECTIVE_BYTES = (4 << 10, 8 << 20)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send")
_GPT = get_family("gpt").config
LAYER = {"cpu": _GPT(num_layers=1, hidden_size=128, num_heads=4, vocab_size=64, max_seq_len=128),
         "cuda": _GPT(num_layers=1, hidden_size=1024, num_heads=16, vocab_size=64,
                      max_seq_len=1024)}
"""The transformer layer timed as training runs it, per device: a small model's on a CPU (made
and built through the family registry and `build_model`, as a run's model is)."""
LAYER_BATCHES = (1, 4)
"""Micro-batches the layer is timed at: the host overhead is what does not grow with them."""
MAX_CALLS = 2000
TIMEOUT = datetime.timedelta(seconds=120)


class CalibrationError(ValueError):
    """Measurements no profile can be fitted to (a host too busy to time its collectives). A
    `ValueError`, as it was before it had its own type: the command line ends it with exit code 2
    and its one line."""


def calibrate_machine(*, ranks: int = 4, quick: bool = False,
                      report: Callable[[str], None] | None = None) -> Hardware:
    """Measure this machine with `ranks` ranks at once and fit a profile (~40 s; quick ~10 s
    with fewer sizes and shorter timings). `report` receives one line per fitted quantity."""
    if not isinstance(ranks, int) or ranks < 2:
        raise SettingError(Code.RANGE,
                           f"`ranks` must be an integer of at least 2 (collectives need a"
                           f" group), got {ranks!r}")
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < ranks:
        raise SettingError(Code.CALIBRATE_DEVICES,
                           f"`ranks` {ranks} exceeds the {torch.cuda.device_count()} CUDA devices"
                           " (one rank per device)")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_main, args=(ranks, free_port(), quick, results), nprocs=ranks,
                       start_method="spawn")
    return fit_profile(results.get(), ranks=ranks, report=report)


@dataclasses.dataclass(frozen=True)
class _Rank:
    """What every measurement needs: the device, how to wait for it, and how long to time."""

    device: torch.device
    world: MeshAxis
    """Every rank: where the timings are agreed."""
    budget_s: float
    """Seconds one round spends timing one thing."""
    rounds: int

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_each(self, fns: dict) -> dict:
        """Seconds per call of each of `fns`, averaged over the ranks, median over rounds. The
        rounds take the functions in turn, so a burst of load on a shared host lands on every
        one of them rather than skewing the fits."""
        times = {key: [] for key in fns}
        for _ in range(self.rounds):
            for key, fn in fns.items():
                times[key].append(self.timed(fn))
        return {key: statistics.median(t) for key, t in times.items()}

    def timed(self, fn: Callable[[], object]) -> float:
        """Seconds per call of `fn`, averaged over the ranks. Every rank makes the same number
        of calls (agreed from one timed warm-up call), so collectives in `fn` stay matched."""
        start = time.perf_counter()
        fn()
        self.sync()
        first = self.world_max(time.perf_counter() - start)
        calls = max(2, min(MAX_CALLS, int(self.budget_s / max(first, 1e-7))))
        comm.barrier(self.world)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        self.sync()
        return self.world_mean((time.perf_counter() - start) / calls)

    def world_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return comm.all_gather(t, self.world).max().item()

    def world_mean(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        comm.all_reduce(t, self.world)
        return t.item() / self.world.size


def _rank_main(rank: int, ranks: int, port: int, quick: bool, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
    # tp pairs neighbouring ranks: the groups of 2 timed side by side (odd ranks: none)
    mesh = init_parallel(tp=2 if ranks % 2 == 0 else 1, timeout=TIMEOUT)
    device = mesh.device
    try:
        r = _Rank(device, mesh.axis("world"), budget_s=0.03 if quick else 0.08,
                  rounds=2 if quick else 3)
        shapes = QUICK_MATMUL_SHAPES if quick else MATMUL_SHAPES
        sizes = QUICK_COLLECTIVE_BYTES if quick else COLLECTIVE_BYTES
        measured = {
            "backend": comm.backend(r.world), "device": device.type,
            "memory_bytes": _device_memory(device), "cores": os.cpu_count() or 1,
            "matmul": _time_matmuls(r, shapes),
            "elementwise": _time_elementwise(r, 1 << (22 if quick else 23)),
            "collectives": _time_collectives(r, mesh.axis("tp"), sizes),
            "overlap": _time_overlap(r, (1 if quick else 4) << 20),
            "layer": _time_layer(r),
            "attention": _time_attention(r),
        }
        if rank == 0:
            results.put(measured)
    finally:
        destroy_parallel()


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Each precision's matmuls are timed: a CPU without fp16 units prices fp16 as it runs it."""


FP16_SHAPES = ((128, 128, 128), (512, 128, 384))
"""fp16's few shapes: enough for its peak, small enough where it is emulated (this CPU: 0.4
GFLOP/s, a hundredth of bf16's); the efficiency curve is fitted on fp32 and bf16."""


def _time_matmuls(r: _Rank, shapes: tuple[tuple[int, int, int], ...]) -> list[tuple]:
    """(dtype, (m, k, n), seconds) of `[m, k] @ [k, n]` in each dtype."""
    fns = {}
    for dtype, torch_dtype in DTYPES.items():
        for m, k, n in FP16_SHAPES if dtype == "fp16" else shapes:
            a = torch.randn(m, k, device=r.device).to(torch_dtype)
            b = torch.randn(k, n, device=r.device).to(torch_dtype)
            fns[dtype, (m, k, n)] = lambda a=a, b=b: a @ b
    return [(*key, t) for key, t in r.timed_each(fns).items()]


def _time_elementwise(r: _Rank, numel: int) -> list[tuple[float, float]]:
    """(bytes moved, seconds) of an add (two reads, one write) and a copy (one each)."""
    a, b, out = (torch.randn(numel, device=r.device) for _ in range(3))
    t = r.timed_each({3: lambda: torch.add(a, b, out=out), 2: lambda: out.copy_(a)})
    return [(passes * numel * 4, seconds) for passes, seconds in t.items()]


def _time_collectives(r: _Rank, pairs: MeshAxis, sizes: tuple[int, ...]) -> list[tuple]:
    """(op, group size, bytes, seconds) for groups of 2 (`pairs`: every pair at once, as
    tensor-parallel groups run side by side; none when it has one rank) and of all ranks; sends
    go around the group's ring. Each is timed after a burst of matmuls, as a step's collectives
    follow its compute, less the burst alone: on a CPU shared by more ranks than cores a
    collective's partner may not be running when it arrives, which a tight loop of collectives
    alone, its ranks in lock-step, never shows."""
    axes = {axis.size: axis for axis in (pairs, r.world) if axis.size > 1}  # 2 ranks: one
    burst = _burst(r, BURST_S)
    fns = {(op, axis.size, nbytes): _collective(op, nbytes, axis, r.device)
           for axis in axes.values() for op in COLLECTIVES for nbytes in sizes}
    t = r.timed_each({"burst": burst} | {key: lambda fn=fn: (burst(), fn())
                                          for key, fn in fns.items()})
    return [(*key, max(t[key] - t["burst"], 1e-7)) for key in fns]


BURST_S = 2e-3
"""Compute before each timed collective: about a small layer's forward on a CPU rank."""


def _burst(r: _Rank, seconds: float) -> Callable[[], None]:
    """Matmuls taking about `seconds` on every rank at once."""
    a = torch.randn(128, 128, device=r.device)
    count = max(1, round(seconds / r.timed(lambda: a @ a)))

    def burst() -> None:
        for _ in range(count):
            a @ a
    return burst


def _collective(op: str, nbytes: int, axis: MeshAxis,
                device: torch.device) -> Callable[[], None]:
    """One call of `op` on `nbytes` (the full tensor, as `collectives.py` counts it) over
    `axis`, into buffers made once (a send is one step of the axis's ring)."""
    g = axis.size
    full = torch.ones(nbytes // 4, device=device)
    part = torch.ones(nbytes // 4 // g, device=device)
    if op == "all_reduce":
        return lambda: comm.all_reduce(full, axis)
    if op == "all_gather":
        return lambda: comm.all_gather_into(full[:part.numel() * g], part, axis)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter_into(part, full[:part.numel() * g], axis)
    received = torch.empty_like(full)
    return lambda: comm.ring_exchange([full], [received], axis).wait()


def _time_overlap(r: _Rank, nbytes: int) -> dict[str, float]:
    """An all-reduce over every rank alone, matmuls filling about half its time alone, and the
    two together (the all-reduce started asynchronously first, as gradient buckets are)."""
    grads = torch.ones(nbytes // 4, device=r.device)
    a = torch.randn(256, 256, device=r.device)

    def reduce() -> None:
        comm.all_reduce(grads, r.world)
    first = r.timed_each({"comm": reduce, "one": lambda: a @ a})
    count = max(1, round(first["comm"] / 2 / first["one"]))

    def compute() -> None:
        for _ in range(count):
            a @ a

    def both() -> None:
        work = comm.all_reduce(grads, r.world, async_op=True)
        compute()
        work.wait()
    return r.timed_each({"comm": reduce, "compute": compute, "both": both})


def _time_layer(r: _Rank) -> dict[int, float]:
    """Forward + backward seconds of `LAYER`'s transformer layer at each of LAYER_BATCHES,
    every rank at once (on a shared CPU, under the contention of a data-parallel step)."""
    cfg = LAYER[r.device.type]
    model = build_model(cfg, ParallelMesh.local(r.device))
    layer = model.layers["0"]
    s, h = cfg.max_seq_len, cfg.hidden_size
    positions = torch.arange(s, device=r.device)
    fns = {}
    for b in LAYER_BATCHES:
        x = torch.randn(b, s, h, device=r.device, requires_grad=True)
        grad = torch.ones(b, s, h, device=r.device)
        fns[b] = lambda x=x, grad=grad: layer(x, model.rng, positions,
                                              AuxiliaryOutputs()).backward(grad)
    return r.timed_each(fns)


def _time_attention(r: _Rank) -> dict[str, float]:
    """Forward and backward seconds of a causal SDPA core (the ratio the cost model needs)."""
    q, k, v = (torch.randn(2, 4, 256, 32, device=r.device, requires_grad=True)
               for _ in range(3))
    core = torch.nn.functional.scaled_dot_product_attention
    grad = torch.ones(2, 4, 256, 32, device=r.device)
    t = r.timed_each({"forward": lambda: core(q, k, v, is_causal=True),
                      "both": lambda: core(q, k, v, is_causal=True).backward(grad)})
    return {"forward": t["forward"], "backward": t["both"] - t["forward"]}


def fit_profile(measured: dict, *, ranks: int,
                report: Callable[[str], None] | None = None) -> Hardware:
    """The profile whose cost formulas best reproduce what the ranks measured."""
    say = report or (lambda line: None)
    peaks = {d: max(_gflop(shape) / t for dt, shape, t in measured["matmul"] if dt == d)
             for d in ("fp32", "bf16")}  # GFLOP/s
    efficiency, half = _fit_matmul(measured["matmul"], peaks, say)
    peaks["fp16"] = _fit_peak([row for row in measured["matmul"] if row[0] == "fp16"],
                              efficiency, half, say)
    moved, seconds = (sum(col) for col in zip(*measured["elementwise"], strict=True))
    gloo = measured["backend"] == "gloo"
    alpha, link, counting = _fit_collectives(measured["collectives"], gloo, say)
    a = measured["attention"]
    ratio = max(1.0, a["backward"] / a["forward"])
    say(f"attention core: forward {a['forward'] * 1e6:.0f} us, backward"
        f" {a['backward'] * 1e6:.0f} us -> attention_backward_ratio {ratio:.3g}")
    o = measured["overlap"]
    overlap = min(1.0, max(0.0, (o["comm"] - (o["both"] - o["compute"])) / o["compute"]))
    say(f"overlap: all-reduce {o['comm'] * 1e3:.2f} ms, matmuls {o['compute'] * 1e3:.2f} ms,"
        f" together {o['both'] * 1e3:.2f} ms -> overlap_efficiency {overlap:.3g}")
    cpu = measured["device"] == "cpu"
    hardware = Hardware(
        name=f"{measured['device']}-{measured['backend']}", peak_tflops=peaks["bf16"] / 1e3,
        hbm_gib=measured["memory_bytes"] / (ranks if cpu else 1) / 2**30, gpus_per_node=ranks,
        intra_node_gbytes_per_s=link / 1e9, inter_node_gbytes_per_s=link / 1e9,
        fp32_peak_tflops=peaks["fp32"] / 1e3, fp16_peak_tflops=peaks["fp16"] / 1e3,
        calibrated_ranks=ranks, hbm_gbytes_per_s=moved / seconds / 1e9,
        matmul_efficiency=efficiency, matmul_half_gflop=half, memory_efficiency=1.0,
        network_efficiency=1.0, collective_latency_s=alpha, overlap_efficiency=overlap,
        attention_backward_ratio=ratio, reduce_scatter_all_reduces=gloo,
        collective_steps=counting, default_precision="fp32" if cpu else "bf16",
        oversubscription=max(1.0, ranks / measured["cores"]) if cpu else 1.0)
    return _rounded(_fit_layer(hardware, measured["layer"], measured["device"], say))


def check_physical(hardware: Hardware) -> None:
    """Refuse a fitted profile no machine can have: a matmul efficiency outside (0, 1] (faster
    than the fastest matmul timed) or a collective latency of zero or less."""
    wrong = []
    if not 0 < hardware.matmul_efficiency <= 1:
        wrong.append(f"matmul_efficiency {hardware.matmul_efficiency:.3g} (not in (0, 1])")
    if not hardware.collective_latency_s > 0:
        wrong.append(f"collective_latency_s {hardware.collective_latency_s:.3g} (not > 0)")
    if wrong:
        raise CalibrationError(f"calibration: the fit gives {' and '.join(wrong)}, which no"
                               " machine has: other work on the host disturbed the timings;"
                               " nothing written, calibrate again when it is quieter")


def _fit_layer(hardware: Hardware, times: dict[int, float], device: str,
               say: Callable[[str], None]) -> Hardware:
    """Scale the fitted compute rates and set `layer_overhead_s` so that a real layer's
    forward + backward at each micro-batch, t(b) = 3 x overhead + k x modelled compute(b),
    is predicted: the two batches give k and the overhead (the matmuls timed alone miss what
    a layer adds around them: many small kernels, autograd, the other ranks' contention)."""
    (b1, t1), (b2, t2) = sorted(times.items())
    c1, c2 = (_layer_compute(hardware, LAYER[device], b) for b in (b1, b2))
    k = (t2 - t1) / (c2 - c1) if c2 > c1 else t2 / c2
    k = k if k > 0 else t2 / c2
    overhead = max(0.0, (t1 - k * c1) / 3)
    say(f"layer (hidden {LAYER[device].hidden_size}, seq {LAYER[device].max_seq_len}):"
        f" forward + backward {t1 * 1e3:.2f} ms at micro-batch {b1}, {t2 * 1e3:.2f} ms at {b2};"
        f" modelled compute {c1 * 1e3:.2f} / {c2 * 1e3:.2f} ms -> compute x{1 / k:.3g},"
        f" layer_overhead_s {overhead:.3g}")
    return dataclasses.replace(scaled(hardware, 1 / k, 1.0), layer_overhead_s=overhead)


def _gflop(shape: tuple[int, int, int]) -> float:
    m, k, n = shape
    return 2 * m * k * n / 1e9


def _fit_matmul(rows: list[tuple], peaks: dict[str, float],
                say: Callable[[str], None]) -> tuple[float, float]:
    """E and H of t(w) = (w + H) / (peak x E): linear in 1/E and H/E."""
    points = [(_gflop(shape) / peaks[d], 1 / peaks[d], t) for d, shape, t in rows
              if d != "fp16"]
    inverse, half_over = _relative_least_squares(points)
    efficiency, half = 1 / inverse, half_over / inverse
    for d in peaks:
        say(f"matmul {d}: best {peaks[d]:.1f} GFLOP/s; " + ", ".join(
            f"{'x'.join(map(str, shape))} {_gflop(shape) / t:.1f}" for dt, shape, t in rows
            if dt == d))
    say(f"matmul fit: matmul_efficiency {efficiency:.3g}, matmul_half_gflop {half:.3g}, worst"
        f" time error {_worst_error(points, inverse, half_over):.0%}")
    return efficiency, half


def _fit_peak(rows: list[tuple], efficiency: float, half: float,
              say: Callable[[str], None]) -> float:
    """The peak (GFLOP/s) under which the fitted curve t(w) = (w + H) / (peak x E) predicts
    these rows' times best (their mean relative rate), for a dtype timed on a few shapes."""
    peak = statistics.fmean((_gflop(shape) + half) / (t * efficiency) for _, shape, t in rows)
    say(f"matmul {rows[0][0]}: " + ", ".join(f"{'x'.join(map(str, shape))}"
                                             f" {_gflop(shape) / t:.2f}" for _, shape, t in rows)
        + f" GFLOP/s -> peak {peak:.3g} GFLOP/s on the fitted curve")
    return peak


UNIT_LATENCY = Hardware(name="steps", peak_tflops=1.0, hbm_gib=1.0, gpus_per_node=1 << 20,
                        intra_node_gbytes_per_s=float("inf"), inter_node_gbytes_per_s=1.0,
                        network_efficiency=1.0, collective_latency_s=1.0)
"""Prices each collective step at one second and bytes at nothing: the model's step count."""
UNIT_BYTES = dataclasses.replace(UNIT_LATENCY, name="bytes", intra_node_gbytes_per_s=1e-9,
                                 collective_latency_s=0.0)
"""Prices each byte at one second and steps at nothing: the model's bytes moved per rank."""
MODEL = {"all_reduce": coll.all_reduce, "all_gather": coll.all_gather,
         "reduce_scatter": coll.reduce_scatter,
         "send": lambda hw, nbytes, group, span: coll.send(hw, nbytes, span)}


def _fit_collectives(rows: list[tuple], all_reduces: bool,
                     say: Callable[[str], None]) -> tuple[float, float, str]:
    """alpha and the bandwidth (bytes/s) of t = steps x alpha + moved / bandwidth, fitted on
    every collective but reduce-scatter under each way of counting steps (`collective_steps`:
    the one with the smaller squared relative error is kept). Reduce-scatter is priced by the
    fit (as the all-reduce it runs where the backend has none of its own, `all_reduces`: gloo)
    and its error reported: on gloo its timings also hold a copy of the whole tensor, and
    they are the noisiest of the four."""
    fits = {}
    for counting in COLLECTIVE_STEPS:
        latency = dataclasses.replace(UNIT_LATENCY, collective_steps=counting,
                                      reduce_scatter_all_reduces=all_reduces)
        per_byte = dataclasses.replace(UNIT_BYTES, reduce_scatter_all_reduces=all_reduces)
        points = {scatter: [(MODEL[op](latency, n, g, g), MODEL[op](per_byte, n, g, g), t)
                            for op, g, n, t in rows if (op == "reduce_scatter") == scatter]
                  for scatter in (False, True)}
        alpha, beta = _relative_least_squares(points[False])
        error = sum(((alpha * p + beta * q) / t - 1) ** 2 for p, q, t in points[False])
        fits[counting] = (error, alpha, beta, points)
    counting = min(fits, key=lambda c: fits[c][0])
    _, alpha, beta, points = fits[counting]
    if beta <= 0:
        raise CalibrationError("calibration: the collectives' times did not grow with their"
                               " bytes, so no bandwidth can be fitted (the host was too busy to"
                               " time them); calibrate again when it is quieter")
    for op in COLLECTIVES:
        say(f"{op}: " + ", ".join(f"g{g} {n >> 10} KiB {t * 1e3:.3f} ms" for o, g, n, t in rows
                                  if o == op))
    say(f"collective fit: collective_steps {counting} (squared error "
        + ", ".join(f"{c} {fits[c][0]:.3g}" for c in fits) + f"), collective_latency_s"
        f" {alpha:.3g}, bandwidth {1e-9 / beta:.3g} GB/s, worst time error"
        f" {_worst_error(points[False], alpha, beta):.0%}; reduce-scatter priced as"
        f" {'an all-reduce' if all_reduces else 'an all-gather'}: worst time error"
        f" {_worst_error(points[True], alpha, beta):.0%}")
    return alpha, 1 / beta, counting


def _relative_least_squares(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """x, y >= 0 minimising sum((x p + y q) / t - 1)^2 over (p, q, t): the normal equations,
    or the best one-term fit when the pair would need a negative term."""
    a = [(p / t, q / t) for p, q, t in points]
    saa, sbb = sum(u * u for u, _ in a), sum(v * v for _, v in a)
    sab, sa, sb = sum(u * v for u, v in a), sum(u for u, _ in a), sum(v for _, v in a)
    det = saa * sbb - sab * sab
    if det > 0:
        x, y = (sa * sbb - sb * sab) / det, (sb * saa - sa * sab) / det
        if x >= 0 and y >= 0:
            return x, y
    ends = [(sa / saa, 0.0)] if saa > 0 else []
    ends += [(0.0, sb / sbb)] if sbb > 0 else []
    return min(ends, key=lambda xy: sum((xy[0] * u + xy[1] * v - 1) ** 2 for u, v in a))


def _worst_error(points: list[tuple[float, float, float]], x: float, y: float) -> float:
    return max((abs((x * p + y * q) / t - 1) for p, q, t in points), default=0.0)


def _layer_compute(hardware: Hardware, cfg: TransformerConfig, batch: int) -> float:
    """The cost model's forward + backward compute of `cfg`'s layer at micro-batch `batch`,
    host overhead left out: a one-chunk model with two layers minus with one (embedding and
    head cancel)."""
    hardware = dataclasses.replace(hardware, layer_overhead_s=0.0)

    def chunk(layers: int) -> float:
        model = dataclasses.replace(cfg, num_layers=layers)
        work = Workload(model, ParallelPlan(dp=1, micro_batch=batch), model.max_seq_len, batch,
                        "fp32")
        cost = chunk_costs(work, hardware)[0]
        return cost.forward + cost.backward
    return chunk(2) - chunk(1)


def _rounded(hardware: Hardware) -> Hardware:
    """Four significant digits: more would only record the noise."""
    return dataclasses.replace(hardware, **{
        f.name: float(f"{getattr(hardware, f.name):.4g}") for f in dataclasses.fields(hardware)
        if isinstance(getattr(hardware, f.name), float)})
