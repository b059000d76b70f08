"""Per-block `torch.compile`: each transformer block's forward (and, through AOTAutograd, its
backward) becomes inductor kernels, as torchtitan compiles Llama's blocks.

Blocks, not the whole model: the blocks of a model share one code object, so dynamo compiles
one graph and every layer reuses it (the layer's parameters are graph inputs, not constants);
the embedding, the loss and the pipeline's sends and receives stay eager around them. The
forward is replaced on each block instance, so parameter names, hooks (ZeRO-3 gathers
parameters in a forward pre-hook, outside the compiled code) and checkpoints are unchanged,
and recomputation (`recomputed`) reruns the compiled forward with the same RNG streams.
Tensor-parallel collectives inside a block's autograd functions are graph breaks: the
matmuls, norms, activations and attention between them compile.

Dropout is left out of the compiled graphs (`layers.eager` marks where it draws): it runs
torch's eager kernels on meshtrain's RNG streams, so a compiled run draws the masks an eager run
does and recomputation replays them exactly (inductor's own random numbers differ from eager
ones). Dropout is 0 by default, and then a block is one graph.
"""

from __future__ import annotations

import torch
from torch import nn

from meshtrain.parallel.layers.eager import arm_eager_functions


def compile_blocks(model: nn.Module) -> int:
    """Compile every transformer block this rank holds (`model.layers`) in place; returns how
    many. The first call of each block compiles (forward at once, backward at its first
    backward); later calls reuse the compiled code while the shapes stay the same."""
    arm_eager_functions()
    for block in model.layers.values():
        block.forward = torch.compile(block.forward)
    return len(model.layers)
