"""A layout: the choices the planner searches, as one small value, and the `--layout` spec.

Fields (and their spec keys): tp, pp, dp, cp, ep (degrees), vp (virtual stages per pipeline
rank), mb (micro-batch), zero (stage), sp (Megatron sequence parallelism), recompute
(none/selective/full), schedule (gpipe/1f1b/interleaved/2bw), scheme (the tensor-parallel
scheme: 1d, 2d, 2.5d or 3d) and depth (2.5d's depth; unset: the scheme's default).
A spec such as `tp=8,pp=8,vp=3,mb=1,zero=1,sp=1,recompute=selective` fixes the fields it names;
the planner searches the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schemes.registry import SCHEMES as TP_SCHEMES
from meshtrain.parallel.schemes.registry import tp_scheme
from meshtrain.parallel.schemes.scheme import TPScheme

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "2bw")
SCHEMES = tuple(TP_SCHEMES)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vp: int = 1
    """Virtual stages (model chunks) per pipeline rank: interleaved schedule only."""
    mb: int = 1
    """Micro-batch: sequences per forward/backward on one rank."""
    zero: int = 0
    sp: bool = False
    recompute: str = "none"
    schedule: str = "1f1b"
    scheme: str = "1d"
    depth: int | None = None
    """2.5d's depth d (tp = d q^2); None for the other schemes."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def to_plan(self, *, precision: str = "bf16", grad_dtype: str = "fp32") -> ParallelPlan:
        """The `ParallelPlan` meshtrain trains this layout with."""
        return ParallelPlan(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, ep=self.ep,
                            tp_scheme=self.scheme, tp_depth=self.depth,
                            sequence_parallel=self.sp, pp_schedule=self.schedule,
                            virtual_stages=self.vp, zero=self.zero, recompute=self.recompute,
                            precision=precision, grad_dtype=grad_dtype, micro_batch=self.mb)

    @property
    def tp_scheme(self) -> TPScheme:
        return tp_scheme(self.scheme)

    @property
    def tp_grid(self) -> dict[str, int]:
        """The TP block's grid axes and sizes (raises for a tp the scheme cannot arrange)."""
        return self.tp_scheme.grid(self.tp, self.depth)

    def spec_items(self) -> list[tuple[str, str]]:
        """(key, value) of every field that is set, as a `--layout` spec writes them."""
        return [(f.name, _spec_value(getattr(self, f.name))) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None]

    def spec(self) -> str:
        """This layout as a `--layout` spec (every field that is set)."""
        return ",".join(f"{key}={value}" for key, value in self.spec_items())


def _spec_value(value) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


def parse_layout(spec: str) -> dict[str, object]:
    """The fields a `--layout` spec fixes, typed: `tp=8,sp=1,recompute=selective` ->
    {"tp": 8, "sp": True, "recompute": "selective"}."""
    types = {f.name: f.type for f in dataclasses.fields(Layout)}
    fixed: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or key not in types:
            raise ValueError(f"`layout` item {item!r} is not KEY=VALUE with KEY one of"
                             f" {', '.join(types)}")
        fixed[key] = _parse_value(key, types[key], text.strip())
    return fixed


def _parse_value(key: str, kind: str, text: str) -> object:
    choices = {"recompute": RECOMPUTE, "schedule": SCHEDULES, "scheme": SCHEMES}
    if key in choices:
        if text not in choices[key]:
            raise ValueError(f"`layout` {key}={text} must be one of {', '.join(choices[key])}")
        return text
    if kind == "bool":
        if text not in ("0", "1", "true", "false"):
            raise ValueError(f"`layout` {key}={text} must be 0 or 1")
        return text in ("1", "true")
    if not text.isdigit() or (int(text) < 1 and key != "zero") or int(text) > 1 << 20:
        raise ValueError(f"`layout` {key}={text} must be a positive integer")
    return int(text)
