"""GPT (GPT-2 architecture) written once, with tensor parallelism part of its construction.

Learned positions, pre-LayerNorm blocks, GeLU MLP of 4h, causal multi-head attention, dropout,
tied input/output embedding. Linear layers are Megatron's column/row-parallel layers: at tp=1
they are ordinary dense layers. Per transformer layer and direction, exactly two all-reduces of
b*s*h over TP: g after the attention output projection and after the MLP (forward), f before the
QKV and the first MLP projection (backward). LayerNorm, dropout and residuals are replicated.

Weights are drawn from a generator seeded per layer, so a layer's weights do not depend on which
other layers this rank builds (pipeline stages) nor on tp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.attention import Attention
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.expert import MoE
from meshtrain.parallel.loss import vocab_parallel_cross_entropy
from meshtrain.parallel.plan import ParallelPlan
from meshtrain.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tensor_parallel_parameters,
)
from meshtrain.random import REPLICATED, TENSOR_PARALLEL, RNGTracker
from meshtrain.recompute import recomputed


@dataclass(frozen=True)
class GPTConfig:
    """Model architecture only: parallel layout lives in the mesh."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int = 50257
    max_seq_len: int = 1024
    ffn_hidden_size: int | None = None
    """Width of the MLP; None means 4 x hidden_size."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    layernorm_eps: float = 1e-5
    init_std: float = 0.02
    attention: Literal["sdpa", "eager"] = "sdpa"
    """sdpa: torch's fused kernel; eager: explicit softmax(QK^T)V (saves the s x s scores)."""
    moe_experts: int = 0
    """Experts per MoE layer; 0 keeps every MLP dense."""
    moe_top_k: int = 1
    """Experts per token: 1 (Switch) or 2 (GShard, weights renormalised)."""
    moe_every: int = 1
    """Every n-th MLP is an MoE layer (layers n-1, 2n-1, ...)."""
    moe_capacity_factor: float = 1.25
    """Capacity per expert: ceil(factor * tokens * k / experts) per micro-batch and rank."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the Switch load-balancing loss."""
    moe_z_loss_coef: float = 0.0
    """Weight of the router z-loss (mean squared log-sum-exp of router logits)."""

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        """Raise ValueError naming the setting for a shape that cannot be built."""
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden size {self.hidden_size} must be divisible by the number of"
                             f" heads {self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention must be 'sdpa' or 'eager', got {self.attention!r}")
        if self.moe_experts < 0:
            raise ValueError(f"--moe-experts must be >= 0, got {self.moe_experts}")
        if self.moe_experts:
            if self.moe_top_k not in (1, 2):
                raise ValueError(f"--moe-top-k must be 1 or 2, got {self.moe_top_k}")
            if self.moe_top_k > self.moe_experts:
                raise ValueError(f"--moe-top-k {self.moe_top_k} exceeds --moe-experts"
                                 f" {self.moe_experts}: use more experts or a smaller k")
            if self.moe_every < 1:
                raise ValueError(f"--moe-every must be positive, got {self.moe_every}")
            if self.moe_capacity_factor <= 0:
                raise ValueError(f"--moe-capacity-factor must be > 0, got"
                                 f" {self.moe_capacity_factor}")
            if self.moe_aux_loss_coef < 0 or self.moe_z_loss_coef < 0:
                raise ValueError("--moe-aux-loss-coef and --moe-z-loss-coef must be >= 0")

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_experts > 0 and (layer + 1) % self.moe_every == 0

    def validate_for_ep(self, ep: int) -> None:
        if ep > 1 and self.moe_experts == 0:
            raise ValueError(f"--ep {ep} needs an MoE model: set --moe-experts")
        if self.moe_experts % ep:
            raise ValueError(f"--moe-experts {self.moe_experts} must be divisible by --ep {ep}:"
                             " each EP rank holds the same number of experts")

    def validate_for_tp(self, tp: int) -> None:
        if self.num_heads % tp:
            raise ValueError(f"the number of heads ({self.num_heads}) must be divisible by tp"
                             f" ({tp}): choose a tp that divides it")
        if self.ffn_size % tp:
            raise ValueError(f"the MLP width ({self.ffn_size}) must be divisible by tp ({tp})")

    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.ffn_size, self.vocab_size
        mlp = (h * f + f) + (f * h + h)
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + mlp
        moe_layers = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        moe_extra = moe_layers * (self.moe_experts * h + (self.moe_experts - 1) * mlp)
        return v * h + self.max_seq_len * h + self.num_layers * per_layer + 2 * h + moe_extra


