"""Overlapped tensor-parallel communication (`tp_overlap`): the sequence-parallel linears with
their all-gather and reduce-scatter run as ring steps behind chunks of their matmuls compute
what the unoverlapped layers compute (bit for bit at tp 2, where a sum of two has one order;
within 1e-6 at tp 4, where the ring adds in another order than gloo's reduce-scatter), count
the same bytes, defer weight gradients under a split backward, train the same trajectories,
run under torch.compile, and are refused in one line where they cannot work."""

import dataclasses

import pytest
import torch
from harness import LLAMA, run_on_ranks, worker_mesh
from test_planner_search import _search
from test_train import _config
from torch import nn

from meshtrain.cli.main import main
from meshtrain.errors import Code, SettingError
from meshtrain.models import preset
from meshtrain.parallel import CommRecorder
from meshtrain.parallel.layers.tensor import (
    ColumnParallelGroup,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelHead,
)
from meshtrain.parallel.layers.weight_grads import accumulate_deferred, defer_weight_gradients
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.training.trainer import Trainer

REL = 1e-6  # the bound: max |overlapped - unoverlapped| <= REL x max |unoverlapped|


def _counted(records) -> dict[tuple[str, str], tuple[int, int]]:
    """(op, axis) -> (calls, payload bytes) of a recorder's records."""
    counts: dict[tuple[str, str], tuple[int, int]] = {}
    for r in records:
        calls, nbytes = counts.get((r.op, r.axis), (0, 0))
        counts[r.op, r.axis] = (calls + 1, nbytes + r.payload_bytes)
    return counts


