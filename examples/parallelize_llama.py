"""A Llama laid out by `parallelize` (tensor + sequence parallel over 2 ranks), trained for a
few steps through its gradient sync and step executor, against the same Llama on one process.

    torchrun --nproc-per-node 2 examples/parallelize_llama.py
"""

import torch

import meshtrain
from meshtrain import OptimizerSettings, ParallelPlan, parallelize, preset

SEQ, BATCH, LR = 32, 4, 1e-3
cfg = preset("llama-tiny")  # 8 heads sharing 4 key/value heads: 2 of them on each rank
plan = ParallelPlan(tp=2, sequence_parallel=True, micro_batch=2)
plan = plan.validate(cfg, world_size=2, global_batch=BATCH, seq_len=SEQ)  # dp=1 filled in
mesh = meshtrain.init_parallel(**plan.degrees, device="cpu")  # reads torchrun's environment
options = dict(seed=0, seq_len=SEQ, steps=3, optimizer=OptimizerSettings(lr=LR, weight_decay=0.0))
runs = {"tp=2 + sp": parallelize(cfg, plan, mesh, **options),
        "one process": parallelize(cfg, ParallelPlan(micro_batch=2).resolved(1),
                                   meshtrain.ParallelMesh.local(), **options)}


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This step's micro-batches of (ids, next-token targets): the same on every rank."""
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(step))
    return [(t[:, :-1], t[:, 1:]) for t in tokens.split(plan.micro_batch)]


for step in range(3):
    losses = {}
    for name, run in runs.items():
        run.model.train()
        run.sync.zero_grad()
        result = run.executor.forward_backward(step, batches, run.sync, loss_scale=1.0)
        run.sync.wait()  # gradients reduced and completed (here: SP's partial sums over tp)
        run.executor.optimizer_step(lambda run=run: run.sync.step(LR))
        losses[name] = result.loss.item()
    torch.testing.assert_close(losses["tp=2 + sp"], losses["one process"], rtol=1e-5, atol=0)
    if mesh.rank == 0:
        print(f"step {step + 1}: loss {losses['tp=2 + sp']:.6f} matches one process's"
              f" {losses['one process']:.6f}")
meshtrain.destroy_parallel()
