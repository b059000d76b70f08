"""Text generation from a checkpoint of any layout, at any tensor-parallel degree."""

from __future__ import annotations

from pathlib import Path

import torch

from meshtrain.checkpoint import checkpoint_config, load_checkpoint, read_manifest
from meshtrain.data import decode, encode
from meshtrain.mesh import ParallelMesh, init_parallel
from meshtrain.models import CausalLM, config_from_dict, family_of, get_family


@torch.no_grad()
def generate(model: CausalLM, ids: torch.Tensor, *, max_new_tokens: int, top_k: int = 0,
             temperature: float = 1.0, seed: int = 0) -> torch.Tensor:
    """Extend `ids` `[b, s]` token by token. Greedy when `top_k` is 0. Every TP rank draws with
    the same generator, so all ranks pick the same token."""
    model.eval()
    cfg, mesh = model.cfg, model.mesh
    gen = torch.Generator(device=mesh.device).manual_seed(seed)
    for _ in range(max_new_tokens):
        context = ids[:, -cfg.max_seq_len:]
        logits = model.full_logits(model(context)[:, -1]).float()  # [b, V]
        if top_k == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            values, indices = logits.topk(min(top_k, cfg.vocab_size), dim=-1)
            probs = torch.softmax(values / temperature, dim=-1)
            next_id = indices.gather(-1, torch.multinomial(probs, 1, generator=gen))
        ids = torch.cat([ids, next_id], dim=1)
    return ids


def sample_from_checkpoint(path: Path, *, prompt: str, tp: int, max_new_tokens: int,
                           top_k: int, temperature: float, seed: int,
                           device: str = "auto") -> str | None:
    """Generate text (byte tokenizer); returns it on rank 0 and None on other ranks."""
    manifest = read_manifest(path)
    cfg = config_from_dict(manifest["family"], manifest["model"])
    if cfg.vocab_size != 256:
        raise ValueError(f"sample decodes bytes, but this model's vocabulary is {cfg.vocab_size}:"
                         " it was trained on pre-tokenised data")
    mesh = init_parallel(tp=tp, device=device)
    model = get_family(manifest["family"]).model(cfg, mesh=mesh, seed=0)
    load_checkpoint(path, model=model, mesh=mesh)
    ids = torch.tensor(encode(prompt or "\n").tolist(), dtype=torch.long, device=mesh.device)[None]
    out = generate(model, ids, max_new_tokens=max_new_tokens, top_k=top_k,
                   temperature=temperature, seed=seed)
    return decode(out[0].tolist()) if mesh.rank == 0 else None


def checkpoint_model(path: Path, mesh: ParallelMesh) -> CausalLM:
    """The family's model of a checkpoint of any layout, built for `mesh` and loaded."""
    cfg = checkpoint_config(path)  # (loading verifies the files)
    model = family_of(cfg).model(cfg, mesh=mesh, seed=0)
    load_checkpoint(path, model=model, mesh=mesh)
    return model