def _compare(ours: dict, theirs: dict, bitwise: bool) -> dict[str, float]:
    """Relative max differences by name; every one bitwise zero when `bitwise`."""
    assert ours.keys() == theirs.keys()
    worst = {}
    for name, tensor in ours.items():
        ref = theirs[name]
        assert tensor.shape == ref.shape and tensor.dtype == ref.dtype, name
        worst[name] = ((tensor - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
        assert (torch.equal(tensor, ref) if bitwise else worst[name] <= REL), (name, worst)
    return worst


class _Stack(nn.Module):
    """The sequence-parallel linears of a block and the output layer: a query projection and a
    key/value projection as one column group (key/value heads replicated over tp / 2 ranks at
    tp 4), an MLP's column (bias) and row (bias) layers, and a vocab-parallel output layer."""

    def __init__(self, mesh, overlap: bool, replicas: int):
        super().__init__()
        torch.manual_seed(0)
        sp = dict(mesh=mesh, sequence_parallel=True, tp_overlap=overlap)
        self.attn = ColumnParallelGroup(
            q=ColumnParallelLinear.from_dense(nn.Linear(16, 16, bias=False), **sp),
            kv=ColumnParallelLinear.from_dense(nn.Linear(16, 8, bias=False), output_blocks=2,
                                               replicas=replicas, **sp))
        self.fc = ColumnParallelLinear.from_dense(nn.Linear(16, 32), **sp)
        self.proj = RowParallelLinear.from_dense(nn.Linear(32, 16), input_is_parallel=True,
                                                 **sp)
        self.head = VocabParallelHead.from_dense(nn.Linear(16, 40, bias=False), **sp)

    def forward(self, x):  # x: [b, s/tp, 16]
        q, kv = self.attn(x)
        h = torch.tanh(self.fc(x)) * q.sum(-1, keepdim=True) + kv.mean(-1, keepdim=True)
        return self.head(x + self.proj(h))


def _layer_run(tp: int, overlap: bool, split_backward: bool):
    """Outputs, gradients and counted communication of `_Stack` on this rank."""
    mesh = worker_mesh(tp=tp)
    stack = _Stack(mesh, overlap, replicas=max(1, tp // 2))
    x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1))
    local = x.chunk(tp, dim=1)[mesh.tp.rank].clone().requires_grad_()
    params = list(stack.parameters())
    weight_grads = defer_weight_gradients(stack) if split_backward else None
    with CommRecorder() as rec:
        logits = stack(local)
        loss = logits.square().sum()
        if weight_grads is not None:  # zero-bubble: I (input gradient) now, W (weights) later
            with weight_grads.deferred() as queued:
                grads = torch.autograd.grad([loss], [local, *params], allow_unused=True)
            assert all(p.grad is None for p in params) and len(queued) == 4
            local.grad = grads[0]
            accumulate_deferred([(p, g) for p, g in zip(params, grads[1:], strict=True)
                                 if g is not None], queued)
        else:
            loss.backward()
    tensors = {"logits": logits.detach(), "input.grad": local.grad}
    tensors |= {f"{name}.grad": p.grad for name, p in stack.named_parameters()}
    return tensors, _counted(rec.records)


def _check_layers(tp: int):
    plain, plain_counts = _layer_run(tp, overlap=False, split_backward=False)
    for split_backward in (False, True):
        ours, counts = _layer_run(tp, overlap=True, split_backward=split_backward)
        assert counts == plain_counts  # the same calls, ops and payload bytes
        worst = _compare(ours, plain, bitwise=tp == 2)
    return worst, plain_counts


@pytest.mark.parametrize("tp", [2, 4])
def test_overlapped_layers_equal_the_unoverlapped_ones(tp):
    """Forward output, input gradient, every weight and bias gradient (fused backward and the
    zero-bubble split one), and the counted communication: the five sequence-parallel matmuls
    each all-gather forward and reduce-scatter backward, and the block linears re-gather their
    input for the weight gradient, exactly as unoverlapped."""
    worst, counts = run_on_ranks(tp, _check_layers, tp)[0]
    assert counts[("all_gather", "tp")][0] == 2 + 2 + 1 + 1  # forward 3 + re-gather 2 + row 1
    assert counts[("reduce_scatter", "tp")][0] == 4
    assert max(worst.values()) <= REL


def _overlapping(model: nn.Module) -> bool:
    """Whether the model's sequence-parallel linears overlap (all of them, or none)."""
    flags = {m.tp_overlap for m in model.modules() if hasattr(m, "tp_overlap")}
    assert len(flags) == 1
    return flags.pop()


def _without_and_with_overlap(make_cfg, mesh, steps):
    """For a run config from `make_cfg()` with sp, without and then with overlap: the losses,
    the counted communication and the final weights."""
    runs = []
    for overlap in (False, True):
        cfg = make_cfg()
        cfg.plan = dataclasses.replace(cfg.plan, sequence_parallel=True, tp_overlap=overlap)
        trainer = Trainer.build(cfg, mesh)
        assert _overlapping(trainer.model) == overlap
        with CommRecorder() as rec:
            losses = [trainer.train_step(step)["loss"] for step in range(steps)]
        runs.append((losses, _counted(rec.records),
                     [p.detach().clone() for p in trainer.model.parameters()]))
    return runs


def _same_weights(weights, reference) -> bool:
    return all(torch.equal(a, b) for a, b in zip(weights, reference, strict=True))


def _trajectory(corpus, out, model, steps):
    """Losses and counted communication of `steps` steps at tp 2 with sp, without and with
    overlap, and whether the weights end equal bit for bit."""
    (plain, plain_counts, plain_weights), (ours, counts, weights) = _without_and_with_overlap(
        lambda: _config(corpus, out, model, steps=steps), worker_mesh(tp=2), steps)
    return plain, ours, plain_counts, counts, _same_weights(weights, plain_weights)


@pytest.mark.parametrize("model", [None, LLAMA], ids=["gpt", "llama"])
def test_training_trajectory_equals_the_unoverlapped_one(corpus, tmp_path, model):
    """tp 2 with sp, 4 micro-batches a step: the loss trajectories equal (bit for bit, as the
    weights after the last step), and each step counts the same calls and bytes."""
    plain, ours, plain_counts, counts, same = run_on_ranks(
        2, _trajectory, corpus, str(tmp_path), model, 4)[0]
    assert ours == plain and same
    assert counts == plain_counts and counts[("all_gather", "tp")][0] > 0


def _zero_bubble(corpus, model, steps):
    from test_pipeline import _cfg

    (plain, plain_counts, plain_weights), (ours, counts, weights) = _without_and_with_overlap(
        lambda: _cfg(corpus, "zb-h1", steps=steps, model=model), worker_mesh(tp=2, pp=2), steps)
    return ours == plain and counts == plain_counts and _same_weights(weights, plain_weights)


def test_zero_bubble_pipeline_with_overlap(corpus):
    """zb-h1 at pp 2 x tp 2 with sp: weight gradients deferred to the W actions (their inputs
    re-gathered there) train bit for bit as without overlap, with the same counted bytes."""
    assert all(run_on_ranks(4, _zero_bubble, corpus, None, 2))


def _compiled(tp: int):
    """A block of overlapped layers under torch.compile (a counting backend that runs the
    graphs as traced): equal to eager, and compiled once, not again on later steps."""
    mesh = worker_mesh(tp=tp)
    torch.manual_seed(0)
    sp = dict(mesh=mesh, sequence_parallel=True, tp_overlap=True)
    block = nn.Sequential(nn.LayerNorm(16),
                          ColumnParallelLinear.from_dense(nn.Linear(16, 32), **sp), nn.GELU(),
                          RowParallelLinear.from_dense(nn.Linear(32, 16), input_is_parallel=True,
                                                       **sp))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, backend=backend)
    counts = []
    for step in range(3):
        x = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(step))
        x = x.chunk(tp, dim=1)[mesh.tp.rank]
        eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager, out = block(eager_x), compiled(compiled_x)
        grads = torch.autograd.grad(eager.square().sum(), [eager_x, *block.parameters()])
        compiled_grads = torch.autograd.grad(out.square().sum(),
                                             [compiled_x, *block.parameters()])
        assert torch.equal(out, eager)
        assert all(torch.equal(a, b) for a, b in zip(grads, compiled_grads, strict=True))
        counts.append(len(graphs))
    assert counts[0] >= 1 and counts == [counts[0]] * 3, counts  # no recompiles


