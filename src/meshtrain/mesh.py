"""The device mesh: which ranks work together on which parallel axis.

World size = pp x dp x cp x tp with axis order outer -> inner (pp, dp, cp, tp), so the TP group
is made of consecutive ranks (inside one node when ranks fill nodes in order). Experts (ep) are
carved out of the flattened dp x cp group, split over tp like the dense MLP (etp = tp); at
expert tensor parallelism 1 (etp 1, Megatron's "MoE parallel folding") they are whole and ep is
carved out of the flattened dp x cp x tp group instead. The tensor-parallel block is arranged as its
scheme's grid (named axes and sizes, given by the scheme: `parallel/schemes/`). The mesh owns
every process group; it is passed to whatever communicates and never stored in a module global.
`parallel/runtime/process_groups.init_parallel` builds one from a plan's degrees and scheme.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshtrain.errors import Code, SettingError

AXIS_ORDER = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class MeshAxis:
    """One parallel axis as seen from this rank.

    `group` is None when the axis has size 1: nothing is ever sent over it.
    """

    name: str
    size: int
    rank: int
    ranks: tuple[int, ...]  # global ranks of this rank's group, in axis-rank order
    group: dist.ProcessGroup | None

    def __repr__(self) -> str:
        return f"MeshAxis({self.name}, rank {self.rank} of {self.size}, ranks={list(self.ranks)})"


def resolve_degrees(
    world_size: int, *, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1, ep: int = 1,
    etp: int | None = None,
) -> dict[str, int]:
    """Check the degrees against the world size and derive dp when omitted.

    Pure and cheap, so the CLI calls it before spawning ranks. Raises SettingError naming the
    degrees, the world size and the fix.
    """
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise SettingError(Code.RANGE, f"`{name}` must be a positive integer, got {value!r}")
    if dp is not None and (not isinstance(dp, int) or dp < 1):
        raise SettingError(Code.RANGE, f"`dp` must be a positive integer, got {dp!r}")
    model_parallel = tp * pp * cp
    if dp is None:
        if world_size % model_parallel:
            raise SettingError(
                Code.DEGREES_WORLD,
                f"world size {world_size} is not divisible by tp x pp x cp = {tp} x {pp} x {cp}"
                f" = {model_parallel}: choose degrees whose product divides the number of ranks"
            )
        dp = world_size // model_parallel
    if pp * dp * cp * tp != world_size:
        raise SettingError(
            Code.DEGREES_WORLD,
            f"pp x dp x cp x tp = {pp} x {dp} x {cp} x {tp} = {pp * dp * cp * tp} does not equal"
            f" the world size {world_size}: change the degrees or the number of ranks (`nproc`)"
        )
    _check_expert_degrees(tp=tp, dp=dp, cp=cp, ep=ep, etp=tp if etp is None else etp)
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep}


def _check_expert_degrees(*, tp: int, dp: int, cp: int, ep: int, etp: int) -> None:
    """etp is 1 or tp, and ep x etp divides tp x dp x cp (at etp = tp: ep divides dp x cp)."""
    if etp not in (1, tp):
        raise SettingError(Code.ETP_DEGREE, (
            f"`etp` {etp} must be 1 (whole experts) or `tp` {tp} (experts split like the dense"
            " MLP)"))
    if etp == tp and (dp * cp) % ep:
        raise SettingError(
            Code.EP_DEGREE,
            f"ep={ep} must divide dp x cp = {dp} x {cp} = {dp * cp}: experts are spread over the"
            " data/context-parallel ranks (or set `etp` 1 to spread them over tp too)"
        )
    if (tp * dp * cp) % (ep * etp):
        raise SettingError(Code.EP_DEGREE, (
            f"`ep` x `etp` = {ep} x {etp} must divide tp x dp x cp = {tp} x {dp} x {cp} ="
            f" {tp * dp * cp}: whole experts (`etp` 1) are spread over those ranks"))


def grid_coords(tp_rank: int, grid: dict[str, int]) -> dict[str, int]:
    """A TP rank's coordinate on every grid axis (the first axis outermost)."""
    coords = {}
    for name in reversed(grid):
        coords[name] = tp_rank % grid[name]
        tp_rank //= grid[name]
    return dict(reversed(coords.items()))


