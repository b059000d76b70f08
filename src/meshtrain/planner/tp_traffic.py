"""Tensor-parallel traffic of each scheme: bytes per rank (averaged over its group, as
`comm.CommRecord.ring_bytes` counts them) and the collective steps that pay latency, per
transformer layer and micro-batch of B tokens (b s on this TP block), element size e.

Per linear h_in -> h_out (a layer has four: GPT h->3h, h->h, h->f, f->h; Llama h->(a+2kv)d,
ad->h, h->2f, f->h):

- 1d (Megatron, t ranks): per layer, not per linear: two all-reduces of B h e forward and two
  backward, 8 (t-1)/t B h e in all.
- 2d and 2.5d (SUMMA on q x q, replicated over depth d): forward broadcasts the q input blocks
  along rows and the q weight blocks along columns, (q-1)/q^2 (B h_in / d + h_in h_out) e;
  backward broadcasts both again and reduces the input and weight gradients: twice that.
  Per optimizer step, 2.5d also all-reduces the weight gradients over depth,
  2 (d-1)/d x the rank's weights (dense / q^2) x the gradient element size.
- 3d (q x q x q): forward all-gathers the input and the weight and reduce-scatters the output,
  (q-1)/q^3 (B h_in + h_in h_out + B h_out) e; backward gathers input and weight again, gathers
  the output gradient and reduce-scatters the input and weight gradients,
  (q-1)/q^3 (2 B h_in + B h_out + 2 h_in h_out) e.

Each broadcast, reduce, all-gather or reduce-scatter over g ranks is g - 1 ring steps, an
all-reduce 2 (g - 1). Left out: the norms' statistics all-reduces of 2d/2.5d/3d (B / batch
split floats over one grid axis: latency, a few bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.mesh import resolve_tp_grid
from meshtrain.models.family import TransformerConfig


@dataclass(frozen=True)
class Traffic:
    """What one rank moves for one micro-batch, forward and backward."""

    forward_bytes: float = 0.0
    backward_bytes: float = 0.0
    forward_steps: int = 0
    backward_steps: int = 0

    @property
    def total_bytes(self) -> float:
        return self.forward_bytes + self.backward_bytes

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.forward_bytes + other.forward_bytes,
                       self.backward_bytes + other.backward_bytes,
                       self.forward_steps + other.forward_steps,
                       self.backward_steps + other.backward_steps)


def layer_linears(model: TransformerConfig) -> tuple[tuple[int, int], ...]:
    """(h_in, h_out) of a layer's four linears: QKV, output projection, the MLP's two (a gated
    MLP's gate and up projections as one h -> 2f)."""
    h, f = model.hidden_size, model.ffn_size
    width = model.num_heads * model.head_dim
    qkv = model.attention_parameters(weights_only=True) // h - width
    first = (model.mlp_parameters(weights_only=True) // (h * f) - 1) * f
    return (h, qkv), (width, h), (h, first), (f, h)


def megatron_layer(tokens: int, hidden: int, t: int, e: int) -> Traffic:
    """1d: two all-reduces of the layer's [B, h] activation each way."""
    moved = 2 * 2 * (t - 1) / t * tokens * hidden * e
    return Traffic(moved, moved, 2 * 2 * (t - 1), 2 * 2 * (t - 1))


def summa_linear(tokens: int, h_in: int, h_out: int, q: int, d: int, e: int) -> Traffic:
    """2d (d = 1) and 2.5d: q broadcasts of input and weight blocks forward; backward broadcasts
    them again and reduces the input and weight gradients."""
    forward = (q - 1) / q**2 * (tokens * h_in / d + h_in * h_out) * e
    return Traffic(forward, 2 * forward, 2 * q * (q - 1), 4 * q * (q - 1))


def depth_gradient_bytes(rank_weights: float, d: int, grad_bytes: int) -> float:
    """2.5d, once per optimizer step: the weight gradients (the dense weights / q^2 each rank
    holds) all-reduced over the d depth layers, which saw different tokens."""
    return 2 * (d - 1) / d * rank_weights * grad_bytes


def cube_linear(tokens: int, h_in: int, h_out: int, q: int, e: int) -> Traffic:
    """3d: gather input and weight, reduce-scatter the output; backward gathers input, weight
    and output gradient, and reduce-scatters the input and weight gradients."""
    share = (q - 1) / q**3 * e
    forward = share * (tokens * h_in + h_in * h_out + tokens * h_out)
    backward = share * (2 * tokens * h_in + tokens * h_out + 2 * h_in * h_out)
    return Traffic(forward, backward, 3 * (q - 1), 5 * (q - 1))


def linear_traffic(scheme: str, grid: dict[str, int], tokens: int, h_in: int, h_out: int,
                   e: int) -> Traffic:
    """One linear of a 2d, 2.5d or 3d grid (`mesh.resolve_tp_grid`'s axes)."""
    if scheme == "3d":
        return cube_linear(tokens, h_in, h_out, grid["tp_input"], e)
    return summa_linear(tokens, h_in, h_out, grid["tp_col"], grid.get("tp_depth", 1), e)


def summa_logits(tokens: int, hidden: int, vocab: int, q: int, d: int, e: int) -> Traffic:
    """2d/2.5d output layer (`summa_layers._SummaLogits`): q broadcasts of table blocks and q
    reduces of logit blocks forward; backward broadcasts the logits' gradient and the table
    blocks and reduces the table gradient: (q-1)/q^2 (2 B V/d + 3 V h) e in all."""
    share = (q - 1) / q**2 * e
    forward = share * (vocab * hidden + tokens * vocab / d)
    backward = share * (tokens * vocab / d + 2 * vocab * hidden)
    return Traffic(forward, backward, 2 * q * (q - 1), 3 * q * (q - 1))


def output_traffic(scheme: str, grid: dict[str, int], tokens: int, hidden: int, vocab: int,
                   e: int) -> Traffic:
    """The output layer of a 2d, 2.5d or 3d grid (3d: a linear h -> vocab)."""
    if scheme == "3d":
        return cube_linear(tokens, hidden, vocab, grid["tp_input"], e)
    return summa_logits(tokens, hidden, vocab, grid["tp_col"], grid.get("tp_depth", 1), e)


def layer_traffic(model: TransformerConfig, *, tp: int, scheme: str, depth: int | None,
                  tokens: int, e: int) -> Traffic:
    """One transformer layer's TP traffic per micro-batch (1d without sequence parallelism)."""
    if scheme == "1d":
        return megatron_layer(tokens, model.hidden_size, tp, e)
    grid = resolve_tp_grid(tp, scheme, depth)
    total = Traffic()
    for h_in, h_out in layer_linears(model):
        total += linear_traffic(scheme, grid, tokens, h_in, h_out, e)
    return total
