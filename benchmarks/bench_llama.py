"""One Llama training step on two ranks: meshtrain's tensor parallelism against PyTorch DTensor
tensor parallelism applied to the same dense Llama, and against one process.

The model is bench_tp.py's size with the Llama architecture (RMSNorm, rotary positions, SwiGLU,
grouped-query attention with 4 key/value heads, untied output layer). Every contender starts
from meshtrain's dense weights at seed 0 and trains on the same batch with AdamW; repetitions
alternate between contenders (bench_tp.py's machinery: long-lived gloo ranks, one thread each;
the single process runs with two threads).

    python benchmarks/bench_llama.py               # hidden 512, 4 layers, s=256, V=8192, b=8
    python benchmarks/bench_llama.py --quick       # tiny sizes: a smoke run
    python benchmarks/bench_llama.py --only meshtrain-tp2,single --rounds 3

megatron-core's GPTModel (which has a Llama configuration) needs CUDA, so it is not a contender
here.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_tp import (
    WORLD,
    Contender,
    MeshtrainTP,
    SingleProcess,
    Step,
    dtensor_tp_step,
    main,
)
from torch import nn

import meshtrain

FLOP_FORMULA = (
    "FLOPs/step = b*s*(6*(L*(2h*a*d + 2h*g*d + 3h*f) + h*V) + 12*L*s*a*d)\n"
    "  (LlamaConfig.flops_per_token: 6 FLOPs per weight per token for the q/o projections,"
    " the g key/value heads'\n   k/v projections, SwiGLU's three matrices and the output layer;"
    " attention 12*s*h per layer and token,\n   the causal half counted, as Megatron-LM does;"
    " no recomputation)"
)


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    seq: int
    vocab: int
    batch: int

    def config(self) -> meshtrain.LlamaConfig:
        return meshtrain.LlamaConfig(num_layers=self.layers, hidden_size=self.hidden,
                                     num_heads=self.heads, num_kv_heads=self.kv_heads,
                                     vocab_size=self.vocab, max_seq_len=self.seq)

    @property
    def flop_formula(self) -> str:
        return FLOP_FORMULA

    def flops(self) -> float:
        return self.batch * self.seq * self.config().flops_per_token(self.seq)

    def __str__(self) -> str:
        return (f"Llama L={self.layers} h={self.hidden} heads={self.heads} kv={self.kv_heads}"
                f" ffn={self.config().ffn_size} s={self.seq} V={self.vocab} b={self.batch}")


FULL = LlamaShape(layers=4, hidden=512, heads=8, kv_heads=4, seq=256, vocab=8192, batch=8)
QUICK = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, seq=32, vocab=256, batch=2)


# -------------------------------------------------------------------------------------------
# PyTorch DTensor tensor parallelism on a plain dense Llama
# -------------------------------------------------------------------------------------------

@functools.cache
def dense_weights(shape: LlamaShape) -> dict[str, torch.Tensor]:
    model = meshtrain.build_model(shape.config(), meshtrain.ParallelMesh.local(), seed=0)
    return {name: t.detach() for name, t in model.named_parameters()}


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class DenseLlamaBlock(nn.Module):
    """Llama block in plain torch.nn with separate projections, so ColwiseParallel splits whole
    query and key/value heads and RowwiseParallel sums the output projections."""

    def __init__(self, shape: LlamaShape):
        super().__init__()
        h, d, f = shape.hidden, shape.hidden // shape.heads, shape.config().ffn_size
        self.head_dim = d
        self.ln1, self.ln2 = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.q, self.o = nn.Linear(h, shape.heads * d, bias=False), nn.Linear(h, h, bias=False)
        self.k = nn.Linear(h, shape.kv_heads * d, bias=False)
        self.v = nn.Linear(h, shape.kv_heads * d, bias=False)
        self.gate, self.up = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        # Under TP the projections return this rank's heads only: -1 is the local head count.
        q, k, v = (p(y).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        y = self.ln2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class DenseLlama(nn.Module):
    def __init__(self, shape: LlamaShape):
        super().__init__()
        self.wte = nn.Embedding(shape.vocab, shape.hidden)
        self.blocks = nn.ModuleList(DenseLlamaBlock(shape) for _ in range(shape.layers))
        self.norm = nn.RMSNorm(shape.hidden, eps=1e-5)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        d = shape.hidden // shape.heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.arange(shape.seq).float()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def load_meshtrain_(self, weights: dict[str, torch.Tensor]) -> None:
        w = weights
        state = {"wte.weight": w["embedding.word.weight"], "norm.weight": w["final_norm.weight"],
                 "lm_head.weight": w["head.weight"]}
        for i in range(len(self.blocks)):
            src, dst = f"layers.{i}.", f"blocks.{i}."
            k, v = w[src + "attn.qkv.kv.weight"].chunk(2)
            gate, up = w[src + "mlp.fc.weight"].chunk(2)
            state |= {dst + "ln1.weight": w[src + "ln1.weight"],
                      dst + "ln2.weight": w[src + "ln2.weight"],
                      dst + "q.weight": w[src + "attn.qkv.q.weight"], dst + "k.weight": k,
                      dst + "v.weight": v, dst + "o.weight": w[src + "attn.proj.weight"],
                      dst + "gate.weight": gate, dst + "up.weight": up,
                      dst + "down.weight": w[src + "mlp.proj.weight"]}
        self.load_state_dict(state)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


class DTensorTP(Contender):
    name = "PyTorch DTensor Llama tp=2"
    key = "dtensor-tp2"
    ranks = WORLD

    def build(self, shape: LlamaShape) -> Step:
        model = DenseLlama(shape)
        model.load_meshtrain_(dense_weights(shape))
        return dtensor_tp_step(model, shape, column=("q", "k", "v", "gate", "up"),
                               row=("o", "down"), tied=False)


CONTENDERS: list[Contender] = [MeshtrainTP(), DTensorTP(), SingleProcess()]  # (bench_tp's
# meshtrain contenders build the shape's family)

if __name__ == "__main__":
    assert not dist.is_initialized()
    sys.exit(main(candidates=CONTENDERS, description=__doc__, shapes=(FULL, QUICK)))
