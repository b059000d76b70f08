"""meshtrain on torch's DeviceMesh, its weights saved as DTensors by torch.distributed.checkpoint
and read back into a one-process model by dcp alone.

    torchrun --nproc-per-node 2 examples/device_mesh_dcp.py
"""

import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh

import meshtrain
from meshtrain.checkpointing.dtensor_state import dtensor_state_dict, placement_notes

dist.init_process_group("gloo")
device_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "tp"))
mesh = meshtrain.init_parallel(device_mesh=device_mesh, device="cpu")  # tp 2 from the mesh
cfg = meshtrain.preset("llama-tiny", vocab_size=255)  # 255 rows: padded to 256 over tp 2
model = meshtrain.build_model(cfg, mesh, seed=0)
state = dtensor_state_dict(model, mesh)
print(f"rank {mesh.rank}: embedding {state['embedding.word.weight'].placements},"
      f" local rows {state['embedding.word.weight'].to_local().shape[0]} of"
      f" {state['embedding.word.weight'].shape[0]}")
folder = [tempfile.mkdtemp(prefix="meshtrain-dcp-") if mesh.rank == 0 else None]
dist.broadcast_object_list(folder)
dcp.save(state, checkpoint_id=folder[0])
if mesh.rank == 0:
    dense = meshtrain.build_model(cfg, meshtrain.ParallelMesh.local(), seed=0)
    loaded = {name: torch.empty_like(p) for name, p in dense.named_parameters()}
    with warnings.catch_warnings():  # (dcp says it assumes one process: it is meant to)
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, checkpoint_id=folder[0], no_dist=True)  # one process, no meshtrain
    for name, param in dense.named_parameters():
        assert torch.equal(loaded[name], param.detach()), name
    print(f"every one of {len(loaded)} dense weights loaded by dcp matches;"
          f" gathered, not split: {sorted(placement_notes(model))[:2]}...")
dist.barrier()
if mesh.rank == 0:
    shutil.rmtree(folder[0])
meshtrain.destroy_parallel()