def test_overlapped_layers_compile():
    run_on_ranks(2, _compiled, 2)


@pytest.mark.parametrize("plan,world,code", [
    (ParallelPlan(tp=2, tp_overlap=True), 2, Code.TP_OVERLAP_WITHOUT_SP),
    (ParallelPlan(tp=1, tp_overlap=True), 1, Code.TP_OVERLAP_WITHOUT_SP),
    (ParallelPlan(tp=4, tp_scheme="2d", micro_batch=2, tp_overlap=True), 4,
     Code.TP_OVERLAP_SCHEME),
    (ParallelPlan(tp=8, tp_scheme="3d", micro_batch=4, sequence_parallel=True, tp_overlap=True),
     8, Code.TP_OVERLAP_SCHEME)], ids=["no-sp", "tp-1", "2d", "3d-sp"])
def test_refusals(plan, world, code):
    with pytest.raises(SettingError) as refused:
        plan.validate(preset("tiny"), world_size=world, global_batch=8, seq_len=64)
    assert refused.value.code is code and "tp_overlap" in refused.value.settings


@pytest.mark.parametrize("flags,needle", [
    (["--nproc", "2", "--tp", "2", "--tp-overlap"],
     "--tp-overlap overlaps the all-gather and reduce-scatter of --sequence-parallel: add"
     " --sequence-parallel (with --tp > 1) or drop --tp-overlap"),
    (["--nproc", "4", "--tp", "4", "--tp-scheme", "2d", "--micro-batch", "2",
      "--tp-overlap"], "--tp-scheme 2d's grid layers do not have: use --tp-scheme 1d or drop"
                       " --tp-overlap")])
def test_the_command_line_refuses_in_one_line(capsys, corpus, tmp_path, flags, needle):
    code = main(["train", "--device", "cpu", "--data", corpus, "--out", str(tmp_path / "run"),
                 *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("meshtrain: error: ") and needle in err, err


def test_a_fixed_overlap_searches_sequence_parallel_layouts_only():
    result = _search(fixed={"tp_overlap": True})
    assert result.ranked
    assert all(p.layout.tp_overlap and p.layout.sequence_parallel and p.layout.tp > 1
               and p.layout.tp_scheme == "1d" for p in result.ranked)
    assert "tp_overlap=1" in result.ranked[0].layout.spec()
