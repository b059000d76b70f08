"""Model families and their presets: the one place that lists them.

    family = get_family("gpt")          # by the name checkpoints record
    cfg = preset("tiny", dropout=0.1)   # any family's preset, by its unique name
    family_of(cfg).model(cfg, factory, seed=0)   # or parallelize.build_model
"""

from __future__ import annotations

import dataclasses

from meshtrain.errors import Code, SettingError
from meshtrain.models import (
    deepseek_v3,
    gpt,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from meshtrain.models.causal_lm import CausalLM
from meshtrain.models.family import ModelFamily, TransformerConfig

FAMILIES: dict[str, ModelFamily] = {family.name: family for family in (
    gpt.FAMILY, llama.FAMILY, qwen2.FAMILY, mistral.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY,
    qwen3.FAMILY, qwen3_moe.FAMILY, deepseek_v3.FAMILY)}

PRESETS: dict[str, TransformerConfig] = {
    name: cfg for family in FAMILIES.values() for name, cfg in family.presets.items()}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise SettingError(Code.CHOICE,
                           f"unknown model family {name!r}: meshtrain has {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(cfg: TransformerConfig) -> ModelFamily:
    """The family whose config class `cfg` is."""
    for family in FAMILIES.values():
        if type(cfg) is family.config:
            return family
    raise ValueError(f"{type(cfg).__name__} is no registered model family's config")


def preset(name: str, **overrides) -> TransformerConfig:
    """A preset of any family by name, with fields replaced."""
    if name not in PRESETS:
        raise SettingError(Code.CHOICE,
                           f"unknown model preset {name!r}: choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


RETIRED_FIELDS = {("qwen2", "use_sliding_window"): False}
"""Fields earlier versions recorded, with the one value they could hold, which leaving them out
now means (Qwen2's windows are `sliding_window` and `window_start_layer`)."""


def config_from_dict(family: str, fields: dict) -> TransformerConfig:
    """A family's config from its recorded fields (a checkpoint manifest's `model`)."""
    config = get_family(family).config
    fields = {name: value for name, value in fields.items()
              if (family, name) not in RETIRED_FIELDS or RETIRED_FIELDS[family, name] != value}
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise SettingError(Code.MODEL_FIELDS,
                           f"model fields {', '.join(unknown)} are not {family} settings: the"
                           " checkpoint is from another meshtrain version or family")
    return config(**fields)


__all__ = ["FAMILIES", "PRESETS", "CausalLM", "ModelFamily", "TransformerConfig",
           "config_from_dict", "family_of", "get_family", "preset"]
