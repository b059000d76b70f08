"""What a DCP checkpoint under torchtitan's names costs against meshtrain's own files, in one
process: `export --format dcp` against `export --format meshtrain` (one safetensors file) of the
same checkpoint, and reading the weights of a model from the DCP export (`load_dcp_weights`:
one DCP read per parameter, rows reordered) against `load_checkpoint` from the checkpoint.
A Llama of about 50 M parameters (200 MB in fp32), random weights.

    python benchmarks/bench_dcp.py
"""

import tempfile
from pathlib import Path

import torch
from checkpoint_verify_cost import times_of  # (benchmarks/ is this script's path)

from meshtrain import ParallelMesh
from meshtrain.checkpointing.checkpoint import load_checkpoint, resolve_checkpoint
from meshtrain.checkpointing.model_files import export_safetensors, write_model_checkpoint
from meshtrain.interop.titan_dcp import export_dcp, load_dcp_weights
from meshtrain.models import preset
from meshtrain.parallelize import build_model

CFG = preset("llama-tiny", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2,
             ffn_hidden_size=1408, vocab_size=32000)


def run() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(CFG, ParallelMesh.local(), seed=0)
        state = {name: p.detach() for name, p in model.named_parameters()}
        write_model_checkpoint(tmp / "run" / "checkpoints", family="llama", cfg=CFG,
                               planned=[(n, t.dtype, tuple(t.shape)) for n, t in state.items()],
                               tensors=state.items(), config_toml="")
        path = resolve_checkpoint(tmp / "run")
        outs = iter(range(100))
        ours = times_of(lambda: export_safetensors(path, tmp / f"m{next(outs)}.safetensors"), 3)
        dcp = times_of(lambda: export_dcp(path, tmp / f"dcp{next(outs)}"), 3)
        mesh = ParallelMesh.local()
        own_load = times_of(lambda: load_checkpoint(path, model=model, mesh=mesh, rng=False), 3)
        dcp_load = times_of(lambda: load_dcp_weights(tmp / "dcp3", model, mesh), 3)  # the 1st dcp
    params = sum(t.numel() for t in state.values()) / 1e6
    print(f"Llama {params:.0f} M parameters, fp32, one thread; best of 3 (all 3 listed)")
    print(f"export: meshtrain safetensors {min(ours):.2f} s, dcp {min(dcp):.2f} s:"
          f" dcp / meshtrain = {min(dcp) / min(ours):.2f}x  {[round(t, 2) for t in ours]}"
          f" {[round(t, 2) for t in dcp]}")
    print(f"weights in: load_checkpoint {min(own_load):.2f} s, load_dcp_weights"
          f" {min(dcp_load):.2f} s: dcp / meshtrain = {min(dcp_load) / min(own_load):.2f}x"
          f"  {[round(t, 2) for t in own_load]} {[round(t, 2) for t in dcp_load]}")


if __name__ == "__main__":
    run()
