"""Hardware profiles: what one accelerator and its links can do, and how much of it training
reaches (the efficiency parameters, calibrated against measurements or published runs).

A profile is a built-in name or a TOML file with the same fields (`meshtrain plan calibrate`
writes one for the machine it runs on). Bandwidths are per device, one direction. A profile's
peak is also what a run's MFU is measured against (`model_tflops`, `Hardware.mfu`, and
`device_profile` for the device a run trains on).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from meshtrain.errors import Code, SettingError

PEAK_PRECISIONS = ("fp32", "bf16", "fp16")
"""The precisions a profile gives a matmul peak for."""
COLLECTIVE_STEPS = ("ring", "log")
"""How a profile counts a collective's latency steps (`collectives.steps`)."""


def model_tflops(flops_per_token: float, tokens_per_s: float, devices: int) -> float:
    """Model TFLOP/s per device: the family's `flops_per_token` (forward and backward in
    Megatron-LM's convention, recomputation not counted) x the tokens all `devices` train per
    second, shared among them."""
    return flops_per_token * tokens_per_s / devices / 1e12


@dataclass(frozen=True)
class Hardware:
    """One device type and its interconnect, plus the calibrated efficiency parameters."""

    name: str
    peak_tflops: float
    """Dense 16-bit (bf16/fp16) matmul peak per device: the MFU denominator."""
    hbm_gib: float
    """Device memory per device."""
    gpus_per_node: int
    """Devices joined by the fast intra-node links (tensor parallelism stays inside one node)."""
    intra_node_gbytes_per_s: float
    """Per-device, one-direction bandwidth to devices of the same node."""
    inter_node_gbytes_per_s: float
    """Per-device, one-direction bandwidth to devices of other nodes."""
    fp32_peak_tflops: float = 0.0
    """fp32 matmul peak per device (0: half the 16-bit peak)."""
    fp16_peak_tflops: float = 0.0
    """fp16 matmul peak per device where it differs from bf16's (0: `peak_tflops`; a CPU
    without fp16 units measures its own)."""
    fp8_peak_tflops: float = 0.0
    """Dense FP8 tensor-core matmul peak per device, where an `fp8` layout's float8 matmuls run
    (0: no FP8 units, so the 16-bit peak; `fp8` training refuses such devices anyway)."""
    hbm_gbytes_per_s: float = 2000.0
    """Device memory bandwidth (elementwise work: norms, softmax, dropout, optimizer)."""
    matmul_efficiency: float = 0.7
    """Fraction of the peak a large matmul reaches."""
    matmul_half_gflop: float = 1.0
    """Work (GFLOP) at which one matmul reaches half of `matmul_efficiency` (small-matmul
    falloff: efficiency(w) = matmul_efficiency x w / (w + matmul_half_gflop))."""
    memory_efficiency: float = 0.7
    """Fraction of `hbm_gbytes_per_s` elementwise kernels reach."""
    network_efficiency: float = 0.8
    """Fraction of the link bandwidth a large collective reaches."""
    collective_latency_s: float = 2e-5
    """Fixed cost of one collective step (the alpha of the alpha-beta model)."""
    overlap_efficiency: float = 1.0
    """Fraction of an overlap window (backward compute a bucket's all-reduce runs behind) that
    really hides communication: 1 where copies run on their own engines (GPUs); less where
    communication competes with compute for the same cores (gloo on a CPU)."""
    layer_overhead_s: float = 0.0
    """Host time per transformer layer per forward (kernel launches, Python); backward counts
    it twice."""
    attention_efficiency: float = 0.0
    """Fraction of the 16-bit peak a fused (flash) attention kernel's forward reaches on the
    FLOPs it computes; 0: the kernel is priced as matmuls of its size (a CPU's SDPA is)."""
    attention_backward_ratio: float = 2.0
    """Fused attention core backward / forward time (CPU SDPA: ~2.6 measured; FlashAttention-2:
    2.5, its backward's five matmuls to the forward's two); eager attention's is 2."""
    reduce_scatter_all_reduces: bool = False
    """gloo's reduce-scatter all-reduces the whole tensor and keeps its own chunk (torch's
    ProcessGroupGloo has no native one): priced as that all-reduce. NCCL's is a native ring."""
    host_link_gbytes_per_s: float = 25.0
    """Device <-> host copies (PCIe 4 x16): offloaded ZeRO's gradient shard out, parameters
    back."""
    host_memory_gbytes_per_s: float = 100.0
    """Host memory bandwidth: AdamW over offloaded states runs there."""
    disk_gbytes_per_s: float = 3.0
    """One NVMe drive's sequential bandwidth per rank: `offload_optimizer` nvme's files."""
    default_precision: str = "bf16"
    """The precision `meshtrain plan` assumes for this hardware unless told otherwise."""
    collective_steps: str = "ring"
    """Latency steps of a collective phase over g ranks: "ring", g - 1 (NCCL's rings); "log",
    log2(g) (gloo's latency-bound algorithms); `plan calibrate` keeps the one that fits."""
    calibrated_ranks: int = 0
    """Ranks that shared the machine while `plan calibrate` measured it (its numbers are one
    rank's under that contention); 0: a profile from data sheets and published runs."""
    oversubscription: float = 1.0
    """Ranks per processor when all compute (CPU threads wanted over cores; 1 on GPUs): the
    measured rates are each rank's share, and a rank waiting in a pipeline bubble gives its
    share to the busy ones (`simulator.simulate`), so bubbles cost less than their length."""

    def peak_for(self, precision: str) -> float:
        """Matmul peak TFLOP/s in a precision (fp32, bf16, fp16; fp8: an `fp8` layout's float8
        matmuls)."""
        if precision == "fp8":
            return self.fp8_peak_tflops or self.peak_tflops
        if precision == "fp32":
            return self.fp32_peak_tflops or self.peak_tflops / 2
        if precision == "fp16":
            return self.fp16_peak_tflops or self.peak_tflops
        return self.peak_tflops

    def for_cpu_rank(self, cores_per_rank: float) -> Hardware:
        """This profile for a CPU rank computing on `cores_per_rank` cores. A CPU calibration's
        peaks are one one-thread rank's share of the machine (1 / `oversubscription` cores), so
        they scale by the cores this rank has over that share; a profile no calibration measured
        (a data sheet's) is returned as it is."""
        if not self.calibrated_ranks:
            return self
        scale = cores_per_rank * self.oversubscription
        return dataclasses.replace(self, peak_tflops=self.peak_tflops * scale,
                                   fp32_peak_tflops=self.fp32_peak_tflops * scale,
                                   fp16_peak_tflops=self.fp16_peak_tflops * scale,
                                   fp8_peak_tflops=self.fp8_peak_tflops * scale)

    def for_ranks(self, ranks: int) -> Hardware:
        """A CPU profile measured with more one-thread ranks than cores (`oversubscription` >
        1), for `ranks` such ranks on that machine: each rank computes on its share of the cores
        (at most one) and the ranks share them by their count; the collectives keep their
        measured price. Any other profile, or the measured rank count, is returned as it is
        (`plan calibrate --ranks N` measures N ranks instead)."""
        if self.oversubscription <= 1 or ranks == self.calibrated_ranks:
            return self
        cores = self.calibrated_ranks / self.oversubscription
        share = min(1.0, cores / ranks)  # of a core, per rank
        scale = share * self.oversubscription
        return dataclasses.replace(
            self.for_cpu_rank(share),
            hbm_gbytes_per_s=self.hbm_gbytes_per_s * scale,
            layer_overhead_s=self.layer_overhead_s / scale,
            oversubscription=max(1.0, ranks / cores))

    def mfu(self, tflops: float, precision: str) -> float | None:
        """Model FLOPs utilization: `tflops` (per device, `model_tflops`) over the peak in
        `precision`; None in a precision without a peak here (fp64)."""
        return tflops / self.peak_for(precision) if precision in PEAK_PRECISIONS else None

    def to_toml(self) -> str:
        lines = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            text = (str(value).lower() if isinstance(value, bool)
                    else f'"{value}"' if isinstance(value, str) else repr(value))
            lines.append(f"{f.name} = {text}")
        return "\n".join(lines) + "\n"


