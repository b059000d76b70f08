"""Activation memory per transformer layer, measured with saved-tensor hooks, against each
family's formula (GPT: the seeds'; eager attention, fp32 on CPU where the dropout mask has the
activation's dtype: e = mu = 4), with dropout on (masks saved) and off."""

import pytest
import torch
from harness import run_on_ranks, worker_mesh

from meshtrain import ParallelMesh, preset
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.memory import layer_activation_formula, saved_activation_bytes
from meshtrain.parallel.layers.recompute import recomputed
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallelize import build_model

B, S, H, A = 2, 64, 64, 4


def _measure(mesh, plan, cfg):
    model = build_model(cfg, mesh, seed=0, plan=plan)
    model.train()
    block = model.layers["0"]
    s_local = S // mesh.tp.size if plan.sequence_parallel else S
    x = torch.randn(B, s_local, H, requires_grad=True)

    args = (model.rng, torch.arange(S), AuxiliaryOutputs())

    def run():
        if plan.recompute == "full":
            return recomputed(block, model.rng, x, *args)
        return block(x, *args)

    nbytes, out = saved_activation_bytes(run, exclude=model.parameters())
    out.sum().backward()  # the saved tensors really are what backward needs
    return nbytes


def _check(tp, plan, name, dropout):
    mesh = worker_mesh(tp=tp) if tp > 1 else ParallelMesh.local()
    cfg = preset(name, vocab_size=64, dropout=dropout, attention="eager")
    measured = _measure(mesh, plan, cfg)
    expected = cfg.activation_bytes(seq_len=S, micro_batch=B, tp=tp,
                                    sequence_parallel=plan.sequence_parallel,
                                    recompute=plan.recompute, element_size=4, mask_size=4,
                                    dropout=dropout > 0)
    assert abs(measured - expected) / expected < 0.10, (measured, expected)
    return measured, expected


@pytest.mark.parametrize("name,dropout", [("tiny", 0.1), ("llama-tiny", 0.1),
                                          ("llama-tiny", 0.0)])
@pytest.mark.parametrize("tp,plan", [
    (1, ParallelPlan()),
    (1, ParallelPlan(recompute="selective")),
    (1, ParallelPlan(recompute="full")),
    (2, ParallelPlan()),
    (2, ParallelPlan(sequence_parallel=True)),
    (2, ParallelPlan(sequence_parallel=True, recompute="selective")),
    (2, ParallelPlan(sequence_parallel=True, recompute="full")),
    (4, ParallelPlan(recompute="selective")),
], ids=lambda v: str(v))
def test_activation_bytes_match_formula(tp, plan, name, dropout):
    run_on_ranks(tp, _check, tp, plan, name, dropout)


def test_formula_reduces_to_the_papers_constants():
    # 2-byte activations and 1-byte masks: sbh(34 + 5as/h), TP: sbh(10 + 24/t + 5as/(ht))
    sbh = S * B * H
    assert layer_activation_formula(s=S, b=B, h=H, a=A) == sbh * (34 + 5 * A * S / H)
    assert layer_activation_formula(s=S, b=B, h=H, a=A, tp=4) == \
        sbh * (10 + 24 / 4 + 5 * A * S / (H * 4))
    assert layer_activation_formula(s=S, b=B, h=H, a=A, tp=4, sequence_parallel=True) == \
        sbh / 4 * (34 + 5 * A * S / H)
