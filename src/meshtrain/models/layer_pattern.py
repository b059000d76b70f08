"""Which layers of a model are of a kind (MoE MLPs today; attention kinds and windowed layers
later): one rule from a layer's index, stated by three settings a family's config names.

A `LayerPattern` is every `every`-th layer (layers every-1, 2*every-1, ...) from layer `first`
on, or an explicit list of layers. Counting, shapes, the model's build and the planner ask it,
never the settings, so a new per-layer setting adds a pattern rather than a second rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshtrain.errors import Code, SettingError


@dataclass(frozen=True)
class LayerPattern:
    """`names`: the settings (every, first, explicit list) that set it, for messages."""

    every: int = 1
    first: int = 0
    layers: tuple[int, ...] | None = None
    names: tuple[str, str, str] = ("every", "first", "layers")

    def matches(self, index: int) -> bool:
        if self.layers is not None:
            return index in self.layers
        return index >= self.first and (index + 1) % self.every == 0

    def indices(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if self.matches(i)]

    def count(self, num_layers: int) -> int:
        return len(self.indices(num_layers))

    def validate(self, num_layers: int) -> None:
        """SettingError naming the setting for a pattern that selects nothing or is out of
        range; a list given with `every` or `first` is refused (two rules for one choice)."""
        every, first, listed = self.names
        if self.every < 1:
            raise SettingError(Code.RANGE, f"`{every}` must be positive, got {self.every}")
        if not 0 <= self.first < num_layers:
            raise SettingError(Code.RANGE, (
                f"`{first}` must be 0 .. num_layers - 1 = {num_layers - 1}, got {self.first}"))
        if self.layers is None:
            return
        if self.every != 1 or self.first:
            raise SettingError(Code.LAYER_PATTERN, (
                f"`{listed}` lists the layers itself: drop `{every}` and `{first}`"))
        if not self.layers or list(self.layers) != sorted(set(self.layers)) \
                or not 0 <= self.layers[0] <= self.layers[-1] < num_layers:
            raise SettingError(Code.LAYER_PATTERN, (
                f"`{listed}` must be increasing layer indices in 0 .. {num_layers - 1}, got"
                f" {list(self.layers)}"))

    def describe(self, num_layers: int) -> str:
        """The layers it selects, in words (the planner's `--explain`)."""
        chosen = self.indices(num_layers)
        if len(chosen) == num_layers:
            return f"all {num_layers} layers"
        return f"{len(chosen)} of {num_layers} layers ({', '.join(map(str, chosen))})"
