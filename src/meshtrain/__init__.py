"""meshtrain: train GPT models with Megatron-style parallelism on one device mesh."""

from meshtrain.mesh import MeshAxis, ParallelMesh, destroy_parallel, init_parallel
from meshtrain.model import GPT, PRESETS, GPTConfig, preset
from meshtrain.random import RNGTracker

__all__ = [
    "GPT",
    "GPTConfig",
    "MeshAxis",
    "PRESETS",
    "ParallelMesh",
    "RNGTracker",
    "destroy_parallel",
    "init_parallel",
    "preset",
]