def _gpt(layers: int, hidden: int, heads: int, **kw) -> GPTConfig:
    return GPTConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, **kw)


PRESETS: dict[str, GPTConfig] = {
    # 4 layers and 4 heads: tp, pp and cp up to 4, and pp 2 x 2 virtual stages, all divide it.
    "tiny": _gpt(4, 64, 4, vocab_size=256, max_seq_len=256),
    "gpt2": _gpt(12, 768, 12),
    "gpt2-medium": _gpt(24, 1024, 16),
    "gpt2-large": _gpt(36, 1280, 20),
    "gpt2-xl": _gpt(48, 1600, 25),
    # Megatron-LM paper (Table 1) sizes.
    "megatron-1.2b": _gpt(40, 1536, 16),
    "megatron-2.5b": _gpt(54, 1920, 20),
    "megatron-4.2b": _gpt(64, 2304, 24),
    "megatron-8.3b": _gpt(72, 3072, 32),
    # GPT-3 paper sizes (head counts made to divide the hidden size where the paper's do not).
    "gpt3-small": _gpt(12, 768, 12, max_seq_len=2048),
    "gpt3-medium": _gpt(24, 1024, 16, max_seq_len=2048),
    "gpt3-large": _gpt(24, 1536, 16, max_seq_len=2048),
    "gpt3-xl": _gpt(24, 2048, 16, max_seq_len=2048),
    "gpt3-2.7b": _gpt(32, 2560, 32, max_seq_len=2048),
    "gpt3-6.7b": _gpt(32, 4096, 32, max_seq_len=2048),
    "gpt3-13b": _gpt(40, 5120, 40, max_seq_len=2048),
    "gpt3-175b": _gpt(96, 12288, 96, max_seq_len=2048),
}


