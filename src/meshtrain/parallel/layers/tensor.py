"""Megatron 1D tensor parallelism: column- and row-parallel linear layers, the vocab-parallel
embedding and output layer (`factory.Megatron1D` builds models from them).

Each layer is built from the dense layer it replaces: a layer created under seed S holds exactly
this rank's slice of the dense layer created under seed S, so a model starts from the same
weights at every tp. `from_dense` shards an existing module; `to_dense` gathers it back.
Each layer describes how its parameters are split in `shards` (see `sharding.py`). Under a
zero-bubble schedule every layer's weight gradient may be deferred (`weight_grads.py`). A layer's
three local matmuls (forward, input gradient, weight gradient) go through its `gemm`: `DENSE`
in the parameters' dtype, or float8 after `fp8.convert_to_float8`; the communication around
them is the same either way (their autograd functions: `linear_functions.py`). With
`tp_overlap` the sequence-parallel layers run their all-gather and reduce-scatter as ring steps
overlapped with chunks of their matmuls (`collective_matmul.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import MeshAxis, ParallelMesh
from meshtrain.parallel.communication import regions
from meshtrain.parallel.layers.linear_functions import (
    DENSE,
    ColumnParallelLinearFn,
    DenseGemm,
    RowParallelLinearFn,
    column_parallel,
    linear,
    overlapped_column,
    overlapped_row,
)
from meshtrain.parallel.layers.sharding import GridPosition, Shard, shard_tensor, unshard_tensor
from meshtrain.parallel.layers.vocab import mask_padding, partial_lookup
from meshtrain.parallel.layers.weight_grads import WeightGradients


def _check_divisible(what: str, size: int, tp: int, blocks: int = 1) -> None:
    if size % (tp * blocks):
        by = f"tp ({tp})" if blocks == 1 else f"{blocks} blocks x tp ({tp})"
        raise SettingError(Code.TP_WIDTH,
                           f"{what} ({size}) must be divisible by {by}: choose a tp that"
                           f" divides it or change the model size")


def _tp_axis(mesh: ParallelMesh | MeshAxis) -> MeshAxis:
    return mesh if isinstance(mesh, MeshAxis) else mesh.tp


def _sharded_copy(cls, dense: nn.Module, mesh, **options) -> nn.Module:
    """Build `cls` on the meta device (no init, no RNG drawn) and fill it from `dense`."""
    with torch.device("meta"):
        layer = cls._like(dense, mesh=mesh, **options)
    layer = layer.to_empty(device=dense.weight.device).to(dense.weight.dtype)
    layer.load_dense_(dense)
    return layer


class _TensorParallelModule(nn.Module):
    shards: dict[str, Shard]
    weight_grads: WeightGradients | None = None
    """Set by a split-backward schedule (`weight_grads.defer_weight_gradients`)."""
    gemm: DenseGemm = DENSE
    """The local matmuls; `fp8.convert_to_float8` sets float8 ones (not a submodule nor a
    buffer: the state dict is the same either way)."""

    @classmethod
    def _like(cls, dense: nn.Linear, *, mesh, **options):
        """An uninitialised layer of `dense`'s shape (overridden by the embedding)."""
        return cls(dense.in_features, dense.out_features, mesh=mesh,
                   bias=dense.bias is not None, **options)

    @classmethod
    def from_dense(cls, module: nn.Module, *, mesh, **options):
        """This rank's slice of the dense `module` (see `_sharded_copy`)."""
        return _sharded_copy(cls, module, mesh, **options)

    def _empty_dense(self) -> nn.Module:
        """An uninitialised dense layer of this one's whole shape (overridden by the
        embedding and the output layer)."""
        return nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                         device=self.weight.device, dtype=self.weight.dtype)

    @torch.no_grad()
    def to_dense(self) -> nn.Module:
        """The whole layer, its split parameters gathered over TP."""
        dense = self._empty_dense()
        for name, param in self.named_parameters(recurse=False):
            shard = self.shards.get(name)
            getattr(dense, name).copy_(param if shard is None
                                       else unshard_tensor(param, shard, self.tp_axis))
        return dense

    @torch.no_grad()
    def load_dense_(self, dense: nn.Module) -> None:
        """Overwrite this layer's parameters with its slice of `dense`."""
        for name, shard in self.shards.items():
            full = getattr(dense, name)
            getattr(self, name).copy_(shard_tensor(full.detach().to(self.weight.device), shard,
                                                   self.tp_axis))
        for name, param in self.named_parameters(recurse=False):
            if name not in self.shards:
                param.copy_(getattr(dense, name))


