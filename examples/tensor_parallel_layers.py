"""Shard a dense MLP over TP ranks and check it against the dense one, counting what it sends.

    torchrun --nproc-per-node 2 examples/tensor_parallel_layers.py
"""

import torch
from torch import nn

import meshtrain
from meshtrain.parallel import ColumnParallelLinear, CommRecorder, RowParallelLinear

mesh = meshtrain.init_parallel(tp=2, device="cpu")
torch.manual_seed(0)
dense_fc, dense_proj = nn.Linear(16, 64), nn.Linear(64, 16)
fc = ColumnParallelLinear.from_dense(dense_fc, mesh=mesh)  # rows of [64, 16]: [32, 16] here
proj = RowParallelLinear.from_dense(dense_proj, mesh=mesh)  # takes fc's split output as is

x = torch.randn(4, 16)
with CommRecorder() as rec:
    y = proj(torch.relu(fc(x)))  # f (identity) -> local matmuls -> g (one all-reduce)
expected = dense_proj(torch.relu(dense_fc(x)))
torch.testing.assert_close(y, expected)
if mesh.rank == 0:
    print(f"matches the dense MLP; forward sent {rec.count()} collective(s):",
          [(r.op, r.axis, r.payload_bytes) for r in rec.records])
meshtrain.destroy_parallel()