def preset(name: str, **overrides) -> GPTConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def _init_linear(in_f: int, out_f: int, std: float, gen: torch.Generator) -> nn.Linear:
    dense = nn.Linear(in_f, out_f, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        dense.weight.normal_(0.0, std, generator=gen)
        dense.bias.zero_()
    return dense


def _init_embedding(num: int, dim: int, std: float, gen: torch.Generator) -> nn.Embedding:
    dense = nn.Embedding(num, dim, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        dense.weight.normal_(0.0, std, generator=gen)
    return dense


def _generator(seed: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


class Embedding(nn.Module):
    """Token (vocab-parallel) plus learned position embedding, then dropout. Under sequence
    parallelism the output is this TP rank's `[b, s/tp, h]`."""

    def __init__(self, cfg: GPTConfig, mesh: ParallelMesh, seed: int, plan: ParallelPlan, *,
                 with_position: bool = True):
        super().__init__()
        gen = _generator(seed, 0)
        self.word = VocabParallelEmbedding.from_dense(
            _init_embedding(cfg.vocab_size, cfg.hidden_size, cfg.init_std, gen), mesh=mesh)
        # The last pipeline stage keeps only the word table (for the tied output layer).
        self.position = _init_embedding(cfg.max_seq_len, cfg.hidden_size, cfg.init_std, gen) \
            if with_position else None
        self.dropout = cfg.dropout
        self.sequence_parallel = plan.sequence_parallel and mesh.tp.size > 1
        self.tp_axis = mesh.tp

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, rng: RNGTracker,
                stream: str) -> torch.Tensor:
        x = self.word(ids, sequence_parallel=self.sequence_parallel)  # [b, s(/tp), h]
        if self.sequence_parallel:
            positions = positions.chunk(self.tp_axis.size)[self.tp_axis.rank]
        return _dropout(x + self.position(positions), self.dropout, self.training, rng, stream)


def _dropout(x: torch.Tensor, p: float, training: bool, rng: RNGTracker, stream: str):
    if p == 0.0 or not training:
        return x
    with rng.fork(stream):
        return F.dropout(x, p, training=True)


class MLP(nn.Module):
    """h -> 4h (column-parallel, GeLU needs no communication) -> h (row-parallel)."""

    def __init__(self, cfg: GPTConfig, mesh: ParallelMesh, gen: torch.Generator,
                 plan: ParallelPlan):
        super().__init__()
        h, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_std
        sp = plan.sequence_parallel
        self.fc = ColumnParallelLinear.from_dense(_init_linear(h, f, std, gen), mesh=mesh,
                                                  sequence_parallel=sp)
        self.proj = RowParallelLinear.from_dense(
            _init_linear(f, h, std / math.sqrt(2 * cfg.num_layers), gen), mesh=mesh,
            input_is_parallel=True, sequence_parallel=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # fc: [b, s, 4h/tp]


def _moe(cfg: GPTConfig, mesh: ParallelMesh, seed: int, layer: int,
         gen: torch.Generator) -> MoE:
    """An MoE layer holding this EP rank's experts; each expert draws from its own generator,
    so its weights do not depend on ep."""
    h, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_std
    router = nn.Linear(h, cfg.moe_experts, bias=False, device="meta").to_empty(device="cpu")
    with torch.no_grad():
        router.weight.normal_(0.0, std, generator=gen)
    per_rank = cfg.moe_experts // mesh.ep.size
    experts = {}
    for e in range(mesh.ep.rank * per_rank, (mesh.ep.rank + 1) * per_rank):
        expert_gen = _generator(seed, 10_000 * (1 + layer) + 1 + e)
        experts[e] = (_init_linear(h, f, std, expert_gen),
                      _init_linear(f, h, std / math.sqrt(2 * cfg.num_layers), expert_gen))
    return MoE(router, experts, num_experts=cfg.moe_experts, top_k=cfg.moe_top_k,
               capacity_factor=cfg.moe_capacity_factor, mesh=mesh)


class Block(nn.Module):
    """Pre-LayerNorm transformer block; its MLP is routed experts on MoE layers.

    Residual-branch dropout draws from the replicated stream, or under sequence parallelism
    (each TP rank holds different tokens) from the per-TP-rank stream.
    """

    def __init__(self, cfg: GPTConfig, mesh: ParallelMesh, seed: int, layer: int,
                 plan: ParallelPlan):
        super().__init__()
        gen = _generator(seed, 1 + layer)
        h, std = cfg.hidden_size, cfg.init_std
        self.ln1 = nn.LayerNorm(h, eps=cfg.layernorm_eps)
        self.attn = Attention(_init_linear(h, 3 * h, std, gen),
                              _init_linear(h, h, std / math.sqrt(2 * cfg.num_layers), gen),
                              num_heads=cfg.num_heads, dropout=cfg.dropout,
                              eager=cfg.attention == "eager", mesh=mesh, plan=plan)
        self.ln2 = nn.LayerNorm(h, eps=cfg.layernorm_eps)
        self.mlp = _moe(cfg, mesh, seed, layer, gen) if cfg.is_moe_layer(layer) \
            else MLP(cfg, mesh, gen, plan)
        self.dropout = cfg.dropout
        self.stream = TENSOR_PARALLEL if plan.sequence_parallel else REPLICATED

    def forward(self, x: torch.Tensor, rng: RNGTracker) -> torch.Tensor:
        x = x + _dropout(self.attn(self.ln1(x), rng), self.dropout, self.training, rng,
                         self.stream)
        return x + _dropout(self.mlp(self.ln2(x)), self.dropout, self.training, rng, self.stream)


@dataclass
class StageSpec:
    """Which part of the model this rank builds (the whole model without a pipeline): one
    contiguous range of layers per model chunk it holds (several under an interleaved schedule),
    the embedding before its first chunk, the final LayerNorm and head after its last."""

    chunks: tuple[range, ...]
    has_embedding: bool = True
    has_head: bool = True

    @property
    def layers(self) -> list[int]:
        return [i for chunk in self.chunks for i in chunk]


class GPT(nn.Module):
    """GPT whose forward maps token ids `[b, s]` to local logits `[b, s, V_padded/tp]`.

    Layers are kept in a ModuleDict keyed by their global index, so parameter names are the same
    at every layout. `seed` fixes the weights; dropout streams come from `RNGTracker.for_mesh`.
    `plan` chooses sequence parallelism, the context-parallel attention and recomputation.
    """

    def __init__(self, cfg: GPTConfig, *, mesh: ParallelMesh, seed: int = 0,
                 stage: StageSpec | None = None, plan: ParallelPlan | None = None):
        super().__init__()
        cfg.validate()
        cfg.validate_for_tp(mesh.tp.size)
        cfg.validate_for_ep(mesh.ep.size)
        self.cfg, self.mesh = cfg, mesh
        self.plan = plan = plan or ParallelPlan()
        self.stage = stage = stage or StageSpec((range(cfg.num_layers),))
        # The head reuses the word embedding, so a stage with the head holds it too.
        self.embedding = Embedding(cfg, mesh, seed, plan, with_position=stage.has_embedding) \
            if stage.has_embedding or stage.has_head else None
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, mesh, seed, i, plan) for i in stage.layers})
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps) \
            if stage.has_head else None
        self.to(mesh.device)
        self.rng = RNGTracker.for_mesh(mesh, seed)
        self.sequence_parallel = plan.sequence_parallel and mesh.tp.size > 1
        full = plan.recompute == "full"
        limit = cfg.num_layers if plan.recompute_layers is None else plan.recompute_layers
        self._recomputed_layers = {i for i in stage.layers if full and i < limit}

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *,
                chunk: int | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states or local logits (last).

        `positions`: the sequence positions of the tokens in `x` (context parallelism holds a
        load-balanced subset); default 0..s-1. `chunk`: run only this local model chunk (an
        interleaved pipeline stage), with the embedding if it is the first and the head if it is
        the last; None runs them all. Under sequence parallelism hidden states between stages
        and layers are this TP rank's `[b, s/tp, h]`.
        """
        chunks = range(len(self.stage.chunks)) if chunk is None else [chunk]
        if self.stage.has_embedding and chunks[0] == 0:
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            stream = TENSOR_PARALLEL if self.sequence_parallel else REPLICATED
            x = self.embedding(x, positions, self.rng, stream)
        for index in (i for c in chunks for i in self.stage.chunks[c]):
            block = self.layers[str(index)]
            if index in self._recomputed_layers and self.training:
                x = recomputed(block, self.rng, x, self.rng)
            else:
                x = block(x, self.rng)
        if self.stage.has_head and chunks[-1] == len(self.stage.chunks) - 1:
            x = self.embedding.word.logits(self.final_norm(x),
                                           sequence_parallel=self.sequence_parallel)
        return x  # logits: [b, s, V_padded/tp]

    def sequence_parallel_parameters(self) -> list[nn.Parameter]:
        """Parameters applied to s/tp of the tokens under sequence parallelism: their gradients
        are partial sums and must be all-reduced over TP (LayerNorms, row-parallel biases,
        positions). Empty without sequence parallelism."""
        if not self.sequence_parallel:
            return []
        sharded = tensor_parallel_parameters(self)
        experts = self.expert_parameters()
        return [p for p in self.parameters()
                if id(p) not in sharded and id(p) not in experts]

    def loss(self, local_logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int = -100) -> torch.Tensor:
        """Training loss: mean next-token cross-entropy over this batch's non-ignored tokens
        (vocab-parallel) plus the MoE routing losses."""
        return self.cross_entropy(local_logits, targets, ignore_index=ignore_index) \
            + self.routing_loss()

    def cross_entropy(self, local_logits: torch.Tensor, targets: torch.Tensor, *,
                      ignore_index: int = -100) -> torch.Tensor:
        """Mean next-token cross-entropy alone (what metrics and evaluation report)."""
        per_token = vocab_parallel_cross_entropy(local_logits, targets, mesh=self.mesh,
                                                 ignore_index=ignore_index)
        return per_token.sum() / (targets != ignore_index).sum().clamp(min=1)

    def routing_loss(self, chunk: int | None = None) -> torch.Tensor | float:
        """Weighted MoE auxiliary losses of the latest forward (0 for a dense model): of local
        model chunk `chunk` (an interleaved pipeline stage), or of all layers."""
        total = 0.0
        for moe in self.moe_layers(chunk):
            total = total + self.cfg.moe_aux_loss_coef * moe.last_aux_loss
            if self.cfg.moe_z_loss_coef:
                total = total + self.cfg.moe_z_loss_coef * moe.last_z_loss
        return total

    def moe_layers(self, chunk: int | None = None) -> list[MoE]:
        """MoE layers of local model chunk `chunk`, or of all layers this rank holds."""
        indices = self.stage.layers if chunk is None else self.stage.chunks[chunk]
        blocks = [self.layers[str(i)] for i in indices]
        return [block.mlp for block in blocks if isinstance(block.mlp, MoE)]

    def expert_parameters(self) -> set[int]:
        """ids of expert parameters: replicated only over the edp axis, not over dp x cp."""
        return {id(p) for moe in self.moe_layers() for p in moe.experts.parameters()}
