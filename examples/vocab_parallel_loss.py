"""Cross-entropy over logits split by vocabulary: only O(b*s) numbers cross the wire.

    torchrun --nproc-per-node 2 examples/vocab_parallel_loss.py
"""

import torch
import torch.nn.functional as F

import meshtrain
from meshtrain.parallel import CommRecorder, vocab_parallel_cross_entropy
from meshtrain.parallel.communication.comm import split_along

mesh = meshtrain.init_parallel(tp=2, device="cpu")
torch.manual_seed(0)
logits = torch.randn(2, 8, 1000) * 1e4  # huge logits: the max is all-reduced first
targets = torch.randint(0, 1000, (2, 8))
local = split_along(logits, mesh.tp, dim=-1)  # [2, 8, 500] on each rank
with CommRecorder() as rec:
    loss = vocab_parallel_cross_entropy(local, targets, mesh=mesh)
reference = F.cross_entropy(logits.view(-1, 1000), targets.view(-1), reduction="none")
torch.testing.assert_close(loss.view(-1), reference)
if mesh.rank == 0:
    print(f"loss matches; sent {rec.payload_bytes()} bytes instead of"
          f" {logits.numel() * 4} for gathered logits")
meshtrain.destroy_parallel()
