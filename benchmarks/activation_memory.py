"""Activation memory per transformer layer, measured (saved-tensor hooks) against the formulas,
and the longest sequence that fits a fixed per-rank budget as context parallelism grows.

    torchrun --nproc-per-node 4 benchmarks/activation_memory.py
"""

import torch
import torch.distributed as dist

import meshtrain
from meshtrain import preset
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.memory import layer_activation_formula, saved_activation_bytes
from meshtrain.parallel.layers.recompute import recomputed
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model

B, H, A = 2, 64, 4


def layer_bytes(mesh, plan, s, *, attention="eager", dropout=0.1):
    cfg = preset("tiny", vocab_size=64, dropout=dropout, attention=attention, max_seq_len=s)
    model = build_model(cfg, mesh, seed=0, plan=plan)
    model.train()
    block = model.layers["0"]
    local = s // mesh.cp.size // (mesh.tp.size if plan.sequence_parallel else 1)
    x = torch.randn(B, local, H, requires_grad=True)
    args = (model.rng, None, AuxiliaryOutputs())  # GPT's blocks need no positions
    run = (lambda: recomputed(block, model.rng, x, *args)) if plan.recompute == "full" \
        else (lambda: block(x, *args))
    return saved_activation_bytes(run, exclude=model.parameters())[0]


def formula_table(rank):
    rows = []
    s = 256
    for tp, plan in [(1, ParallelPlan()), (1, ParallelPlan(recompute="selective")),
                     (1, ParallelPlan(recompute="full")), (2, ParallelPlan()),
                     (2, ParallelPlan(sequence_parallel=True)),
                     (2, ParallelPlan(sequence_parallel=True, recompute="selective")),
                     (4, ParallelPlan()), (4, ParallelPlan(sequence_parallel=True))]:
        mesh = meshtrain.init_parallel(tp=tp, device="cpu")
        measured = layer_bytes(mesh, plan, s)
        formula = layer_activation_formula(s=s, b=B, h=H, a=A, tp=tp,
                                           sequence_parallel=plan.sequence_parallel,
                                           recompute=plan.recompute, element_size=4,
                                           mask_size=4)
        mode = ("sp" if plan.sequence_parallel else "-") + f", recompute {plan.recompute}"
        rows.append(f"| tp={tp} | {mode} | {measured:,} | {formula:,.0f} |"
                    f" {measured / formula - 1:+.1%} |")
    if rank == 0:
        print(f"per-layer bytes saved for backward, b={B} s={s} h={H} a={A}, fp32, dropout 0.1,"
              " eager attention")
        print("| layout | mode | measured | formula | difference |\n|---|---|---|---|---|")
        print("\n".join(rows))


def longest_sequence(rank, budget):
    lines = []
    for cp in (1, 2, 4):
        mesh = meshtrain.init_parallel(cp=cp, device="cpu")
        attention = "sdpa" if cp == 1 else "eager"  # cp > 1 uses ring attention either way

        def fits(s, mesh=mesh, attention=attention):
            return layer_bytes(mesh, ParallelPlan(), s, attention=attention,
                               dropout=0.0) <= budget

        step = 2 * cp * 16
        low, high = 1, 2  # in units of step: low fits, high does not
        while fits(high * step):
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid * step) else (low, mid)
        s = low * step
        used = layer_bytes(mesh, ParallelPlan(), s, attention=attention, dropout=0.0)
        lines.append(f"| {cp} | {s:,} | {used:,} |")
    if rank == 0:
        print(f"\nlongest sequence whose per-rank layer activations fit {budget:,} bytes (b={B},"
              f" h={H}, fp32, dropout 0; cp=1 SDPA, cp>1 ring attention)")
        print("| cp | longest s | bytes at that s |\n|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    torch.set_num_threads(1)
    meshtrain.init_parallel(device="cpu")
    rank = dist.get_rank()
    formula_table(rank)
    longest_sequence(rank, budget=4 * 2**20)
    meshtrain.destroy_parallel()
