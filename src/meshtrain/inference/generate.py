"""Text generation from a checkpoint of any layout, at any tensor-parallel degree."""

from __future__ import annotations

from pathlib import Path

import torch

from meshtrain.checkpointing.checkpoint import checkpoint_config, load_checkpoint
from meshtrain.data.tokenization import Tokenizer, TokenizerError
from meshtrain.mesh import ParallelMesh
from meshtrain.models import CausalLM
from meshtrain.parallel.runtime.process_groups import init_parallel
from meshtrain.parallelize import build_model


@torch.no_grad()
def generate(model: CausalLM, ids: torch.Tensor, *, max_new_tokens: int, top_k: int = 0,
             temperature: float = 1.0, seed: int = 0, use_cache: bool = True) -> torch.Tensor:
    """Extend `ids` `[b, s]` token by token. Greedy when `top_k` is 0. Every TP rank draws with
    the same generator, so all ranks pick the same token.

    The context of a step is the last `max_seq_len` tokens. With `use_cache` the prompt runs
    once, filling a key/value cache (`CausalLM.kv_cache`; each TP rank caches its own heads),
    and each later step runs only its new token; without it (the reference the tests compare
    with) every step runs the whole context. Once the sequence outgrows `max_seq_len` the window
    slides, every token's position changes and no cached key or value is valid any more: the
    cache is dropped and each step recomputes the window, so the output stays the uncached one.
    MoE models with an expert capacity always recompute (what a token keeps depends on the
    tokens routed with it); dropless routing is per token, so they cache.
    """
    model.eval()
    cfg, mesh = model.cfg, model.mesh
    gen = torch.Generator(device=mesh.device).manual_seed(seed)
    cache = model.kv_cache(min(cfg.max_seq_len, ids.shape[1] + max_new_tokens)) \
        if use_cache and not cfg.moe_capacity else None
    for _ in range(max_new_tokens):
        if cache is not None and ids.shape[1] > cfg.max_seq_len:
            cache = None  # the window slides from here on
        if cache is not None:
            local_logits = model(ids[:, cache.length:], cache=cache)
        else:
            local_logits = model(ids[:, -cfg.max_seq_len:])
        logits = model.full_logits(local_logits[:, -1]).float()  # [b, V]
        if top_k == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)
        else:
            values, indices = logits.topk(min(top_k, cfg.vocab_size), dim=-1)
            probs = torch.softmax(values / temperature, dim=-1)
            next_id = indices.gather(-1, torch.multinomial(probs, 1, generator=gen))
        ids = torch.cat([ids, next_id], dim=1)
    return ids


def prompt_ids(tokenizer: Tokenizer, prompt: str, vocab_size: int) -> list[int]:
    """The prompt's ids; an empty prompt starts a document (after the end-of-document token, or
    a newline for a tokenizer without one)."""
    ids = tokenizer.encode_prompt(prompt) if prompt else []
    if not ids:
        ids = [tokenizer.eod_id] if tokenizer.eod_id is not None else \
            tokenizer.encode("\n").tolist()
    if max(ids) >= vocab_size:
        raise TokenizerError(f"the prompt holds token id {max(ids)}, past the model's vocabulary of"
                             f" {vocab_size}: the run's tokenizer does not match its model")
    return ids


def sample_from_checkpoint(path: Path, tokenizer: Tokenizer, *, prompt: str, tp: int,
                           max_new_tokens: int, top_k: int, temperature: float, seed: int,
                           device: str = "auto") -> str | None:
    """Generate text, encoded and decoded with `tokenizer` (see
    `tokenization.checkpoint_tokenizer`); returns it on rank 0 and None on other ranks."""
    ids = prompt_ids(tokenizer, prompt, checkpoint_config(path).vocab_size)
    mesh = init_parallel(tp=tp, device=device)
    model = checkpoint_model(path, mesh)
    out = generate(model, torch.tensor(ids, dtype=torch.long, device=mesh.device)[None],
                   max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature,
                   seed=seed)
    return tokenizer.decode(out[0].tolist()) if mesh.rank == 0 else None


def checkpoint_model(path: Path, mesh: ParallelMesh) -> CausalLM:
    """The family's model of a checkpoint of any layout, built for `mesh` and loaded."""
    cfg = checkpoint_config(path)  # (loading verifies the files)
    model = build_model(cfg, mesh, seed=0)
    load_checkpoint(path, model=model, mesh=mesh)
    return model
