"""The seam between model families and tensor-parallel schemes.

A model family names the layers it needs (a linear whose output features are split, one whose
input features are split, the vocabulary embedding and output layer, an attention core, whether
a layer is recomputed) and a `LayerFactory` supplies them for one scheme. Megatron's 1D scheme
(with sequence parallelism, context-parallel attention and recomputation) is
`megatron1d.Megatron1D`; another scheme is another subclass (`scheme.TPScheme.factory` gives
it), and no model file changes.

Every layer is made from the dense layer it replaces, so a model built under seed S holds this
rank's slice of the dense model built under seed S at every layout.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

import torch
from torch import nn

from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.layers.attention import AttentionCore
from meshtrain.parallel.layers.norms import HeadNorm, RMSNorm


class LayerFactory(ABC):
    """What a model asks of a tensor-parallel scheme. `mesh` is the mesh the layers use; the
    plan gives every scheme its attention core's options and what is recomputed."""

    def __init__(self, plan, mesh: ParallelMesh):
        self.mesh = mesh
        self.cp_mode = plan.cp_mode
        self.recompute, self.recompute_layers = plan.recompute, plan.recompute_layers

    @abstractmethod
    def column(self, dense: nn.Linear, *, blocks: int = 1, heads: int | None = None) -> nn.Module:
        """A linear layer whose output features are split (attention heads, MLP width); its
        input is the hidden states. `blocks`: equal blocks split separately (q, k, v of a
        fused projection); `heads`: how many attention heads each block holds, never to be cut
        (grouped key/value heads fewer than the ranks are shared instead)."""

    @abstractmethod
    def column_group(self, **layers: nn.Module) -> nn.Module:
        """`column` layers of one input computed together (one communication of the input);
        the module returns their outputs in the order given."""

    @abstractmethod
    def row(self, dense: nn.Linear) -> nn.Module:
        """A linear layer taking a `column` layer's split output back to hidden states."""

    @abstractmethod
    def vocab_embedding(self, dense: nn.Embedding) -> nn.Module:
        """Token ids -> hidden states; its `logits(hidden)` serves as a tied output layer."""

    def replicated(self, dense: nn.Module) -> nn.Module:
        """A layer every tensor-parallel rank holds whole, applied to this rank's hidden states
        (multi-head latent attention's down-projections and their norms); schemes whose hidden
        states are split along the hidden size have none (`capabilities` refuses MLA there)."""
        raise TypeError(f"{type(self).__name__} has no whole layers on split hidden states")

    def into_heads(self, x: torch.Tensor) -> torch.Tensor:
        """A `replicated` layer's output `[b, s, n]` entering the heads' region as a
        column-parallel layer's input would: whole sequence, gradient summed over the ranks."""
        raise TypeError(f"{type(self).__name__} has no whole layers on split hidden states")

    def position_embedding(self, dense: nn.Embedding) -> nn.Module:
        """A learned position table: positions -> their embeddings, in the layout of the hidden
        states' last dimension (whole under 1D)."""
        return dense

    @property
    def head_parts(self) -> int:
        """How many ways attention heads are split (the model's head counts must divide)."""
        return self.mesh.tp.size

    @abstractmethod
    def vocab_head(self, dense: nn.Linear) -> nn.Module:
        """An untied output layer: hidden states -> this rank's logits (`logits(hidden)`)."""

    @abstractmethod
    def norm(self, dense: nn.Module) -> nn.Module:
        """A LayerNorm or RMSNorm over the hidden size."""

    def head_norm(self, dense: RMSNorm) -> nn.Module:
        """An RMSNorm over each head's dimension, shared by all heads: whole on every rank, its
        gradient summed over the TP block, whose ranks attend different heads or tokens (in
        every scheme)."""
        return HeadNorm(dense, partial=("tp",))

    def attention_core(self, *, dropout: float, eager: bool) -> nn.Module:
        """softmax(q k^T / sqrt(d)) v, causal, over this rank's heads: `core(q, k, v, rng)`
        with q `[b, heads, s, d]` and k, v `[b, kv heads, s, d]` (context-parallel over cp)."""
        split = (self.mesh.axis("cp_a2a"), self.mesh.axis("cp_ring")) \
            if self.cp_mode == "hybrid" else None
        return AttentionCore(dropout=dropout, eager=eager, cp_axis=self.mesh.cp,
                             cp_mode=self.cp_mode, recompute=self.recompute == "selective",
                             cp_split=split)

    def recompute_layer(self, index: int) -> bool:
        """Whether transformer layer `index` is recomputed in backward."""
        limit = self.recompute_layers
        return self.recompute == "full" and (limit is None or index < limit)

    @abstractmethod
    def loss(self, logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int) -> torch.Tensor:
        """Per-token cross-entropy of this rank's logits (0 where ignored)."""

    @abstractmethod
    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's logits -> logits over the whole (padded) vocabulary (generation)."""

    @abstractmethod
    def hidden_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions of the tokens in this rank's hidden states, given those of its input."""

    @property
    @abstractmethod
    def hidden_stream(self) -> str:
        """The RNG stream dropout on hidden states draws from (random.py)."""

    @property
    @abstractmethod
    def splits_sequence(self) -> bool:
        """Whether a rank's layers see only part of the sequence (sequence or context
        parallelism): a key/value cache, which appends whole tokens, cannot be used then."""

    @property
    def sequence_axis(self) -> MeshAxis | None:
        """The axis the hidden states' sequence is split over between layers (sequence
        parallelism), or None."""
        return None

    def expert_layers(self) -> contextlib.AbstractContextManager:
        """Inside it, layers are built as MoE experts: for inputs of whole sequences even where
        the hidden states are split over `sequence_axis` (experts see rows of tokens, not
        sequences), and split over the mesh's `etp` axis (tp, or none at `etp` 1)."""
        return contextlib.nullcontext()

    @property
    def splits_batch(self) -> bool:
        """Whether a rank's layers see only part of the micro-batch (the grid schemes): a
        key/value cache of whole sequences cannot be used then."""
        return False

    @abstractmethod
    def hidden_shape(self, batch: int, tokens: int, hidden: int) -> tuple[int, ...]:
        """Shape of the hidden states this rank holds between layers (and pipeline stages)."""

    @abstractmethod
    def partial_gradients(self, model: nn.Module,
                          exclude: set[int]) -> list[tuple[MeshAxis, list[nn.Parameter]]]:
        """Parameters whose gradient each rank holds only a part of, with the axis to sum it
        over after the data-parallel reduction (`exclude`: ids that never are, e.g. experts)."""