def _rank_to_coords(rank: int, degrees: dict[str, int]) -> dict[str, int]:
    coords = {}
    for name in reversed(AXIS_ORDER):
        coords[name] = rank % degrees[name]
        rank //= degrees[name]
    return coords


def _axis_groups(degrees: dict[str, int], varying: tuple[str, ...]) -> list[list[int]]:
    """All rank groups in which the `varying` axes change and the others are fixed.

    Ranks inside a group are ordered with the first varying axis outermost.
    """
    fixed = [n for n in AXIS_ORDER if n not in varying]
    groups: dict[tuple[int, ...], list[int]] = {}
    world = 1
    for n in AXIS_ORDER:
        world *= degrees[n]
    for rank in range(world):
        coords = _rank_to_coords(rank, degrees)
        groups.setdefault(tuple(coords[n] for n in fixed), []).append(rank)
    return list(groups.values())


class ParallelMesh:
    """Process groups and coordinates of this rank on every parallel axis.

    Axes: pp, dp, cp, tp; embed (first and last pipeline stage); pp_grad (the pp groups again,
    for the pipeline's backward traffic); dp_cp (dp x cp flattened: where replicated gradients
    are averaged); ep (expert parallel, consecutive blocks of dp_cp; at `etp` 1 of dp x cp x
    tp) and edp (the ranks of that group holding the same experts); etp (the axis experts are
    split over: tp, or one rank at `etp` 1); zero_shard (the ranks ZeRO shards over:
    consecutive blocks of `dp_shard` x cp of dp_cp, all of dp_cp without hybrid sharding) and
    zero_replica (the ranks at the same place of each block: replicas of one shard);
    `tp_block(size)` for each size dividing tp; the grid axes of the tensor-parallel scheme
    `tp_scheme` (`tp_grid`: tp_row and tp_col for 2d, ...: `TPScheme.grid`), each the ranks of
    one TP block that differ only in that grid coordinate; under hybrid context parallelism
    (`cp_a2a`) the cp axis's two sub-axes: cp_a2a (cp_a2a consecutive cp ranks, innermost
    after tp: the all-to-all inside a node) and cp_ring (the cp ranks at the same place of
    each cp_a2a block: the ring, possibly across nodes), cp rank = cp_ring rank x cp_a2a +
    cp_a2a rank. Build it with `init_parallel`.
    """

    def __init__(self, degrees: dict[str, int], *, rank: int, device: torch.device,
                 tp_scheme: str = "1d", tp_grid: dict[str, int] | None = None,
                 device_mesh=None, reused: dict[str, dist.ProcessGroup] | None = None,
                 dp_shard: int | None = None, cp_a2a: int | None = None,
                 etp: int | None = None):
        self.degrees = dict(degrees)
        # A torch DeviceMesh laid out as these axes (given, or built on first use), and the
        # groups of its dims that serve as axes here (`parallel/runtime/device_mesh.py`).
        self._device_mesh = device_mesh
        self._reused = dict(reused or {})
        self.tp_scheme = tp_scheme
        self.tp_grid = dict(tp_grid or {"tp": degrees["tp"]})
        assert math.prod(self.tp_grid.values()) == degrees["tp"], self.tp_grid
        self.rank = rank
        self.world_size = degrees["pp"] * degrees["dp"] * degrees["cp"] * degrees["tp"]
        self.device = device
        self.coords = _rank_to_coords(rank, degrees)
        self._axes: dict[str, MeshAxis] = {}
        for name in AXIS_ORDER:
            self._add_axis(name, _axis_groups(degrees, (name,)))
        dp_cp_groups = _axis_groups(degrees, ("dp", "cp"))
        self._add_axis("dp_cp", dp_cp_groups)
        self._add_expert_axes(dp_cp_groups, etp)
        self._add_zero_axes(dp_cp_groups, dp_shard)
        if cp_a2a is not None:
            cp_groups = _axis_groups(degrees, ("cp",))
            self._add_axis("cp_a2a", [g[i:i + cp_a2a] for g in cp_groups
                                      for i in range(0, len(g), cp_a2a)])
            self._add_axis("cp_ring", [g[i::cp_a2a] for g in cp_groups for i in range(cp_a2a)])
        # First and last pipeline stage: both hold the tied word embedding.
        pp_groups = _axis_groups(degrees, ("pp",))
        self._add_axis("embed", [[g[0], g[-1]] for g in pp_groups if len(g) > 1]
                       + [[r] for g in pp_groups for r in (g[1:-1] if len(g) > 1 else g)])
        # The pipeline's gradients travel on their own groups: NCCL ignores tags and matches
        # transfers between two ranks in issue order, which is the same on both sides per
        # direction of traffic but not across activations and gradients (interleaved at pp 2).
        self._add_axis("pp_grad", pp_groups)
        # Blocks of consecutive TP ranks (key/value heads shared by tp / kv_heads ranks).
        tp_groups = _axis_groups(degrees, ("tp",))
        for size in range(1, degrees["tp"]):
            if degrees["tp"] % size == 0:
                self._add_axis(f"tp_block{size}", [g[i:i + size] for g in tp_groups
                                                   for i in range(0, len(g), size)])
        if "tp" not in self.tp_grid:
            self._add_grid_axes(tp_groups)
        world_ranks = tuple(range(self.world_size))
        self._axes["world"] = MeshAxis("world", self.world_size, rank, world_ranks,
                                       dist.group.WORLD if self.world_size > 1 else None)

    @classmethod
    def local(cls, device: torch.device | str = "cpu") -> ParallelMesh:
        """A one-rank mesh that never communicates (dense reference models, tools)."""
        return cls(dict.fromkeys(AXIS_ORDER + ("ep",), 1), rank=0, device=torch.device(device))

    def _add_axis(self, name: str, groups: list[list[int]]) -> None:
        # Every rank must call new_group for every group, in the same order. An axis the
        # DeviceMesh already has a group for takes it instead (every rank, so none calls).
        if name in self._reused:
            ranks = next(g for g in groups if self.rank in g)
            group = self._reused[name]
            assert dist.get_process_group_ranks(group) == ranks, (name, ranks)
            self._axes[name] = MeshAxis(name, len(ranks), ranks.index(self.rank), tuple(ranks),
                                        group)
            return
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                mine = MeshAxis(name, len(ranks), ranks.index(self.rank), tuple(ranks), group)
        assert mine is not None, f"rank {self.rank} is in no {name} group"
        self._axes[name] = mine

    def _add_expert_axes(self, dp_cp_groups: list[list[int]], etp: int | None) -> None:
        """ep and edp carved out of dp x cp (experts split over tp: etp = tp), or at etp 1
        (whole experts) out of dp x cp x tp, whose ranks are consecutive, so an ep group fills
        the tp ranks of one dp x cp rank first."""
        self.etp = self.degrees["tp"] if etp is None else etp
        groups = dp_cp_groups if not self.whole_experts \
            else _axis_groups(self.degrees, ("dp", "cp", "tp"))
        ep = self.degrees["ep"]
        self._add_axis("ep", [g[i : i + ep] for g in groups for i in range(0, len(g), ep)])
        self._add_axis("edp", [g[i::ep] for g in groups for i in range(ep)])
        self._axes["etp"] = MeshAxis("etp", 1, 0, (self.rank,), None) if self.whole_experts \
            else self._axes["tp"]

    @property
    def whole_experts(self) -> bool:
        """Whether experts are whole on each rank while the rest is split over tp (etp 1)."""
        return self.etp == 1 and self.degrees["tp"] > 1

    def _add_zero_axes(self, dp_cp_groups: list[list[int]], dp_shard: int | None) -> None:
        """Hybrid sharding's two axes; without it (or at dp_shard = dp) ZeRO's shard axis is
        dp_cp itself and the replica axis has size 1 (no new groups)."""
        self.dp_shard = self.degrees["dp"] if dp_shard is None else dp_shard
        if self.dp_shard == self.degrees["dp"]:
            self._axes["zero_shard"] = self._axes["dp_cp"]
            self._axes["zero_replica"] = MeshAxis("zero_replica", 1, 0, (self.rank,), None)
            return
        block = self.dp_shard * self.degrees["cp"]
        self._add_axis("zero_shard", [g[i:i + block] for g in dp_cp_groups
                                      for i in range(0, len(g), block)])
        self._add_axis("zero_replica", [g[i::block] for g in dp_cp_groups for i in range(block)])

    def _add_grid_axes(self, tp_groups: list[list[int]]) -> None:
        for name in self.tp_grid:
            groups: dict[tuple, list[int]] = {}
            for group in tp_groups:
                for tp_rank, rank in enumerate(group):
                    others = grid_coords(tp_rank, self.tp_grid) | {name: -1}
                    groups.setdefault((group[0], *others.values()), []).append(rank)
            self._add_axis(name, list(groups.values()))

    @property
    def device_mesh(self):
        """This layout as a `torch.distributed.DeviceMesh` with dims (pp, dp, cp, tp): the one
        `init_parallel` was given, else one built on first use (a collective: call it on every
        rank; it creates torch's own groups for the dims)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._device_mesh = init_device_mesh(
                self.device.type, tuple(self.degrees[n] for n in AXIS_ORDER),
                mesh_dim_names=AXIS_ORDER)
        return self._device_mesh

    def tp_coords(self, tp_rank: int | None = None) -> dict[str, int]:
        """Grid coordinates of TP rank `tp_rank` (default: this rank's)."""
        return grid_coords(self.tp.rank if tp_rank is None else tp_rank, self.tp_grid)

    @property
    def layout(self) -> dict:
        """The degrees, and the tensor-parallel grid when it is not 1D (checkpoints record
        it: RNG streams are restored only into the same layout)."""
        degrees = self.degrees | ({"etp": 1} if self.whole_experts else {})
        if tuple(self.tp_grid) == ("tp",):
            return degrees
        return degrees | {"tp_scheme": self.tp_scheme, "tp_grid": dict(self.tp_grid)}

    def axis(self, name: str) -> MeshAxis:
        return self._axes[name]

    @property
    def process_groups(self) -> set:
        """The torch process groups this mesh holds: its axes', and its DeviceMesh's once built
        (what a process that builds meshes again and again may destroy once it drops one)."""
        groups = {axis.group for axis in self._axes.values() if axis.group is not None}
        if self._device_mesh is not None:
            groups.update(self._device_mesh.get_all_groups())
        return groups

    def tp_block(self, size: int) -> MeshAxis:
        """The `size` consecutive TP ranks around this one (size divides tp)."""
        return self.tp if size == self.tp.size else self._axes[f"tp_block{size}"]

    # The axes everything communicates over, by name.
    tp = property(lambda self: self._axes["tp"])
    pp = property(lambda self: self._axes["pp"])
    dp = property(lambda self: self._axes["dp"])
    cp = property(lambda self: self._axes["cp"])
    dp_cp = property(lambda self: self._axes["dp_cp"])
    ep = property(lambda self: self._axes["ep"])
    world = property(lambda self: self._axes["world"])

    def __repr__(self) -> str:
        d = self.degrees
        return (
            f"ParallelMesh(world={self.world_size}, pp={d['pp']}, dp={d['dp']}, cp={d['cp']},"
            f" tp={d['tp']} ({self.tp_scheme}), ep={d['ep']}, rank={self.rank},"
            f" coords={self.coords})"
        )
