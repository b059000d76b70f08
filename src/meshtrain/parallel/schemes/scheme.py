"""What a tensor-parallel scheme is: everything the rest of meshtrain asks of one.

A scheme arranges the tp ranks of a tensor-parallel block as a grid (`grid`: its named axes and
sizes, outer first; 1D is a line), says how that grid splits attention heads, a micro-batch and
each weight, which settings it cannot combine with (`refuses`) and which model shapes it cannot
split (`check`), supplies the layers models are built from (`factory`), and gives the planner
its traffic per layer, per output layer and per optimizer step. The mesh, the plan, the model
builder, generation and the planner all ask the scheme (`registry.tp_scheme(name)`); no code
outside a scheme's own files compares scheme names.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from meshtrain.errors import Code, SettingError
from meshtrain.mesh import ParallelMesh
from meshtrain.parallel.schemes.factory import LayerFactory


@dataclass(frozen=True)
class Traffic:
    """What one rank moves for one micro-batch (or step), forward and backward: bytes per rank
    (averaged over its group, as `comm.CommRecord.ring_bytes` counts them) and the ring steps
    that pay latency (a broadcast, reduce, all-gather or reduce-scatter over g ranks is g - 1
    steps, an all-reduce 2 (g - 1))."""

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


class Clock(Protocol):
    """Seconds of communication over a TP block on one hardware (the planner's
    `collectives.TPClock`): a scheme names what its layers send and which compute each
    collective runs behind, the clock prices it, so no scheme imports the planner."""

    def all_reduce(self, nbytes: float) -> float: ...

    def all_gather(self, nbytes: float) -> float: ...

    def reduce_scatter(self, nbytes: float) -> float: ...

    def traffic(self, traffic: Traffic) -> tuple[float, float]:
        """Forward and backward seconds of `traffic`, none of it hidden."""

    def behind(self, comm: float, window: float) -> float:
        """What stays exposed of `comm` seconds run behind `window` seconds of compute."""

    def ring_behind(self, comm: float, window: float) -> float:
        """What stays exposed of a collective run as ring steps behind a chunked matmul."""


class Waits(NamedTuple):
    """Seconds a rank waits for a scheme's communication per micro-batch: forward, backward, and
    of the backward what a split backward runs at its weight-gradient half (`W`)."""

    forward: float
    backward: float
    weight: float = 0.0


def layer_linears(model) -> tuple[tuple[int, int], ...]:
    """(h_in, h_out) of a transformer layer's four linears (`model` a `TransformerConfig`):
    QKV, output projection, the MLP's two (a gated MLP's gate and up projections as one
    h -> 2f)."""
    h, f = model.hidden_size, model.ffn_size
    width = model.num_heads * model.head_dim
    qkv = model.attention_parameters(weights_only=True) // h - width
    first = (model.mlp_parameters(weights_only=True) // (h * f) - 1) * f
    return (h, qkv), (width, h), (h, first), (f, h)


def integer_root(n: int, power: int) -> int | None:
    """The integer `power`-th root of n, or None."""
    r = round(n ** (1 / power))
    return next((c for c in (r - 1, r, r + 1) if c >= 1 and c ** power == n), None)


class TPScheme(ABC):
    """One tensor-parallel scheme (an instance per scheme, listed in `registry.SCHEMES`)."""

    name: str
    """The `tp_scheme` setting's value."""
    axes: tuple[str, ...]
    """The grid axes of the tensor-parallel block, outer -> inner (tp rank = mixed radix)."""
    refuses: tuple[str, ...] = ()
    """Settings the scheme does not combine with (when on): sequence_parallel, cp, ep,
    moe_experts, split_backward (zero-bubble schedules: its layers cannot defer their
    weight gradients), compile (per-block torch.compile), fp8 (its layers have no float8
    matmuls) and tp_overlap (its layers have no sequence-parallel communication)."""
    takes_depth = False
    """Whether the grid has a depth the `tp_depth` setting chooses (`registry.tp_grid`
    refuses one elsewhere)."""

    @abstractmethod
    def grid(self, tp: int, depth: int | None = None) -> dict[str, int]:
        """Grid axis -> size for `tp` ranks (`depth` only where `takes_depth`); SettingError
        naming the valid tp values otherwise."""

    def forms(self, tp: int, depth: int | None = None) -> bool:
        """Whether `tp` ranks (with `depth`) arrange as this scheme's grid."""
        if depth is not None and not self.takes_depth:
            return False
        try:
            self.grid(tp, depth)
        except SettingError:
            return False
        return True

    def side(self, tp: int, power: int) -> int:
        """The side q of a grid of q^`power` ranks; SettingError naming the valid tp."""
        q = integer_root(tp, power)
        if q is None or q < 2:
            examples = ", ".join(str(k ** power) for k in range(2, 5))
            raise SettingError(Code.GRID_TP, f"`tp_scheme` {self.name} arranges tp as a"
                                             f" q^{power} grid: `tp` {tp} is not one (use"
                                             f" {examples}, ...)")
        return q

    def depth_choices(self, tp: int, *, fixed: bool) -> list[int | None]:
        """The depths a search tries at `tp` (`fixed`: the scheme was asked for by name, so a
        depth that only validation can refuse is still tried)."""
        return [None]

    @abstractmethod
    def head_parts(self, grid: dict[str, int]) -> int:
        """How many ways attention heads (and the MLP width) are split."""

    def batch_parts(self, grid: dict[str, int]) -> int:
        """How many ways a micro-batch is split inside the block."""
        return 1

    def weight_parts(self, grid: dict[str, int]) -> int:
        """How many ways each weight matrix is split (the rest of the block replicates it)."""
        return math.prod(grid.values())

    def allows(self, setting: str) -> bool:
        return setting not in self.refuses

    def check(self, plan, model) -> None:
        """Refuse what this scheme cannot run: settings it does not combine with, shapes it
        cannot split (`plan` a `ParallelPlan`, `model` a `TransformerConfig`)."""
        grid = plan.tp_grid  # (a depth the scheme does not take is refused here)
        for setting, on in (("sequence_parallel", plan.sequence_parallel),
                            ("cp", plan.cp > 1), ("ep", plan.ep > 1),
                            ("moe_experts", bool(model.moe_experts))):
            if on and not self.allows(setting):
                raise SettingError(Code.SCHEME_COMBINATION, (
                    f"`tp_scheme` {self.name} does not combine with `{setting}` (its hidden"
                    f" states are already split over batch and hidden): use `tp_scheme` 1d for"
                    f" `{setting}`"))
        self.check_shapes(plan, model, grid)

    def check_shapes(self, plan, model, grid: dict[str, int]) -> None:  # noqa: B027
        """Shapes beyond the heads and MLP width every scheme splits `head_parts` ways (none
        by default)."""

    @abstractmethod
    def factory(self, plan, mesh: ParallelMesh) -> LayerFactory:
        """The layers of this scheme on `mesh` (whose TP block is this scheme's grid)."""

    @abstractmethod
    def layer_traffic(self, model, grid: dict[str, int], tokens: int, e: int) -> Traffic:
        """One transformer layer's tensor-parallel traffic per micro-batch of `tokens` tokens
        on this block, element size `e` (1D: without sequence parallelism)."""

    def output_traffic(self, grid: dict[str, int], tokens: int, hidden: int, vocab: int,
                       e: int) -> Traffic:
        """The output layer's traffic beyond the loss statistics (1D: none)."""
        return Traffic()

    def step_traffic(self, grid: dict[str, int], rank_weights: float, grad_bytes: int
                     ) -> Traffic:
        """Traffic once per optimizer step, after the data-parallel reduction (2.5D: weight
        gradients summed over depth); `rank_weights` the weights this rank holds."""
        return Traffic()

    # --- what the planner prices (`planner/costs.py`, `planner/workload.py`) ----------------

    @abstractmethod
    def hidden_parts(self, plan) -> int:
        """How many ways each TP rank's share of the hidden states between layers is split
        under `plan` (what a pipeline stage sends, what the norms work on)."""

    @abstractmethod
    def hidden_size_parts(self, grid: dict[str, int]) -> int:
        """How many ways the hidden size is split (GPT's position table with it)."""

    @abstractmethod
    def layer_saved_bytes(self, plan, model, **shape) -> float:
        """Bytes one layer saves for backward on one rank: the family's formula
        (`TransformerConfig.activation_bytes` of `shape`) split as this scheme splits it."""

    @abstractmethod
    def layer_comm(self, plan, model, tokens: int, e: int, clock: Clock, *,
                   weights: Sequence[float], split: bool) -> Waits:
        """One layer's TP communication per micro-batch of `tokens` tokens, element size `e`;
        `weights`: its four weight matmuls' forward seconds (what collectives may run behind);
        `split`: the backward defers its weight gradients (a zero-bubble schedule)."""

    @abstractmethod
    def embedding_comm(self, plan, model, tokens: int, e: int,
                       clock: Clock) -> tuple[float, float]:
        """The embedding's bytes written per micro-batch and its forward communication."""

    @abstractmethod
    def output_comm(self, plan, model, tokens: int, e: int,
                    clock: Clock) -> tuple[float, Waits]:
        """The output layer's input bytes (what its norm reads and writes) and communication."""
