"""A torch DeviceMesh in (`init_parallel(device_mesh=...)`) and DTensor state dicts out, saved
and resharded by torch.distributed.checkpoint without meshtrain (issue 30, items 1 and 2)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import LLAMA, dense_reference, run_on_ranks, worker_mesh
from test_train import _config
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshtrain import ParallelMesh
from meshtrain.checkpointing.dtensor_state import (
    dtensor_optimizer_state_dict,
    dtensor_state_dict,
    load_dtensor_state_dict,
    placement_notes,
)
from meshtrain.errors import Code, SettingError
from meshtrain.models import preset
from meshtrain.parallel import named_full_tensors
from meshtrain.parallel.layers.sharding import unshard_tensor
from meshtrain.parallel.runtime.process_groups import init_parallel
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

# dcp.load(no_dist=True) in this process says it assumes one process: that is the point
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

def _mesh_on_device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> ParallelMesh:
    """A mesh on a new DeviceMesh's groups (the pool destroys them after the task)."""
    device_mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return init_parallel(device_mesh=device_mesh, device="cpu")


def _train_and_save(corpus, out, model, zero, on_device_mesh):
    """Six steps at tp 2 x dp 2; the DTensor state saved with dcp; losses and full tensors."""
    mesh = (_mesh_on_device_mesh((2, 2), ("dp_shard", "tp")) if on_device_mesh
            else worker_mesh(tp=2, dp=2))
    cfg = _config(corpus, out, model, steps=6)
    cfg.plan = dataclasses.replace(cfg.plan, zero=zero)
    trainer = Trainer.build(cfg, mesh)
    losses = [trainer.train_step(step)["loss"] for step in range(6)]
    sync, net = trainer.parallel.sync, trainer.model
    state = dtensor_state_dict(net, mesh, sync=sync if zero else None)
    optim = dtensor_optimizer_state_dict(sync, net, mesh)
    if on_device_mesh:
        assert mesh.device_mesh.mesh_dim_names == ("dp_shard", "tp")
        assert mesh.tp.group is mesh.device_mesh.get_group("tp")
        assert mesh.dp.group is mesh.device_mesh.get_group("dp_shard")
        dcp.save({"model": state, "optim": optim}, checkpoint_id=f"{out}/dcp")
    # parameters and moments gathered by meshtrain's own code, to compare with what dcp loads
    values, states, _ = sync.export()
    shards = {f"{m}.{n}" if m else n: (s, mod) for m, mod in net.named_modules()
              for n, s in (getattr(mod, "shards", None) or {}).items()}
    full = {name: unshard_tensor(value, *shards[name][:1], _home(shards[name][1]))
            if name in shards else value.detach() for name, value in values.items()}
    if zero < 3:
        for name, tensor in named_full_tensors(net):
            assert torch.equal(tensor, full[name]), name
    moments = {}
    for name, moment in states.items():
        for key in ("exp_avg", "exp_avg_sq"):
            value = moment[key]
            if name in shards:
                spec, module = shards[name]
                value = unshard_tensor(value, spec, _home(module))
            moments[f"{name}.{key}"] = value
    placements = {name: tuple(t.placements) for name, t in state.items()}
    return losses, full, moments, placements, placement_notes(net)


def _home(module):
    return getattr(module, "tp_axis", None) or module.mesh


@pytest.mark.parametrize("model,zero", [(None, 0), (LLAMA, 0), (None, 1), (LLAMA, 3)],
                         ids=["gpt", "llama", "gpt-zero1", "llama-zero3"])