# Efficiencies fitted per profile against the published runs of `published_rows.json` by
# `PYTHONPATH=src python benchmarks/plan_vs_published.py --fit` (docs/benchmarks.md, "Planner
# validation against published runs"); the A100 40 GB takes the 80 GB's (same chip and links).
# H100's network_efficiency 1 and 2 us latency sit at their grids' bounds: they absorb the
# overlap of the distributed optimizer's parameter all-gather Megatron-Core has and meshtrain
# lacks (its --tp-comm-overlap is priced as `tp_overlap`; the docs say which rows).
_A100_FIT = {"matmul_efficiency": 0.675, "memory_efficiency": 0.6, "network_efficiency": 0.9,
             "collective_latency_s": 2e-5, "attention_efficiency": 0.5,
             "attention_backward_ratio": 2.5}
_H100_FIT = {"matmul_efficiency": 0.65, "memory_efficiency": 0.9, "network_efficiency": 1.0,
             "collective_latency_s": 2e-6, "attention_efficiency": 0.35,
             "attention_backward_ratio": 2.5}
# Fused attention (not fitted): FlashAttention-2, what torch's SDPA runs on these GPUs, reaches
# 50-73% of the A100's peak (Dao 2023, arXiv 2307.08691; the low end taken) and 35% of the
# H100's (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608); its backward does 2.5x the
# forward's matmul FLOPs (five matmuls to two), priced at the forward's rate.

