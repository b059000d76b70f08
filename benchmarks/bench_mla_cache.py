"""Key/value cache bytes per token of multi-head latent attention against grouped-query and
multi-head attention of the same model, and a measured check on deepseek-v3-tiny: the bytes
its cache buffers hold per token equal the formula, and greedy generation is the same with and
without the cache.

    python benchmarks/bench_mla_cache.py

Per token and layer, in the cache's dtype (bf16: 2 bytes): MLA caches the latent and the shared
rotary key, kv_lora_rank + qk_rope_head_dim numbers, whole on every tensor-parallel rank;
grouped-query attention with g key/value heads caches g x (key dim + value dim), split over tp
(g / tp heads a rank, while g >= tp); multi-head attention is g = heads.
"""

from __future__ import annotations

import torch

from meshtrain import ParallelMesh, build_model, preset
from meshtrain.inference.generate import generate

GROUPS = 8  # Llama-3-70B's key/value heads


def _row(name: str) -> str:
    cfg = preset(name)
    qk, v, layers, e = cfg.head_dim, cfg.v_head_dim, cfg.num_layers, 2
    mla = cfg.cached_bytes_per_token(e)
    gqa = layers * GROUPS * (qk + v) * e
    mha = layers * cfg.num_heads * (qk + v) * e
    return (f"| {name} | {mla:,} | {gqa:,} ({gqa / mla:.1f}x) | {mha:,} ({mha / mla:.1f}x) |"
            f" {mla:,} | {gqa // 8:,} |")


def _measured() -> str:
    """deepseek-v3-tiny in bf16: bytes of its cache buffers per token, and cached generation
    against uncached."""
    cfg = preset("deepseek-v3-tiny", init_std=0.2)
    model = build_model(cfg, ParallelMesh.local(), seed=0).eval().to(torch.bfloat16)
    prompt = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    cache = model.kv_cache(capacity=64)
    with torch.no_grad():
        model(prompt, cache=cache)
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers.values())
    cached = generate(model, prompt, max_new_tokens=32)
    uncached = generate(model, prompt, max_new_tokens=32, use_cache=False)
    return (f"deepseek-v3-tiny bf16: cache buffers {held / 64:.0f} bytes per token (formula"
            f" {cfg.cached_bytes_per_token(2)}); greedy generation of 32 tokens with and without"
            f" the cache equal: {torch.equal(cached, uncached)}")


def main() -> None:
    print("| model | MLA bytes/token | GQA, 8 kv heads | MHA, every head | MLA a rank at tp 8 |"
          " GQA a rank at tp 8 |")
    print("|---|---|---|---|---|---|")
    for name in ("deepseek-v3", "moonlight-16b-a3b", "deepseek-v3-tiny"):
        print(_row(name))
    print(_measured())


if __name__ == "__main__":
    main()