def test_training_on_a_device_mesh_and_dcp_reshards_its_dtensors(corpus, tmp_path, model, zero):
    """tp 2 x dp 2 on a DeviceMesh (dp_shard, tp) trains bitwise as on meshtrain's own groups;
    its DTensor state dict saved by dcp loads into a one-process dense model's tensors,
    bitwise equal to the gathered parameters and Adam moments (ZeRO: gathered over dp)."""
    out = str(tmp_path)
    own = run_on_ranks(4, _train_and_save, corpus, out, model, zero, False)[0]
    losses, full, moments, placements, notes = run_on_ranks(
        4, _train_and_save, corpus, out, model, zero, True)[0]
    assert losses == own[0]
    for name, tensor in full.items():
        assert torch.equal(tensor, own[1][name]), name
    # the true placements on (dp_shard, tp)
    replicated, rows, cols = (Replicate(), Replicate()), (Replicate(), Shard(0)), \
        (Replicate(), Shard(1))
    expected = {"embedding.word.weight": rows, "layers.0.ln1.weight": replicated,
                "layers.0.attn.proj.weight": cols, "layers.0.mlp.proj.weight": cols}
    fused = ["layers.0.attn.qkv.weight", "layers.0.mlp.fc.weight"]  # q/k/v; fc (gpt: one)
    if model is None:
        expected |= {"layers.0.mlp.fc.weight": rows, "layers.0.attn.proj.bias": replicated}
        fused = fused[:1]
    else:  # q alone splits exactly; k/v and gate/up are fused blocks
        expected |= {"layers.0.attn.qkv.q.weight": rows}
        fused = ["layers.0.attn.qkv.kv.weight", "layers.0.mlp.fc.weight"]
    expected |= dict.fromkeys(fused, replicated)
    assert {n: placements[n] for n in expected} == expected
    assert set(fused) <= set(notes)
    assert all(placements[name] == replicated for name in notes)
    # dcp loads the checkpoint into plain tensors of one process, without meshtrain's help
    dense = dense_reference(_config(corpus, out, model))
    state = {"model": {n: torch.zeros_like(p) for n, p in dense.named_parameters()},
             "optim": {n: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                           "step": torch.zeros(())} for n, p in dense.named_parameters()}}
    dcp.load(state, checkpoint_id=f"{out}/dcp", no_dist=True)
    assert set(state["model"]) == set(full)
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, full[name]), name
    for name, entry in state["optim"].items():
        assert entry["step"].item() == 6
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], moments[f"{name}.{key}"]), (name, key)


def _save_initial(out, family_preset, overrides):
    mesh = _mesh_on_device_mesh((2, 2), ("dp_shard", "tp"))
    cfg = preset(family_preset, **overrides)
    model = build_model(cfg, mesh, seed=5)
    state = dtensor_state_dict(model, mesh)
    assert all(isinstance(t, DTensor) for t in state.values())
    dcp.save(state, checkpoint_id=out)
    return {name: tuple(t.shape) for name, t in state.items()}


def _load_at_tp4(out, family_preset, overrides):
    """The tp 2 x dp 2 checkpoint loaded by dcp into the DTensors of a tp 4 model (another
    seed), then gathered: the seed-5 dense weights, bitwise."""
    mesh = worker_mesh(tp=4)
    cfg = preset(family_preset, **overrides)
    model = build_model(cfg, mesh, seed=9)
    state = dtensor_state_dict(model, mesh)
    dcp.load(state, checkpoint_id=out)
    dense = dict(build_model(cfg, ParallelMesh.local(), seed=5).named_parameters())
    wrong = [name for name, tensor in state.items()
             if not torch.equal(tensor.full_tensor(), dense[name].detach())]
    load_dtensor_state_dict(model, mesh, state)  # and into the tp 4 model's own parameters
    return wrong + [name for name, tensor in named_full_tensors(model)
                    if not torch.equal(tensor, dense[name].detach())]


@pytest.mark.parametrize("family_preset,overrides", [
    ("tiny", {"vocab_size": 255}),  # the vocabulary padded to 256 over tp 2
    ("llama-tiny", {"vocab_size": 255, "num_kv_heads": 1}),  # kv heads shared by both tp ranks
], ids=["gpt-vocab-255", "llama-1-kv-head"])
def test_padded_vocabularies_and_shared_kv_heads_save_their_logical_tensors(
        tmp_path, family_preset, overrides):
    """The DTensors have the dense model's shapes (the vocabulary's padding is not saved) and
    load bitwise into the dense model built from the same seed, and into a tp 4 model."""
    shapes = run_on_ranks(4, _save_initial, str(tmp_path), family_preset, overrides)[0]
    dense = build_model(preset(family_preset, **overrides), ParallelMesh.local(), seed=5)
    assert shapes == {n: tuple(p.shape) for n, p in dense.named_parameters()}
    state = {n: torch.full_like(p, float("nan")) for n, p in dense.named_parameters()}
    dcp.load(state, checkpoint_id=str(tmp_path), no_dist=True)
    for name, param in dense.named_parameters():
        assert torch.equal(state[name], param.detach()), name
    # and resharded by dcp onto 4 ranks at tp 4 (255 rows: 64, 64, 64, 63)
    assert run_on_ranks(4, _load_at_tp4, str(tmp_path), family_preset, overrides)[0] == []


