"""Time of one collective: the alpha-beta model of ring algorithms on the link a group crosses.

For a group of g ranks and a message of n bytes (the full tensor: the all-reduced one, or the
all-gather's output / reduce-scatter's input): all-reduce 2(g-1) steps moving 2(g-1)/g n bytes
per rank; all-gather and reduce-scatter (g-1) steps moving (g-1)/g n; all-to-all (g-1) steps
moving (g-1)/g n; a send 1 step moving n. gloo has no reduce-scatter of its own (torch's gloo
backend all-reduces the whole tensor and keeps a chunk), so a profile measured on gloo prices
it as that all-reduce (`reduce_scatter_all_reduces`). Each step costs `collective_latency_s`;
bytes move at the link's bandwidth times `network_efficiency`. A profile whose
`collective_steps` is "log" counts log2(g) steps per phase instead of g - 1 (gloo's
halving-doubling and bcube algorithms for latency-bound messages: measured on this host, its
small all-reduce at g 4 takes about twice g 2's time, not three times); the bytes stay the
bandwidth-optimal ones. The link is intra-node when the group's ranks lie in one node: mesh
axes are ordered pp, dp, cp, tp (outer to inner), so a group whose ranks span `span`
consecutive ranks stays inside a node when span <= gpus_per_node. Run behind compute, a
collective stays exposed by what exceeds `overlap_efficiency` of that compute (`behind`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshtrain.parallel.schemes.scheme import Traffic
from meshtrain.planner.hardware import Hardware


def bandwidth(hardware: Hardware, span: int) -> float:
    """Bytes/s one rank moves to its group's peers across `span` consecutive ranks."""
    gbytes = hardware.intra_node_gbytes_per_s if span <= hardware.gpus_per_node \
        else hardware.inter_node_gbytes_per_s
    return gbytes * 1e9 * hardware.network_efficiency


def _ring(hardware: Hardware, *, steps: int, moved: float, span: int) -> float:
    return steps * hardware.collective_latency_s + moved / bandwidth(hardware, span)


def steps(hardware: Hardware, group: int) -> int:
    """Latency steps of one phase (a gather or a scatter) over `group` ranks."""
    return math.ceil(math.log2(group)) if hardware.collective_steps == "log" else group - 1


def all_reduce(hardware: Hardware, nbytes: float, group: int, span: int) -> float:
    if group == 1:
        return 0.0
    return _ring(hardware, steps=2 * steps(hardware, group),
                 moved=2 * (group - 1) / group * nbytes, span=span)


def all_gather(hardware: Hardware, nbytes: float, group: int, span: int) -> float:
    """Also an all-to-all's time (same steps and bytes)."""
    if group == 1:
        return 0.0
    return _ring(hardware, steps=steps(hardware, group), moved=(group - 1) / group * nbytes,
                 span=span)


def reduce_scatter(hardware: Hardware, nbytes: float, group: int, span: int) -> float:
    """An all-gather's steps and bytes, or where the backend has no native reduce-scatter
    (`reduce_scatter_all_reduces`: gloo) the all-reduce it runs instead."""
    if hardware.reduce_scatter_all_reduces:
        return all_reduce(hardware, nbytes, group, span)
    return all_gather(hardware, nbytes, group, span)

all_to_all = all_gather


def sequence(hardware: Hardware, *, steps: int, moved: float, span: int) -> float:
    """Ring collectives given by their total steps and bytes per rank (a tensor-parallel grid's
    per-layer totals, `TPScheme.layer_traffic`)."""
    return _ring(hardware, steps=steps, moved=moved, span=span)


def send(hardware: Hardware, nbytes: float, span: int) -> float:
    return _ring(hardware, steps=1, moved=nbytes, span=span)


def behind(hardware: Hardware, comm: float, window: float) -> float:
    """What of `comm` seconds stays exposed when it runs behind `window` seconds of compute."""
    return max(0.0, comm - hardware.overlap_efficiency * window)


@dataclass(frozen=True)
class TPClock:
    """A tensor-parallel block's collectives on `hardware` (a group of `tp` ranks, as many
    wide): the `scheme.Clock` a scheme prices its communication with."""

    hardware: Hardware
    tp: int

    def all_reduce(self, nbytes: float) -> float:
        return all_reduce(self.hardware, nbytes, self.tp, self.tp)

    def all_gather(self, nbytes: float) -> float:
        return all_gather(self.hardware, nbytes, self.tp, self.tp)

    def reduce_scatter(self, nbytes: float) -> float:
        return reduce_scatter(self.hardware, nbytes, self.tp, self.tp)

    def traffic(self, traffic: Traffic) -> tuple[float, float]:
        return (sequence(self.hardware, steps=traffic.forward_steps,
                         moved=traffic.forward_bytes, span=self.tp),
                sequence(self.hardware, steps=traffic.backward_steps,
                         moved=traffic.backward_bytes, span=self.tp))

    def behind(self, comm: float, window: float) -> float:
        return behind(self.hardware, comm, window)

    def ring_behind(self, comm: float, window: float) -> float:
        """tp - 1 ring steps, each behind one of the tp chunks of a `window`-second matmul."""
        t = self.tp
        return (t - 1) * max(0.0, comm / (t - 1) - self.hardware.overlap_efficiency * window / t)
