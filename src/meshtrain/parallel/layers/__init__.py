"""Building blocks: tensor-parallel layers, parameter sharding, norms, the vocab-parallel loss,
attention cores, context parallelism, experts, RNG streams, recomputation.
"""
