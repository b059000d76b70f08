"""What a model family says about its Hugging Face twin: the base each family's module fills in.

A family's mapping is a module of its own (`hf_gpt2.py`, `hf_llama.py`), entered in
`hf_io.MAPPINGS` by a plain import, rather than methods on the family: models/ sit below interop
and stay free of its code, and a family with no Hugging Face twin has no entry. Reading and
writing the directories themselves is `hf_io.py`'s, once for every family.

Config fields are named in double quotes as config.json spells them (they are not meshtrain
settings, so they are not backticked).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from meshtrain.errors import Code, SettingError
from meshtrain.models import TransformerConfig

_REQUIRED = object()


@dataclass(frozen=True)
class TensorMap:
    """One of our logical tensors and the Hugging Face tensors it is made of: theirs, each
    transposed when `transpose` (GPT-2's Conv1D stores weights [in, out]), joined along the first
    dimension (Llama's k|v and gate|up). Both directions are exact, so a round trip is bitwise."""

    ours: str
    theirs: tuple[str, ...]
    transpose: bool = False

    def to_ours(self, parts: list[torch.Tensor]) -> torch.Tensor:
        parts = [part.t() if self.transpose else part for part in parts]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()

    def to_theirs(self, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        parts = tensor.chunk(len(self.theirs))
        return [(name, (part.t() if self.transpose else part).contiguous())
                for name, part in zip(self.theirs, parts, strict=True)]

    def their_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The shape of each of their tensors when ours has `shape`."""
        meta = torch.empty(shape, device="meta")
        return {name: tuple(part.shape) for name, part in self.to_theirs(meta)}


class HFMapping(ABC):
    """A family's Hugging Face architecture: its names, its config fields, what is refused."""

    family: str
    """The meshtrain family (`ModelFamily.name`)."""
    architecture: str
    """The class config.json's "architectures" names (e.g. LlamaForCausalLM)."""
    model_type: str
    base_prefix: str
    """Prefix of the base model's tensors; files saved from the base model omit it."""
    buffers: tuple[str, ...] = ()
    """Name endings of tensors some files carry that are no weights (masks, rotary tables)."""

    @abstractmethod
    def config_from_hf(self, hf: dict) -> TransformerConfig:
        """Our config of a config.json; SettingError (`Code.HF_CONFIG`) naming the field it
        cannot represent, sizes and counts checked before any arithmetic uses them."""

    @abstractmethod
    def config_to_hf(self, cfg: TransformerConfig) -> dict:
        """config.json's fields for `cfg` (without "dtype")."""

    def window_to_hf(self, cfg: TransformerConfig) -> dict:
        """config.json's sliding-window fields for `cfg`; an architecture without windows
        refuses a windowed config (exported as is, it would attend the whole sequence)."""
        if cfg.sliding_window is not None:
            raise SettingError(Code.HF_EXPORT, f"`sliding_window` {cfg.sliding_window}:"
                               f" {self.architecture} has no sliding window; export it with"
                               " format meshtrain")
        return {}

    @abstractmethod
    def tensor_maps(self, cfg: TransformerConfig) -> list[TensorMap]:
        """Every tensor of the model, in the order of our parameters."""

    def kept(self, name: str, hf: dict, cfg: TransformerConfig) -> bool:
        """A Hugging Face tensor of a part meshtrain does not build, kept as it is in an
        import's checkpoint and written back by export (DeepSeek's multi-token prediction)."""
        return False

    def kept_config(self, names: list[str]) -> dict:
        """config.json's fields for the kept tensors `names` an export writes back."""
        return {}

    kept_note = ""
    """The line an import prints when it kept tensors (`{count}`: how many)."""

    def is_ignored(self, name: str, cfg: TransformerConfig) -> bool:
        """A Hugging Face tensor that is no weight of ours: a buffer, or a tied output layer
        (the embedding)."""
        return name.endswith(self.buffers) or (cfg.tie_embeddings and name == "lm_head.weight")


def refused(message: str) -> SettingError:
    """A config.json field meshtrain cannot import (its message names it in double quotes)."""
    return SettingError(Code.HF_CONFIG, message, settings=())


def shown(value) -> str:
    """A field's value as a message quotes it: its repr, cut short (a file may hold anything)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def hf_field(hf: dict, name: str, default=_REQUIRED):
    """config.json's `name`; its default when absent or null, an error when it has none."""
    value = hf.get(name)
    if value is not None:
        return value
    if default is _REQUIRED:
        raise refused(f'config.json has no "{name}": it is not a complete Hugging Face model'
                      " config; add the field")
    return default


def hf_size(hf: dict, name: str, default=_REQUIRED) -> int | None:
    """A size or count field: a positive integer (its default, which may be None, when
    absent). A string, a fraction or 0 would otherwise reach the model's arithmetic."""
    value = hf_field(hf, name, default)
    if value is not default and (type(value) is not int or value < 1):
        raise refused(f'config.json "{name}": {shown(value)} is not a positive integer; fix the'
                      " field")
    return value


def hf_number(hf: dict, name: str, default=_REQUIRED, *, positive: bool = True) -> float:
    """A real-valued field (an epsilon, a rotary base): a finite number, > 0 (`positive`) or
    >= 0."""
    value = hf_field(hf, name, default)
    try:
        number = float(value) if type(value) in (int, float) else math.nan
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not math.isfinite(number) or not (0 < number if positive else 0 <= number):
        bound = "> 0" if positive else ">= 0"
        raise refused(f'config.json "{name}": {shown(value)} is not a finite number {bound};'
                      " fix the field")
    return number


def hf_flag(hf: dict, name: str, default: bool) -> bool:
    """A true/false field (a string such as "false" would read as true)."""
    value = hf_field(hf, name, default)
    if type(value) is not bool:
        raise refused(f'config.json "{name}": {shown(value)} is not true or false; fix the field')
    return value


def check_divides(part: tuple[str, int], whole: tuple[str, int], why: str) -> None:
    """Refuse config.json's count `part` (name, value) when it does not divide `whole`."""
    (part_name, p), (whole_name, w) = part, whole
    if w % p:
        raise refused(f'config.json "{part_name}" {p} does not divide "{whole_name}" {w} ({why});'
                      " fix the fields")


def expect(hf: dict, name: str, allowed: tuple, default, why: str) -> None:
    """Refuse a field whose value meshtrain's family cannot compute (naming it and why)."""
    value = hf_field(hf, name, default)
    if value not in allowed:
        raise refused(f'config.json "{name}": {shown(value)} cannot be imported: {why}')
