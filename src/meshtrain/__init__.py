"""meshtrain: train transformer language models with Megatron-style parallelism on one mesh."""

from meshtrain.operations.command_signals import handle_start_signals

handle_start_signals()  # first: a stop signal while torch loads is one line or held, not fatal
# ruff: noqa: E402 (the imports below load torch: after the call above on purpose)

from meshtrain.inference.dense import DenseModel, load_model
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.models import FAMILIES, PRESETS, CausalLM, get_family, preset
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.models.llama import Llama, LlamaConfig
from meshtrain.parallel.layers.rng import RNGTracker
from meshtrain.parallel.runtime.optim import OptimizerSettings
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.runtime.process_groups import destroy_parallel, init_parallel
from meshtrain.parallelize import build_model, parallelize

__all__ = [
    "FAMILIES",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "PRESETS",
    "CausalLM",
    "DenseModel",
    "MeshAxis",
    "OptimizerSettings",
    "ParallelMesh",
    "ParallelPlan",
    "RNGTracker",
    "build_model",
    "destroy_parallel",
    "get_family",
    "init_parallel",
    "load_model",
    "parallelize",
    "preset",
]
