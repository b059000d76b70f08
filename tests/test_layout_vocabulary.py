"""One layout vocabulary: `ParallelPlan` is the layout, and flags, TOML tables and `--layout`
specs are views of its fields. Every field is reachable from each, choices come from one
definition, and the planner's candidates are plans."""

import dataclasses
import tomllib

import pytest

from meshtrain.cli.main import _train_config
from meshtrain.cli.parsers import build_parser
from meshtrain.config.run_config import build_config
from meshtrain.errors import Code, SettingError
from meshtrain.models import preset
from meshtrain.parallel.runtime.plan import SPEC_FIELDS, ParallelPlan, parse_spec, spec_key

FIELDS = dataclasses.fields(ParallelPlan)


def _sample(f: dataclasses.Field):
    """A value of the field that is not its default (nor a run's)."""
    choices, kind = f.metadata["choices"], str(f.type)
    if choices:
        return next(c for c in reversed(choices) if c not in (f.default,
                                                             f.metadata["run_default"]))
    if kind.startswith("bool"):
        return True
    if kind.startswith("tuple"):
        return (3, 5)
    if kind.startswith("float"):
        return 12.5
    if kind.startswith("str"):
        return "elsewhere"
    return 3


def _text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_every_plan_field_is_reachable_from_a_flag_toml_and_a_spec(f):
    value = _sample(f)
    flag = "--" + f.name.replace("_", "-")
    words = ["train", flag] if value is True else ["train", flag, _text(value)]
    assert getattr(_train_config(build_parser().parse_args(words)).plan, f.name) == value
    toml = {f.metadata["section"]: {f.name: _text(value) if isinstance(value, tuple)
                                    else value}}
    assert getattr(build_config(toml, {}).plan, f.name) == value
    spec = f"{spec_key(f)}={int(value) if value is True else _text(value)}"
    assert parse_spec(spec) == {f.name: value}


def test_a_run_config_round_trips_through_its_toml():
    words = ["train", "--tp", "2", "--pp-layers", "3,5", "--sequence-parallel",
             "--micro-batch", "4", "--precision", "bf16", "--bucket-mb", "8"]
    cfg = _train_config(build_parser().parse_args(words))
    again = build_config(tomllib.loads(cfg.to_toml()), {})
    assert again.plan == cfg.plan and again.to_dict() == cfg.to_dict()
    assert cfg.to_dict()["train"]["micro_batch"] == 4  # the plan's fields stay in their tables


def test_a_spec_is_a_view_of_the_plan():
    plan = ParallelPlan(tp=2, dp=4, micro_batch=2, pp_layers=(3, 5), cp_mode="all2all")
    assert parse_spec(plan.spec()) == {
        f.name: getattr(plan, f.name) for f in FIELDS
        if getattr(plan, f.name) is not None and (f.metadata["searched"] or getattr(
            plan, f.name) != getattr(ParallelPlan(), f.name))}
    assert ParallelPlan(**parse_spec(plan.spec())) == plan
    view = plan.searched_view()  # `meshtrain plan --json`'s layout keys
    assert list(view) == ["tp", "pp", "dp", "cp", "ep", "etp", "vp", "mb", "zero", "sp",
                          "recompute", "schedule", "scheme", "depth"]
    assert set(SPEC_FIELDS) >= set(view)


@pytest.mark.parametrize("f", [f for f in FIELDS if f.metadata["choices"]],
                         ids=lambda f: f.name)
def test_choices_are_defined_once_and_read_by_help_validation_and_the_spec(f, capsys):
    choices = f.metadata["choices"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    help_text = capsys.readouterr().out
    assert "{" + ",".join(map(str, choices)) + "}" in help_text.replace("\n", "").replace(" ", "")
    wrong = "nope" if isinstance(choices[0], str) else 9
    with pytest.raises(SettingError) as refused:
        ParallelPlan(**{f.name: wrong}).validate(preset("tiny"), world_size=1,
                                                 global_batch=8, seq_len=64)
    assert refused.value.code is Code.CHOICE and refused.value.settings == (f.name,)
    with pytest.raises(SettingError, match="must be"):
        parse_spec(f"{spec_key(f)}={wrong}")
