"""The decoder-only language model every family shares: token embedding -> transformer blocks
-> final norm -> output layer, built for the part of the model one pipeline stage holds.

A family subclasses `CausalLM` and says how to build its embedding, a block, its final norm and
(untied families) its output layer, from the layers a `LayerFactory` supplies. Everything else -
which stage holds what, running one model chunk of an interleaved schedule, recomputation,
the loss, the roles of the parameters - is written once here.

Layers are kept in a ModuleDict keyed by their global index, so parameter names are the same at
every layout and checkpoints stay logical.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from meshtrain.contracts import AuxiliaryOutputs, ParameterRoles, StageSpec
from meshtrain.errors import Code, SettingError
from meshtrain.models.blocks import generator, init_linear
from meshtrain.models.family import TransformerConfig
from meshtrain.models.kv_cache import KVCache
from meshtrain.parallel.layers.cp_balance import TokenLayout
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.layers.loss import IGNORE_INDEX
from meshtrain.parallel.layers.masks import AttentionMask
from meshtrain.parallel.layers.recompute import recomputed
from meshtrain.parallel.layers.rng import RNGTracker
from meshtrain.parallel.schemes.factory import LayerFactory


class CausalLM(nn.Module, ABC):
    """Token ids `[b, s]` -> this rank's logits `[b, s, V_padded/tp]` (1D scheme).

    A model is given its `factory` (the tensor-parallel scheme's layers on one mesh; see
    `parallelize.build_model` for one from a mesh and plan) and never builds one. `seed` fixes
    the weights, which do not depend on the layout; dropout streams come from
    `RNGTracker.for_mesh`. The config is checked against the layout where the plan is
    validated (`ParallelPlan.validate`), not here.
    """

    family: str  # the registered family name, recorded in checkpoints

    def __init__(self, cfg: TransformerConfig, factory: LayerFactory, *, seed: int = 0,
                 stage: StageSpec | None = None):
        super().__init__()
        mesh = factory.mesh
        self.cfg, self.mesh, self.factory = cfg, mesh, factory
        self.stage = stage = stage or StageSpec((range(cfg.num_layers),))
        # A tied model's last stage holds the word embedding too, as its output layer.
        tied_head = cfg.tie_embeddings and stage.has_head
        self.embedding = self.build_embedding(seed, with_position=stage.has_embedding) \
            if stage.has_embedding or tied_head else None
        self.layers = nn.ModuleDict({str(i): self.build_block(seed, i) for i in stage.layers})
        self.final_norm = self.build_final_norm() if stage.has_head else None
        self.head = self.build_head(seed) if stage.has_head and not cfg.tie_embeddings else None
        self.to(mesh.device)
        self.rng = RNGTracker.for_mesh(mesh, seed)
        self._recomputed_layers = {i for i in stage.layers if factory.recompute_layer(i)}

    @abstractmethod
    def build_embedding(self, seed: int, *, with_position: bool) -> nn.Module:
        """`embedding(ids, positions, rng)` -> hidden states; `.word.logits(hidden)` is the
        tied output layer."""

    @abstractmethod
    def build_block(self, seed: int, index: int) -> nn.Module:
        """Transformer layer `index`: `block(x, rng, positions, aux)`."""

    @abstractmethod
    def build_final_norm(self) -> nn.Module:
        """The norm before the output layer."""

    @abstractmethod
    def build_mlp(self, gen: torch.Generator, width: int | None = None) -> nn.Module:
        """One MLP of `width` (None: the dense one's; also each MoE expert and the shared
        expert), its weights drawn from `gen`."""

    def build_feed_forward(self, seed: int, index: int, gen: torch.Generator) -> nn.Module:
        """Layer `index`'s MLP: routed experts on MoE layers, else `build_mlp(gen)`. This EP
        rank's experts each draw from their own generator, so their weights do not depend on
        ep; the router, then the shared expert and its gate, draw from `gen`."""
        cfg, mesh = self.cfg, self.mesh
        if not cfg.is_moe_layer(index):
            return self.build_mlp(gen)
        router = init_linear(cfg.hidden_size, cfg.moe_experts, cfg.init_std, gen, bias=False)
        per_rank = cfg.moe_experts // mesh.ep.size
        first = mesh.ep.rank * per_rank
        with self.factory.expert_layers():  # rows of tokens; whole at etp 1
            experts = {e: self.build_mlp(generator(seed, 10_000 * (1 + index) + 1 + e),
                                         cfg.expert_ffn_size)
                       for e in range(first, first + per_rank)}
        shared = self.build_mlp(gen, cfg.moe_shared_ffn_size) if cfg.moe_shared_ffn_size \
            else None
        gate = init_linear(cfg.hidden_size, 1, cfg.init_std, gen, bias=False) \
            if cfg.moe_shared_gate == "sigmoid" else None
        return MoE(router, experts, num_experts=cfg.moe_experts, rule=cfg.routing_rule(),
                   aux_loss_coef=cfg.moe_aux_loss_coef, z_loss_coef=cfg.moe_z_loss_coef,
                   mesh=mesh, layer=index, seq_aux_loss_coef=cfg.moe_seq_aux_loss_coef,
                   bias_rate=cfg.moe_bias_rate, global_aux=cfg.moe_aux_loss_scope == "global",
                   gemm=cfg.moe_gemm, shared_expert=shared, shared_expert_gate=gate,
                   sequence_axis=self.factory.sequence_axis)

    def build_head(self, seed: int) -> nn.Module:
        """The untied output layer (`logits(hidden)`); tied families never call this."""
        raise TypeError(f"{type(self).__name__} ties its output layer to the embedding")

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *,
                chunk: int | None = None, aux: AuxiliaryOutputs | None = None,
                cache: KVCache | None = None,
                documents: torch.Tensor | None = None,
                layout: TokenLayout | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states or local logits (last).

        `positions`: the sequence positions of the tokens in `x` (context parallelism holds a
        load-balanced subset); default 0..s-1 for token ids, or from `cache.length` on with a
        cache; rotary families need them for hidden-state input. `chunk`: run only this local
        model chunk (an interleaved pipeline stage), with the embedding if it is the first and
        the head if it is the last; None runs them all. `aux` collects the auxiliary losses and
        statistics of MoE layers. `cache` (eval mode only; see `kv_cache`): the keys and values
        of the tokens before `x`, which the new ones are appended to. `documents`: `[b, S]`
        the document of every token of the whole sequences (packed data): attention stays
        within each; with the layer's window (`layer_window`) it forms its `AttentionMask`.
        `layout`: which of them each context-parallel rank holds, when not head-tail
        (`layers/cp_balance.py`).
        """
        aux = aux if aux is not None else AuxiliaryOutputs()
        chunks = range(len(self.stage.chunks)) if chunk is None else [chunk]
        if cache is not None and self.training:
            raise ValueError("a key/value cache is for generation: call `model.eval()` first")
        if positions is None and x.dim() == 2:
            start = 0 if cache is None else cache.length
            positions = torch.arange(start, start + x.shape[1], device=x.device)
        indices = [i for c in chunks for i in self.stage.chunks[c]]
        masks = {w: AttentionMask(w, documents, layout)
                 for w in map(self.cfg.layer_window, indices)}
        if self.stage.has_embedding and chunks[0] == 0:
            x = self.embedding(x, positions, self.rng)
        for index in indices:
            block, mask = self.layers[str(index)], masks[self.cfg.layer_window(index)]
            if index in self._recomputed_layers and self.training:
                x = recomputed(block, self.rng, x, self.rng, positions, aux, None, mask)
            else:
                x = block(x, self.rng, positions, aux, None if cache is None else cache[index],
                          mask)
        if self.stage.has_head and chunks[-1] == len(self.stage.chunks) - 1:
            x = self.output_layer.logits(self.final_norm(x))
        return x  # logits: [b, s, V_padded/tp]

    def kv_cache(self, capacity: int) -> KVCache:
        """An empty key/value cache of `capacity` tokens (at most `max_seq_len`) for generating
        with this model: `forward(ids, cache=cache)` runs only the new tokens. Whole models at
        any tp only; MoE models with an expert capacity are refused, since it drops tokens by how
        many are routed together, so one token at a time would route differently from the whole
        sequence (dropless routing is per token)."""
        cfg, stage = self.cfg, self.stage
        if not (stage.has_embedding and stage.has_head) or len(stage.layers) < cfg.num_layers:
            problem = "a pipeline stage holds part of the model"
        elif self.factory.splits_sequence:
            problem = "sequence and context parallelism split the sequence over ranks"
        elif self.factory.splits_batch:
            problem = f"`tp_scheme` {self.mesh.tp_scheme} splits each batch over ranks"
        elif cfg.moe_capacity:
            problem = ("`moe_capacity_factor`: expert capacity depends on the tokens routed"
                       " together (0, dropless, caches)")
        elif not 1 <= capacity <= cfg.max_seq_len:
            problem = f"its capacity must be 1 .. `max_seq_len` ({cfg.max_seq_len}), got {capacity}"
        else:
            return KVCache(stage.layers, capacity, window_of=cfg.layer_window)
        raise SettingError(Code.KV_CACHE,
                           f"no key/value cache here: {problem} (generation caches whole models"
                           " at any 1D tp)")

    @property
    def output_layer(self) -> nn.Module:
        return self.head if self.head is not None else self.embedding.word

    def cross_entropy(self, local_logits: torch.Tensor, targets: torch.Tensor, *,
                      ignore_index: int = IGNORE_INDEX,
                      loss_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over the non-ignored tokens (what metrics report), or
        their sum over `loss_tokens` (a count kept over the whole sequence when this rank holds
        part of it)."""
        per_token = self.factory.loss(local_logits, targets, ignore_index=ignore_index)
        if loss_tokens is not None:
            return per_token.sum() / loss_tokens.clamp(min=1)
        return per_token.sum() / (targets != ignore_index).sum().clamp(min=1)

    def loss(self, local_logits: torch.Tensor, targets: torch.Tensor, *,
             aux: AuxiliaryOutputs | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """Training loss: the cross-entropy plus the forward's auxiliary (MoE routing) losses."""
        ce = self.cross_entropy(local_logits, targets, ignore_index=ignore_index)
        return ce if aux is None else ce + aux.loss

    def full_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary, gathered from every rank (generation)."""
        return self.factory.gather_logits(local_logits)[..., :self.cfg.vocab_size]

    def roles(self) -> ParameterRoles:
        experts = {id(p) for m in self.modules() if isinstance(m, MoE)
                   for p in m.experts.parameters()}
        stage = self.stage
        tied = []
        if self.cfg.tie_embeddings and self.embedding is not None \
                and stage.has_embedding != stage.has_head:  # first or last of several stages
            tied = [self.embedding.word.weight]
        blocks = list(self.layers.values())
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        own = [p for p in self.parameters() if id(p) not in in_blocks]
        # one rank holding the lookup and the output layer in different chunks (zb-v)
        reused = [self.embedding.word.weight] if self.cfg.tie_embeddings \
            and stage.has_embedding and stage.has_head and len(stage.chunks) > 1 else []
        return ParameterRoles(
            tied=tied, counted_elsewhere={id(p) for p in tied if not stage.has_embedding},
            experts=experts,
            units=[(self, own), *((block, list(block.parameters())) for block in blocks)],
            reused=reused)