def _refusals():
    """Each DeviceMesh meshtrain cannot map, refused with its code (on 4 ranks)."""
    def refused(device_mesh, **degrees):
        try:
            init_parallel(device_mesh=device_mesh, device="cpu", **degrees)
        except SettingError as error:
            assert "\n" not in str(error)
            return error.code, str(error)
        raise AssertionError("accepted")

    grid = torch.arange(4).reshape(2, 2)
    codes = [
        refused(DeviceMesh("cpu", grid, mesh_dim_names=("dp", "ep"))),
        refused(DeviceMesh("cpu", grid, mesh_dim_names=("tp", "dp_shard"))),
        refused(DeviceMesh("cpu", grid, mesh_dim_names=("dp", "dp_shard"))),
        refused(DeviceMesh("cpu", grid.t(), mesh_dim_names=("dp", "tp"))),
        refused(DeviceMesh("cpu", grid, mesh_dim_names=("dp", "tp")), tp=4),
        refused(DeviceMesh("cpu", grid)),
    ]
    # the full torchtitan set of names, in its order, is accepted
    titan = DeviceMesh("cpu", torch.arange(4).reshape(1, 2, 1, 1, 2),
                       mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    mesh = init_parallel(device_mesh=titan, device="cpu", tp=2)
    assert mesh.degrees == {"pp": 1, "dp": 2, "cp": 1, "tp": 2, "ep": 1}
    assert mesh.dp.ranks == (dist.get_rank() % 2, dist.get_rank() % 2 + 2)
    # dp_replicate x dp_shard both > 1: one dp axis over both (meshtrain builds its group)
    hybrid = init_parallel(device_mesh=DeviceMesh("cpu", grid, mesh_dim_names=(
        "dp_replicate", "dp_shard")), device="cpu")
    assert hybrid.degrees["dp"] == 4 and hybrid.dp.ranks == (0, 1, 2, 3)
    assert hybrid.tp.group is None and hybrid.dp.group is not None
    return codes


def test_device_meshes_that_do_not_fit_are_refused_in_one_line():
    codes = run_on_ranks(4, _refusals)[0]
    assert [code for code, _ in codes] == [
        Code.DEVICE_MESH_DIMS, Code.DEVICE_MESH_LAYOUT, Code.DEVICE_MESH_DIMS,
        Code.DEVICE_MESH_LAYOUT, Code.DEVICE_MESH_DEGREES, Code.DEVICE_MESH_DIMS]
    assert "ep=2" in codes[0][1] and "`tp`=4" in codes[4][1]


def _refuse_state(**degrees):
    mesh = worker_mesh(**degrees)
    with pytest.raises(SettingError) as error:
        dtensor_state_dict(torch.nn.Linear(2, 2), mesh)
    return error.value.code


def test_grid_schemes_are_refused():
    assert run_on_ranks(4, _refuse_state, tp=4, tp_scheme="2d")[0] == Code.DTENSOR_LAYOUT


def _save_stages(corpus, out, model):
    mesh = worker_mesh(pp=2, tp=2)
    trainer = Trainer.build(_config(corpus, out, model), mesh)
    state = dtensor_state_dict(trainer.model, mesh)
    dcp.save(state, checkpoint_id=f"{out}/stages")
    return sorted(state), {name: tuple(t.placements) for name, t in state.items()}


@pytest.mark.parametrize("model", [None, LLAMA], ids=["gpt", "llama"])
def test_pipeline_stages_save_their_own_parameters(corpus, tmp_path, model):
    """pp 2 x tp 2: each stage's DTensors live on its (dp, cp, tp) submesh under their own
    names (the tied embedding on both end stages); dcp joins them into the whole dense model."""
    out = str(tmp_path)
    first, last = (run := run_on_ranks(4, _save_stages, corpus, out, model))[0], run[2]
    assert first[0] != last[0]
    assert first[1]["embedding.word.weight"] == (Replicate(), Replicate(), Shard(0))  # dp cp tp
    dense = dense_reference(_config(corpus, out, model))
    state = {n: torch.full_like(p, float("nan")) for n, p in dense.named_parameters()}
    assert set(first[0]) | set(last[0]) == set(state)
    dcp.load(state, checkpoint_id=f"{out}/stages", no_dist=True)
    for name, param in dense.named_parameters():
        assert torch.equal(state[name], param.detach()), name
