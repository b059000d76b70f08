"""Named random states for dropout in and out of tensor-parallel regions.

Dropout on a replicated activation (embedding output, residual branches) must draw the same mask
on every TP rank, or the replicas drift apart; dropout inside a TP region (attention
probabilities of this rank's heads) must draw different masks on different TP ranks, or the
heads would be dropped in lockstep. The tracker keeps one state per purpose and swaps it into the
device's default generator for the duration of a `fork`, so torch's own dropout kernels use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from meshtrain.mesh import ParallelMesh

REPLICATED = "replicated"  # equal across TP ranks
TENSOR_PARALLEL = "tensor-parallel"  # distinct per TP rank

# Offsets keep the named streams apart from each other and from the weight-init stream.
_REPLICATED_OFFSET = 1
_TENSOR_PARALLEL_OFFSET = 2718
_PIPELINE_STAGE_OFFSET = 100
STATE_BYTES = {"cpu": torch.get_rng_state().numel(), "cuda": 16}
"""The length of one generator's state (a uint8 vector) by device type: the CPU's Mersenne
Twister; CUDA's Philox seed and offset (8 bytes each). A checkpoint's states are checked
against it before they are restored."""


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """A set of named generator states for one device."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        outer = _get_state(self.device)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name] = _get_state(self.device)
        _set_state(self.device, outer)

    @contextlib.contextmanager
    def fork(self, name: str) -> Iterator[None]:
        """Run the block with the named state; it advances, the outer state is untouched."""
        if name not in self._states:
            raise KeyError(f"unknown RNG state {name!r}; known: {sorted(self._states)}")
        outer = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outer)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every named state (for checkpoints and activation recomputation)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        if set(states) != set(self._states):
            raise ValueError(f"RNG states {sorted(states)} do not match {sorted(self._states)}")
        self._states = {name: state.clone() for name, state in states.items()}

    @classmethod
    def for_mesh(cls, mesh: ParallelMesh, seed: int) -> RNGTracker:
        """The replicated and tensor-parallel streams of this rank.

        Pipeline stages get distinct streams (they hold different layers); data-parallel replicas
        share them, as in Megatron.
        """
        tracker = cls(mesh.device)
        base = seed + _PIPELINE_STAGE_OFFSET * mesh.pp.rank
        tracker.add(REPLICATED, base + _REPLICATED_OFFSET)
        tracker.add(TENSOR_PARALLEL, base + _TENSOR_PARALLEL_OFFSET + mesh.tp.rank)
        return tracker
