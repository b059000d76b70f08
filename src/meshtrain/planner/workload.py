"""What one rank computes and stores for one micro-batch: the work of a transformer layer, the
embedding and the output layer, split over the layout's tensor- and context-parallel ranks.

Every scheme divides a layer's FLOPs by tp. The plan's scheme says how its hidden states,
saved activations and weights split (`TPScheme.hidden_parts`, `layer_saved_bytes`,
`weight_parts`): 1d replicates the norms, residuals and the hidden states between layers over
tp unless sequence parallelism splits them; 2d, 2.5d and 3d split everything tp ways (hidden
and batch); weights split q^2 ways under 2d and 2.5d (replicated over 2.5d's depth) and q^3
under 3d. Its communication is priced by `costs.py` through the scheme (`TPScheme.layer_comm`).

Counts, not times: FLOPs of each matmul (so small ones can be charged their lower efficiency),
bytes elementwise kernels move, bytes each collective carries, parameters each rank holds. The
cost model (`costs.py`) turns them into seconds on a `Hardware`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from meshtrain.models.family import TransformerConfig, window_keys
from meshtrain.parallel.runtime.plan import ParallelPlan

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRAD_BYTES = 4
"""Gradients are accumulated and reduced in fp32 (`grad_dtype`'s default)."""
DEEPSPEED_REDUCE_BUCKET = 5e8
"""Elements per gradient reduce-scatter of DeepSpeed's ZeRO: its `reduce_bucket_size` default
(DeepSpeed's configuration documentation, "ZeRO Optimizations"). Its `allgather_bucket_size`
(also 5e8) buckets stage 1 and 2's parameter all-gather; stage 3 gathers module by module."""
CAUSAL_FRACTION = 0.5
"""Share of the s x s score and value matmuls a causal kernel computes."""
MOE_IMBALANCE = 1.0
"""The max/mean expert load assumed unless a run's measurement or the user gives one
(`plan --moe-imbalance`): every expert equally busy, the planner's optimistic default."""


@dataclass(frozen=True)
class LayerWork:
    """One transformer layer's forward for one micro-batch on one rank."""

    weight_matmuls: tuple[float, ...]
    """FLOPs of each weight matmul (QKV, output projection, the MLP's), in forward order."""
    core_matmuls: float
    """FLOPs of the attention core (scores and their product with the values)."""
    elementwise_bytes: float
    """Bytes norms, activations, residual adds, positions (the family's `pointwise_bytes`:
    eager unless the blocks are compiled) and an eager softmax read and write."""
    parameters: float
    """This rank's share of the layer's parameters."""
    expert_parameters: float = 0.0
    """Of `parameters`: this rank's routed experts' (E / ep of them; split over tp, or whole at
    `etp` 1), which ZeRO shards over their own data-parallel ranks (edp = dp x cp / ep, or
    dp x cp x tp / ep at `etp` 1) rather than dp x cp."""


@dataclass(frozen=True)
class Workload:
    model: TransformerConfig
    layout: ParallelPlan
    seq_len: int
    global_batch: int
    precision: str
    moe_imbalance: float = MOE_IMBALANCE
    """Max/mean rows per expert over a step (a run's `moe_tokens_per_expert_max` / `_mean`)."""

    @property
    def expert_load(self) -> float:
        """The busiest EP rank's expert rows over the mean rank's: the expert imbalance (an
        upper bound on a rank's, exact at one expert a rank), at most the capacity factor where
        one caps each expert's rows; 1 without EP (one rank computes every row)."""
        m = self.model
        if self.layout.ep == 1:
            return 1.0
        if m.moe_capacity_factor:
            return min(self.moe_imbalance, m.moe_capacity_factor)
        return self.moe_imbalance

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.precision]

    @property
    def micro_batches(self) -> int:
        return self.global_batch // (self.layout.micro_batch * self.layout.dp)

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on one rank (context parallelism splits the sequence)."""
        return self.layout.micro_batch * self.seq_len // self.layout.cp

    @property
    def activation_bytes(self) -> float:
        """One full activation [b, s/cp, h] of one micro-batch: what TP collectives carry."""
        return self.local_tokens * self.model.hidden_size * self.element_bytes

    @property
    def hidden_parts(self) -> int:
        """How many ways each TP rank's hidden states between layers are split (SP, or a
        2d/2.5d/3d grid), rather than replicated (`TPScheme.hidden_parts`)."""
        return self.layout.scheme.hidden_parts(self.layout)

    @property
    def weight_parts(self) -> int:
        """How many ways each weight matrix is split: tp, except over 2.5d's depth."""
        return self.layout.scheme.weight_parts(self.layout.tp_grid)

    @property
    def boundary_bytes(self) -> float:
        """What a pipeline stage sends its neighbour per micro-batch (split by SP or a grid)."""
        return self.activation_bytes / self.hidden_parts

    def layer(self, index: int) -> LayerWork:
        m, t, tokens = self.model, self.layout.tp, self.local_tokens
        h = m.hidden_size
        attention = m.attention_parameters(weights_only=True)
        mlp = m.mlp_parameters(weights_only=True)
        parameters = m.attention_parameters() + m.mlp_parameters()
        experts = 0
        if m.is_moe_layer(index):
            # this rank's experts, the router and shared expert; each token's k experts' rows
            # (dropless: every choice; the busiest rank's: `expert_load` x the mean)
            parameters = m.attention_parameters() \
                + m.moe_mlp_parameters(experts=m.moe_experts // self.layout.ep)
            experts = m.moe_experts // self.layout.ep \
                * m.mlp_parameters(width=m.expert_ffn_size)
            mlp = m.moe_mlp_parameters(weights_only=True,
                                       experts=m.moe_top_k * self.expert_load)
        weight = tuple(2 * tokens * w / t for w in (attention * 3 / 4, attention / 4,
                                                     mlp / 2, mlp / 2))
        width = m.num_heads * m.head_dim
        ring = self.layout.cp > 1  # hand-written blocks: whole, eager softmax
        core = 4 * tokens * self._keys_per_query(ring) * width / t
        moved = tokens * m.pointwise_bytes(
            hidden=h / self.hidden_parts, tp=t, element_size=self.element_bytes,
            fused=self.layout.compile)
        if m.attention == "eager" or ring:
            moved += 4 * m.num_heads / t * tokens * self.seq_len * self.element_bytes
        # whole experts (etp 1): not split over tp; each rank's k rows of its s/tp tokens
        # at the whole width cost the same FLOPs as k rows of all tokens at 1/tp of it
        parts = self.weight_parts
        if self.layout.whole_experts:
            return LayerWork(weight, core, moved, (parameters - experts) / parts + experts,
                             experts)
        return LayerWork(weight, core, moved, parameters / parts, experts / parts)

    def _keys_per_query(self, ring: bool) -> float:
        """Keys each query's scores are computed for: half the sequence for a causal fused
        kernel, the whole of it for the ring's whole blocks; under a sliding window the keys
        it leaves (the ring skips blocks wholly outside it: blocks of s / cp tokens, or of
        s / (cp / cp_a2a) under hybrid), averaged over the layers with and without it. Every cp
        rank is priced 1/cp of it: head-tail balances causal attention, and packed documents
        under `cp_balance` work are balanced to `TOLERANCE` per micro-batch (measured
        1.00-1.01, docs/benchmarks.md); documents themselves are not priced (the causal work is
        an upper bound on what a document mask leaves)."""
        m, s = self.model, self.seq_len
        full = s * (1.0 if ring else CAUSAL_FRACTION)
        if m.sliding_window is None or m.sliding_window >= s:
            return full
        ring_ranks = self.layout.cp // (self.layout.cp_a2a or 1)
        windowed = min(s, m.sliding_window + s / ring_ranks) if ring else \
            window_keys(m.sliding_window, s)
        return m.windowed_fraction * windowed + (1 - m.windowed_fraction) * full

    @property
    def fused_attention(self) -> bool:
        """Whether the attention core runs as one fused kernel (SDPA without a ring: in 16 bits
        FlashAttention on GPUs); eager attention and the ring's blocks are matmuls."""
        return self.model.attention == "sdpa" and self.layout.cp == 1

    def head_matmul(self) -> float:
        return 2 * self.local_tokens * self.model.hidden_size * self.model.vocab_size \
            / self.layout.tp

    def logits_bytes(self) -> float:
        """fp32 logits of one micro-batch on one rank (the loss works on them in fp32)."""
        return self.local_tokens * self.model.vocab_size / self.layout.tp * 4

    def embedding_parameters(self) -> float:
        return self.model.vocab_size * self.model.hidden_size / self.weight_parts

    def position_parameters(self) -> float:
        """This rank's share of the embedding's tables besides the word table (GPT's learned
        positions): whole under 1d, split along the hidden size (the grid side) on a grid."""
        lay = self.layout
        parts = lay.scheme.hidden_size_parts(lay.tp_grid)
        return sum(math.prod(shape) for shape in self.model.embedding_shapes().values()) / parts

    def layer_activation_bytes(self, index: int) -> float:
        """Bytes layer `index` saves for backward per micro-batch (`layers_activation_bytes`)."""
        return self.layers_activation_bytes([index])

    def layers_activation_bytes(self, layers: Iterable[int]) -> float:
        """Bytes the `layers` save for backward per micro-batch: each the family's tested
        formula (sdpa saves no s x s probabilities, which the eager form without them equals),
        split as the scheme splits it (`TPScheme.layer_saved_bytes`), and an MoE layer its
        expert rows besides (`_expert_rows_bytes`): dense layers, DeepSeek's first ones among
        them, keep a dense layer's."""
        lay, m = self.layout, self.model
        layers = list(layers)
        recompute = "selective" if lay.recompute == "none" and m.attention == "sdpa" \
            else lay.recompute
        saved = lay.scheme.layer_saved_bytes(lay, m, seq_len=self.seq_len // lay.cp,
                                             micro_batch=lay.micro_batch, recompute=recompute,
                                             element_size=self.element_bytes,
                                             dropout=m.dropout > 0)
        moe = sum(m.is_moe_layer(i) for i in layers)
        return len(layers) * saved + moe * self._expert_rows_bytes(recompute)

    def largest_layer_activation_bytes(self) -> float:
        """What the largest layer saves (an MoE layer's where the model has one)."""
        moe = self.model.moe_layer_indices()
        return self.layer_activation_bytes(moe[0] if moe else 0)

    def _expert_rows_bytes(self, recompute: str) -> float:
        """What an MoE layer keeps beyond a dense MLP's: its experts' input rows (a gathered
        copy of the routed tokens, or what the all-to-all delivered) and their outputs until
        the combine's backward, k rows of h per token each, on every TP rank (measured on CPU:
        `benchmarks/plan_memory_vs_measured.py`); and the hidden activations of k expert rows
        per token at the expert width plus the shared expert's, in place of the dense MLP's."""
        m, lay, e = self.model, self.layout, self.element_bytes
        if recompute == "full":
            return 0.0
        tokens = lay.micro_batch * self.seq_len // lay.cp
        rows = m.moe_top_k * self.expert_load * tokens
        # whole experts (etp 1): each tp rank's rows are those of its s/tp tokens, unsplit
        whole = lay.tp if lay.whole_experts else 1
        hidden = sum(m.mlp_activation_bytes(n, width, tp=t, element_size=e)
                     for n, width, t in ((rows / whole, m.expert_ffn_size, lay.tp // whole),
                                         (tokens, m.moe_shared_ffn_size, lay.tp),
                                         (-tokens, m.ffn_size, lay.tp)))
        return 2 * rows / whole * m.hidden_size * e + hidden
