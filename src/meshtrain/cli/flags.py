"""Library messages in the command line's words: settings named in backticks (`pp_schedule`)
become the flags that set them (--pp-schedule)."""

from __future__ import annotations

import re

from meshtrain.config import run_config as config_mod

# Options of the data commands that library messages name in backticks, as `train` settings are.
_DATA_OPTIONS = ("tokenizer", "text_field", "on_error", "workers", "val_docs", "eod_token")
_PLAN_OPTIONS = ("gpus", "top", "ranks", "moe_imbalance")


def as_flags(message: str) -> str:
    """A library message with settings named in backticks (`pp_schedule`), in flags
    (--pp-schedule); backticked names that are no setting lose their backticks."""
    flags = {f.name: f.metadata.get("flag", "--" + f.name.replace("_", "-"))
             for _, f in config_mod.flag_fields()} | {"config": "--config"}
    flags |= {name: "--" + name.replace("_", "-") for name in _DATA_OPTIONS + _PLAN_OPTIONS}
    return re.sub(r"`([a-z_0-9]+)`", lambda m: flags.get(m.group(1), m.group(1)), message)