BUILT_IN: dict[str, Hardware] = {
    "v100-32g-dgx2h": Hardware(
        name="v100-32g-dgx2h", peak_tflops=125.0, hbm_gib=32, gpus_per_node=16,
        intra_node_gbytes_per_s=150.0, inter_node_gbytes_per_s=6.25, fp32_peak_tflops=15.7,
        hbm_gbytes_per_s=900.0, default_precision="fp16", matmul_efficiency=0.825,
        memory_efficiency=0.7, network_efficiency=0.6, collective_latency_s=2e-5),
    "a100-40g": Hardware(
        name="a100-40g", peak_tflops=312.0, hbm_gib=40, gpus_per_node=8,
        intra_node_gbytes_per_s=300.0, inter_node_gbytes_per_s=25.0, fp32_peak_tflops=156.0,
        hbm_gbytes_per_s=1555.0, **_A100_FIT),
    "a100-80g-selene": Hardware(
        name="a100-80g-selene", peak_tflops=312.0, hbm_gib=80, gpus_per_node=8,
        intra_node_gbytes_per_s=300.0, inter_node_gbytes_per_s=25.0, fp32_peak_tflops=156.0,
        hbm_gbytes_per_s=2039.0, **_A100_FIT),
    # H100 SXM data sheet: FP8 1979 TFLOPS dense (3958 with sparsity), twice BF16's 989.
    "h100-80g": Hardware(
        name="h100-80g", peak_tflops=989.0, hbm_gib=80, gpus_per_node=8,
        intra_node_gbytes_per_s=450.0, inter_node_gbytes_per_s=50.0, fp32_peak_tflops=494.0,
        fp8_peak_tflops=1979.0, hbm_gbytes_per_s=3350.0, **_H100_FIT),
    # Not fitted (UNFITTED): data-sheet peaks with the H100's efficiencies, until measured runs
    # on them are in published_rows.json. Dense (not sparse) tensor-core rates; NVLink and
    # Infinity Fabric one direction per device; 400 Gb/s (50 GB/s) of InfiniBand per device.
    # H200 SXM (NVIDIA H200 Tensor Core GPU data sheet): BF16 989 TFLOPS, TF32 494, FP8 1979, 141 GB
    # HBM3e at 4.8 TB/s, NVLink 900 GB/s (450 each way).
    "h200": Hardware(
        name="h200", peak_tflops=989.0, hbm_gib=141, gpus_per_node=8,
        intra_node_gbytes_per_s=450.0, inter_node_gbytes_per_s=50.0, fp32_peak_tflops=494.0,
        fp8_peak_tflops=1979.0, hbm_gbytes_per_s=4800.0, **_H100_FIT),
    # B200 (NVIDIA HGX B200 data sheet, per GPU of eight): BF16 2.25 PFLOPS, TF32 1.1 PFLOPS,
    # FP8 4.5 PFLOPS (half the sparse 4.5, 2.2 and 9), 180 GB HBM3e at 8 TB/s, NVLink 5
    # 1.8 TB/s (900 each way).
    "b200": Hardware(
        name="b200", peak_tflops=2250.0, hbm_gib=180, gpus_per_node=8,
        intra_node_gbytes_per_s=900.0, inter_node_gbytes_per_s=50.0, fp32_peak_tflops=1100.0,
        fp8_peak_tflops=4500.0, hbm_gbytes_per_s=8000.0, **_H100_FIT),
    # MI300X (AMD Instinct MI300X data sheet): BF16 1307.4 TFLOPS, TF32 653.7, 192 GB HBM3 at
    # 5.3 TB/s; seven Infinity Fabric links of 64 GB/s each way to the node's other GPUs
    # (448 GB/s each way in all).
    "mi300x": Hardware(
        name="mi300x", peak_tflops=1307.4, hbm_gib=192, gpus_per_node=8,
        intra_node_gbytes_per_s=448.0, inter_node_gbytes_per_s=50.0, fp32_peak_tflops=653.7,
        hbm_gbytes_per_s=5300.0, **_H100_FIT),
    # This 2-core CI host with 4 gloo ranks sharing it (one thread each), per rank:
    # `calibrate_machine(ranks=4)` on a quiet host (2026-11-27: collectives timed behind a
    # matmul burst, gloo's log2(g) latency steps, a real layer's compute and host overhead),
    # then refined by five 14-step `meshtrain train --nproc 4` runs of plan_vs_measured.py's
    # model (dp 4; tp 2 x dp 2; pp 2 x dp 2; cp 2 x dp 2; ZeRO-3), `meshtrain plan calibrate
    # --from-run`: compute x1.09, network x1.19 (docs/benchmarks.md, "Issue 32 item 3, third
    # pass"). Another host, or this one under other load, calibrates its own.
    "cpu-gloo": Hardware(
        name="cpu-gloo", peak_tflops=0.1079, hbm_gib=5.885, gpus_per_node=4,
        intra_node_gbytes_per_s=0.947, inter_node_gbytes_per_s=0.947,
        fp32_peak_tflops=0.04905, fp16_peak_tflops=0.002244, hbm_gbytes_per_s=8.449,
        matmul_efficiency=0.754, matmul_half_gflop=0.0002749, memory_efficiency=0.8198,
        network_efficiency=1.19, collective_latency_s=0.001449, overlap_efficiency=0.0,
        layer_overhead_s=0.0004844, attention_backward_ratio=2.914,
        reduce_scatter_all_reduces=True, default_precision="fp32", collective_steps="log",
        calibrated_ranks=4, oversubscription=2.0),
}
"""GPU peaks, memory and links from the vendors' data sheets (and `published_rows.json`'s
hardware table); fp32 peaks are TF32 tensor-core rates (V100: plain fp32)."""

