"""Activation memory per transformer layer, measured with saved-tensor hooks, against each
family's formula (GPT: the seeds'; Qwen3: head norms, heads wider than hidden / heads; eager
attention, fp32 on CPU where the dropout mask has the activation's dtype: e = mu = 4), with
dropout on (masks saved) and off."""

import pytest
import torch
from harness import run_on_ranks, worker_mesh

from meshtrain import ParallelMesh, preset
from meshtrain.contracts import AuxiliaryOutputs
from meshtrain.memory import layer_activation_formula, measure_peak, saved_activation_bytes
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
                                          ("llama-tiny", 0.0), ("qwen3-tiny", 0.0),
                                          ("deepseek-v3-tiny", 0.0)])
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


def test_peak_counts_live_storages_once_each():
    weights = torch.zeros(1000)  # 4000 bytes
    with measure_peak(baseline={"weights": [weights]}) as peak:
        a = torch.ones(250)  # 5000 live
        view = a.view(25, 10)  # a view: the same storage, nothing more
        b = torch.empty(500)  # 7000
        del b  # 5000
        c = weights + 1  # 9000: the high-water mark
        del a, view, c
        torch.empty(100)  # 4400
    # `held`: whatever else this process holds (other tests' tensors), live throughout
    assert peak.peak == 9000 + peak.at_peak.get("held", 0)
    assert peak.at_peak["weights"] == 4000 and peak.at_peak["allocated"] == 5000


def test_tensors_live_at_the_start_count_before_an_op_uses_them():
    earlier = torch.zeros(100)
    with measure_peak() as peak:
        scratch = torch.empty(300)  # 1200 bytes, with the 400 of `earlier`
        del scratch
        earlier.add_(1)
    assert peak.at_peak["allocated"] == 1200 and peak.at_peak["held"] >= 400


def test_peak_follows_storages_resized_in_place():
    """ZeRO-3 frees a gathered buffer by resizing its storage to 0 and regrows it to gather."""
    flat = torch.zeros(100)
    storage = flat.untyped_storage()
    with measure_peak(baseline={"flat": [flat]}) as peak:
        storage.resize_(0)
        scratch = torch.empty(300)  # 1200 live: the 400 no longer count
        del scratch
        storage.resize_(400)
        flat.set_(storage, 0, (100,)).fill_(1)  # regrown, then written: 400
        torch.empty(100)  # 800
    assert peak.at_peak["flat"] == 0 and peak.at_peak["allocated"] == 1200


def test_peak_sees_backward():
    weight = torch.zeros(1000, requires_grad=True)
    with measure_peak(baseline={"weight": [weight]}) as peak:
        (weight * 2).sum().backward()
    assert peak.at_peak["weight"] == 4000
    assert peak.at_peak["allocated"] >= 4000  # at least the gradient


def test_the_peak_probe_passes_over_tensors_without_data_that_a_trace_left_alive():
    """flex_attention's CPU forward traces its mask function and leaves fake tensors (meta
    storages of symbolic size) in torch's caches: the probe's scan of what is live finds them
    and must not count them."""
    from meshtrain.parallel.layers.flex import flex_attention_masked
    from meshtrain.parallel.layers.masks import AttentionMask

    documents = torch.arange(32).div(5, rounding_mode="floor")[None]
    # two shapes: the second trace makes its sizes symbolic
    for window, docs, s, t, k_start in ((None, documents, 16, 16, 0), (4, documents, 6, 16, 9)):
        q, kv = torch.randn(1, 4, s, 8), torch.randn(1, 2, t, 8)
        with torch.no_grad():
            flex_attention_masked(q, kv, kv, AttentionMask(window, docs), k_start)
    with measure_peak() as held:
        pass
    with measure_peak() as probe:
        kept = torch.empty(1000)
    assert probe.peak - held.peak == kept.untyped_storage().nbytes()
    # plain byte counts: a traced tensor's symbolic size would break the metrics' JSON
    assert all(type(n) is int for n in (probe.peak, *probe.at_peak.values()))