class ColumnParallelLinear(_TensorParallelModule):
    """Y = X A^T with A split by rows of its `[out, in]` weight: this rank computes out/tp
    features. No communication forward when `gather_output=False`; the input enters through f.
    With `sequence_parallel` the input is `[b, s/tp, in]` and is all-gathered along the sequence
    instead (see `_SequenceParallelLinear`; `tp_overlap`: as ring steps overlapped with chunks of
    the matmul, `_OverlappedColumnLinear`).

    `output_blocks` > 1 treats the output as equal blocks (q, k, v of a fused projection) each
    split over TP, so every rank holds matching rows of each block. `replicas` > 1 splits the
    output tp / replicas ways and gives each part to that many consecutive TP ranks (the
    key/value heads of grouped-query attention when tp exceeds them); their weight gradients are
    partial and must be summed over `mesh.tp_block(replicas)` (the layer factory reports them).
    """

    def __init__(self, in_features: int, out_features: int, *, mesh: ParallelMesh | MeshAxis,
                 bias: bool = True, gather_output: bool = False, output_blocks: int = 1,
                 sequence_parallel: bool = False, replicas: int = 1, tp_overlap: bool = False):
        super().__init__()
        self.tp_axis = _tp_axis(mesh)
        self.sequence_parallel = sequence_parallel and self.tp_axis.size > 1
        self.tp_overlap = tp_overlap and self.sequence_parallel
        if replicas < 1 or self.tp_axis.size % replicas:
            raise ValueError(f"ColumnParallelLinear replicas ({replicas}) must divide tp"
                             f" ({self.tp_axis.size})")
        shard = Shard(0, out_features, out_features, output_blocks, replicas)
        parts = shard.parts(GridPosition.of(self.tp_axis))
        _check_divisible("ColumnParallelLinear out_features", out_features, parts, output_blocks)
        if gather_output and replicas > 1:
            raise ValueError("ColumnParallelLinear cannot gather the output of replicated parts")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.output_blocks = gather_output, output_blocks
        self.weight = nn.Parameter(torch.empty(out_features // parts, in_features))
        self.shards = {"weight": shard}
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // parts))
            self.shards["bias"] = shard
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.load_dense_(nn.Linear(in_features, out_features, bias=bias))

    @property
    def replicas(self) -> int:
        return self.shards["weight"].replicas



    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = column_parallel(x, self.tp_axis, self.sequence_parallel, [self],
                             self.tp_overlap)  # [..., out/tp]
        if not self.gather_output or self.tp_axis.size == 1:
            return y
        y = regions.gather_from_tensor_parallel_region(y, self.tp_axis)  # [..., tp * out/tp]
        if self.output_blocks == 1:
            return y
        # Gathered order is (rank, block, chunk); the dense layer's is (block, rank, chunk).
        lead = y.shape[:-1]
        y = y.view(*lead, self.tp_axis.size, self.output_blocks, -1).transpose(-3, -2)
        return y.reshape(*lead, self.out_features)


class ColumnParallelGroup(nn.Module):
    """Column-parallel layers applied to the same input, computed as one: a single f (or
    sequence-parallel all-gather) and one matmul of their concatenated weights; returns each
    layer's output. Keeps every layer's parameters and sharding under its own name."""

    def __init__(self, **layers: ColumnParallelLinear):
        super().__init__()
        first = next(iter(layers.values()))
        if any(layer.sequence_parallel != first.sequence_parallel or layer.gather_output
               or layer.tp_overlap != first.tp_overlap
               or (layer.bias is None) != (first.bias is None) for layer in layers.values()):
            raise ValueError("ColumnParallelGroup needs layers that differ only in shape")
        for name, layer in layers.items():
            self.add_module(name, layer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        layers = list(self.children())
        y = column_parallel(x, layers[0].tp_axis, layers[0].sequence_parallel, layers,
                             layers[0].tp_overlap)
        return y.split([layer.weight.shape[0] for layer in layers], dim=-1)


class RowParallelLinear(_TensorParallelModule):
    """Y = X A^T with A split by columns of its `[out, in]` weight: each rank multiplies its
    in/tp slice of X and the partial results are summed by g (one all-reduce forward).
    The bias is added once, after the sum. With `sequence_parallel` the sum is a reduce-scatter
    along the sequence and the output `[b, s/tp, out]` (`tp_overlap`: as ring steps overlapped
    with chunks of the matmul, `_OverlappedRowLinear`).

    By default the input is already split over TP (`input_is_parallel`), as a
    `ColumnParallelLinear`'s output is by default: the two compose as `row(act(column(x)))`
    with one all-reduce. With `input_is_parallel=False` the layer takes the full input and
    keeps its own slice. An input of neither width is refused in one line."""

    def __init__(self, in_features: int, out_features: int, *, mesh: ParallelMesh | MeshAxis,
                 bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, tp_overlap: bool = False):
        super().__init__()
        self.tp_axis = _tp_axis(mesh)
        self.sequence_parallel = sequence_parallel and self.tp_axis.size > 1
        self.tp_overlap = tp_overlap and self.sequence_parallel
        tp = self.tp_axis.size
        _check_divisible("RowParallelLinear in_features", in_features, tp)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.shards = {"weight": Shard(1, in_features, in_features)}
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))  # replicated
        else:
            self.register_parameter("bias", None)
        if self.weight.device.type != "meta":
            self.load_dense_(nn.Linear(in_features, out_features, bias=bias))



    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x.shape[-1])
        if not self.input_is_parallel:
            x = regions.scatter_to_tensor_parallel_region(x, self.tp_axis)
        if self.tp_overlap:  # the same, as ring steps behind chunks of the matmul
            y = overlapped_row(x, self.weight, self.tp_axis, self.weight_grads, self.gemm)
        elif self.sequence_parallel:  # summed and split along the sequence: [b, s/tp, out]
            y = regions.reduce_scatter_to_sequence_parallel_region(
                linear(x, self.weight, None, self.weight_grads, self.gemm), self.tp_axis)
        elif self.tp_axis.size > 1:  # summed partials
            y = RowParallelLinearFn.apply(x, self.weight, self.tp_axis, self.weight_grads,
                                           self.gemm)
        else:
            y = linear(x, self.weight, None, self.weight_grads, self.gemm)
        return y if self.bias is None else y + self.bias


    def _check_input(self, width: int) -> None:
        """Refuse an input whose last dim is not the one `input_is_parallel` says."""
        tp, split = self.tp_axis.size, self.input_is_parallel
        expected, other = (self.in_features // tp, self.in_features) if split else \
            (self.in_features, self.in_features // tp)
        if width == expected:
            return
        fix = f"pass `input_is_parallel`={not split}" if width == other else \
            "feed it a ColumnParallelLinear's output (gather_output=False)"
        raise SettingError(Code.LAYER_INPUT,
                           f"RowParallelLinear({self.in_features}, {self.out_features}) with"
                           f" `input_is_parallel`={split} at tp {tp} takes inputs of last dim"
                           f" {expected}, got {width}: {fix}")


class VocabParallelEmbedding(_TensorParallelModule):
    """Embedding with the vocabulary split over TP. The vocabulary is zero-padded to a multiple
    of tp; padded rows are never looked up, and as an output layer their logits are masked, so
    they never receive gradient. Each rank looks up the ids it owns, zeroes the rest, and g sums
    the partial embeddings (one all-reduce of b*s*h; a reduce-scatter along the sequence under
    sequence parallelism)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 mesh: ParallelMesh | MeshAxis, sequence_parallel: bool = False,
                 tp_overlap: bool = False):
        super().__init__()
        self.tp_axis = _tp_axis(mesh)
        self.sequence_parallel = sequence_parallel and self.tp_axis.size > 1
        self.tp_overlap = tp_overlap and self.sequence_parallel  # as an output layer
        tp = self.tp_axis.size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padded_num_embeddings = math.ceil(num_embeddings / tp) * tp
        self.num_local = self.padded_num_embeddings // tp
        self.vocab_start = self.tp_axis.rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim))
        self.shards = {"weight": Shard(0, num_embeddings, self.padded_num_embeddings)}
        if self.weight.device.type != "meta":
            self.load_dense_(nn.Embedding(num_embeddings, embedding_dim))

    @classmethod
    def _like(cls, dense: nn.Embedding, *, mesh, **options):
        return cls(dense.num_embeddings, dense.embedding_dim, mesh=mesh, **options)

    def _empty_dense(self) -> nn.Module:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, device=self.weight.device,
                            dtype=self.weight.dtype)



    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """`[b, s]` ids -> `[b, s, h]`, or this rank's `[b, s/tp, h]` under sequence
        parallelism."""
        if self.tp_axis.size == 1:
            return F.embedding(ids, self.weight)
        out = partial_lookup(ids, self.weight, self.vocab_start)  # [b, s, h] partial
        if self.sequence_parallel:
            return regions.reduce_scatter_to_sequence_parallel_region(out, self.tp_axis)
        return regions.reduce_from_tensor_parallel_region(out, self.tp_axis)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Use the (tied) embedding as the output layer: local logits `[b, s, V_padded/tp]`.

        The input enters through f (or, sequence parallel, an all-gather of `[b, s/tp, h]`), so
        its gradient is summed over TP in backward; padded vocabulary entries get -inf, so they
        take no probability and no gradient. With `tp_overlap` the all-gather runs as ring
        steps behind chunks of the matmul (`_OverlappedColumnLinear`, keeping the gathered
        hidden states for backward as the unoverlapped path does).
        """
        if self.tp_overlap:
            logits = overlapped_column(hidden, self.tp_axis, 1, self.weight_grads, self.gemm,
                                        True, self.weight)
        elif self.sequence_parallel:
            hidden = regions.gather_from_sequence_parallel_region(hidden, self.tp_axis)
            logits = linear(hidden, self.weight, None, self.weight_grads)
        elif self.tp_axis.size > 1:  # f fused: the all-reduce overlaps the weight gradient
            logits = ColumnParallelLinearFn.apply(hidden, self.tp_axis, 1, self.weight_grads,
                                                   self.gemm, self.weight)
        else:
            logits = linear(hidden, self.weight, None, self.weight_grads)
        return mask_padding(logits, self.num_embeddings, self.vocab_start)


class VocabParallelHead(VocabParallelEmbedding):
    """An untied output layer `[V, h]` with the vocabulary split over TP, as the embedding is:
    hidden states -> local logits `[b, s, V_padded/tp]` (see `VocabParallelEmbedding.logits`).
    Built from a dense `nn.Linear(h, V, bias=False)`."""

    @classmethod
    def _like(cls, dense: nn.Linear, *, mesh, **options):
        return cls(dense.out_features, dense.in_features, mesh=mesh, **options)

    def _empty_dense(self) -> nn.Module:
        return nn.Linear(self.embedding_dim, self.num_embeddings, bias=False,
                         device=self.weight.device, dtype=self.weight.dtype)


    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

