"""Parallel building blocks: tensor-parallel layers, the vocab-parallel loss, collectives."""

from meshtrain.parallel.communication.comm import CommRecorder
from meshtrain.parallel.communication.regions import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from meshtrain.parallel.layers.loss import vocab_parallel_cross_entropy
from meshtrain.parallel.layers.sharding import named_full_tensors
from meshtrain.parallel.layers.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = [
    "ColumnParallelLinear",
    "CommRecorder",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "named_full_tensors",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "vocab_parallel_cross_entropy",
]