UNFITTED = ("h200", "b200", "mi300x")
"""Built-in profiles from data sheets alone: no published row runs on them, so `plan validate`
checks none of them, and `plan` says so in its header."""

CUDA_PROFILES = (("H100", "h100-80g"), ("H200", "h200"), ("B200", "b200"), ("MI300X", "mi300x"),
                 ("A100-SXM4-80GB", "a100-80g-selene"), ("A100 80GB", "a100-80g-selene"),
                 ("A100", "a100-40g"), ("V100-SXM3-32GB", "v100-32g-dgx2h"))
"""Substrings of `torch.cuda.get_device_name` and the built-in profile each device matches."""
CPU_PROFILE = "cpu-gloo"


def device_profile(cuda_name: str | None) -> Hardware | None:
    """The built-in profile of a device: a CUDA device's by its name (None when no profile
    matches it), the CPU one when `cuda_name` is None."""
    if cuda_name is None:
        return BUILT_IN[CPU_PROFILE]
    return next((BUILT_IN[profile] for needle, profile in CUDA_PROFILES if needle in cuda_name),
                None)


def calibrated_path(name: str, ranks: int) -> Path:
    """Where `plan calibrate` keeps the profile it measured of this machine (`name`, as
    `calibrate_machine` names it: cpu-gloo, cuda-nccl) at `ranks` ranks, and where `plan` looks
    for it: `$MESHTRAIN_HOME/hardware/`, by default under ~/.cache/meshtrain."""
    home = os.environ.get("MESHTRAIN_HOME") or Path.home() / ".cache" / "meshtrain"
    return Path(home) / "hardware" / f"{name}-{ranks}ranks.toml"


def load_hardware(name_or_file: str) -> Hardware:
    """A built-in profile by name, or a TOML file with `Hardware`'s fields."""
    if name_or_file in BUILT_IN:
        return BUILT_IN[name_or_file]
    path = Path(name_or_file)
    if not path.suffix == ".toml":
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"`hardware` {name_or_file!r} is neither a built-in profile"
                           f" ({', '.join(BUILT_IN)}) nor a .toml file")
    try:
        values = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"`hardware` file {path} cannot be read: {e}") from None
    factor = values.pop("reduce_scatter_factor", None)  # a retired field: see _retired_factor
    if factor is not None:
        values.setdefault("reduce_scatter_all_reduces", _retired_factor(factor))
    known = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"`hardware` file {path} has an unknown field {unknown[0]!r}: the"
                           f" fields are {', '.join(sorted(known))}")
    values.setdefault("name", path.stem)
    try:
        hardware = Hardware(**values)
    except TypeError as e:
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"`hardware` file {path} lacks a field: {e}") from None
    for name, (low, high, low_included) in _RANGES.items():
        value = getattr(hardware, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                (low <= value if low_included else low < value) and value <= high
                and math.isfinite(value)):
            closing = "]" if high < math.inf else ")"
            bound = f"{'[' if low_included else '('}{low:g}, {high:g}{closing}"
            raise SettingError(Code.HARDWARE_PROFILE,
                               f"`hardware` file {path}: {name} must be a number in {bound}, got"
                               f" {value!r}; fix the file or calibrate again")
    if not isinstance(hardware.reduce_scatter_all_reduces, bool):
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"`hardware` file {path}: reduce_scatter_all_reduces must be true or"
                           f" false, got {hardware.reduce_scatter_all_reduces!r}")
    if hardware.collective_steps not in COLLECTIVE_STEPS:
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"`hardware` file {path}: collective_steps must be ring or log, got"
                           f" {hardware.collective_steps!r}")
    if hardware.default_precision not in PEAK_PRECISIONS:
        raise SettingError(Code.HARDWARE_PROFILE,
                           f"`hardware` file {path}: default_precision must be fp32, bf16 or"
                           f" fp16, got {hardware.default_precision!r}")
    return hardware


def _retired_factor(factor: object) -> bool:
    """Profiles calibrated before `reduce_scatter_all_reduces` priced reduce-scatter's bytes at
    `reduce_scatter_factor` x all-gather's: 1 on NCCL, 2 or more measured on gloo (whose
    reduce-scatter is an all-reduce). Such a file still loads, as the machine it describes."""
    return isinstance(factor, int | float) and not isinstance(factor, bool) and factor >= 1.5


_POSITIVE = (0.0, math.inf, False)
_RANGES = {  # field: (low, high, low included); a NaN is in no range
    **dict.fromkeys(("peak_tflops", "hbm_gib", "gpus_per_node", "intra_node_gbytes_per_s",
                     "inter_node_gbytes_per_s", "hbm_gbytes_per_s",
                     "attention_backward_ratio", "matmul_efficiency",
                     "memory_efficiency", "network_efficiency"), _POSITIVE),
    **dict.fromkeys(("fp32_peak_tflops", "fp16_peak_tflops", "fp8_peak_tflops",
                     "collective_latency_s",
                     "layer_overhead_s", "calibrated_ranks",
                     "matmul_half_gflop", "attention_efficiency"),
                    (0.0, math.inf, True)),
    "overlap_efficiency": (0.0, 1.0, True),
    "oversubscription": (1.0, math.inf, True),
}
"""What a profile's numbers may be (infinities and NaN never). Efficiencies are only bounded
below: a calibration measures its peak and may fit a little over it."""
