"""Capabilities declared once (`parallel/runtime/capabilities.py`): every pair of declared
features (and of a feature with a grid tensor-parallel scheme) on the tiny model is either
refused with the code of a declaration naming one of them, or allowed; `plan.validate` agrees
with the declarations (cheap, in process), and each allowed pair takes one training step at the
smallest world that shows it (`-m extended`; fp8's need a GPU with torchao)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from harness import run_on_ranks

from meshtrain.config.run_config import build_config
from meshtrain.errors import Code, SettingError
from meshtrain.models import preset
from meshtrain.parallel.runtime.capabilities import (
    FEATURES,
    RULES,
    check_capabilities,
    features_in_use,
    refusal,
    table,
)
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.schedules.catalog import SCHEDULES
from meshtrain.parallel.schemes.registry import SCHEMES
from meshtrain.training.trainer import run_training

TINY = preset("tiny")
PLAN_FIELDS = {f.name: f for f in dataclasses.fields(ParallelPlan)}
DEGREES = ("tp", "pp", "cp", "dp", "ep", "micro_batch", "zero")
SEQ_LEN = 32


def _grid_settings(name: str) -> dict:
    """A grid scheme at the smallest tp it forms, with the micro-batch its grid splits."""
    scheme = SCHEMES[name]
    tp = next(tp for tp in range(2, 65) if scheme.forms(tp))
    return {"tp": tp, "tp_scheme": name,
            "micro_batch": ParallelPlan(tp=tp, tp_scheme=name).batch_parts}


ITEMS = {name: f.turn_on for name, f in FEATURES.items()} | {
    f"tp_scheme {name}": _grid_settings(name) for name in SCHEMES
    if name != ParallelPlan().tp_scheme}
"""What the pairs are made of: each feature's settings, and each grid scheme's."""


def _merged(first: dict, second: dict) -> dict:
    """Both items' settings: the larger of two degrees (and ZeRO stages), the second's value
    otherwise (a schedule's own feature over virtual stages' schedule)."""
    merged = dict(first)
    for key, value in second.items():
        merged[key] = max(merged[key], value) if key in DEGREES and key in merged else value
    return merged


def _layout(settings: dict) -> tuple[ParallelPlan, object, int, int]:
    """(plan, model, world size, global batch) of some settings on the tiny model."""
    base = preset(settings["model"]) if "model" in settings else TINY  # (mla: a model's own)
    model = dataclasses.replace(base, **{k: v for k, v in settings.items()
                                         if k not in PLAN_FIELDS and k != "model"})
    plan = ParallelPlan(**{k: v for k, v in settings.items() if k in PLAN_FIELDS} | {
        "dp": settings.get("dp", 1)})
    world = plan.tp * plan.pp * plan.cp * plan.dp
    return plan, model, world, plan.micro_batch * plan.dp * 4


def _in_use(item: str, plan: ParallelPlan, model) -> bool:
    return plan.tp_scheme == item.split()[-1] if item.startswith("tp_scheme ") \
        else item in features_in_use(plan, model)


def _declared_codes(first: str, second: str) -> set:
    """The codes of the declarations that name either item or what its settings turn on
    (tp_overlap's sequence parallelism, ep's MoE layers)."""
    names = {name for item in (first, second)
             for name in features_in_use(*_layout(ITEMS[item])[:2])}
    codes = {r.code for r in RULES if names & {r.feature, r.other}}
    for name in names & set(FEATURES):
        f = FEATURES[name]
        codes |= {(f.scheme_refusal or (Code.SCHEME_COMBINATION,))[0],
                  (f.schedule_refusal or (Code.SCHEDULE_COMBINATION,))[0]}
    return codes


def _pairs() -> dict[str, list]:
    """Every pair, sorted into refused (with its error), allowed, and one setting (a pair one
    layout cannot hold: bf16 and fp64, two schedules' own features, two grid schemes)."""
    sorted_pairs: dict[str, list] = {"refused": [], "allowed": [], "one setting": []}
    for first, second in itertools.combinations(ITEMS, 2):
        settings = _merged(ITEMS[first], ITEMS[second])
        plan, model, world, batch = _layout(settings)
        if not (_in_use(first, plan, model) and _in_use(second, plan, model)):
            sorted_pairs["one setting"].append((first, second, settings))
            continue
        error = refusal(plan, model)
        kind = "allowed" if error is None else "refused"
        sorted_pairs[kind].append((first, second, settings))
    return sorted_pairs


PAIRS = _pairs()


def test_every_name_a_scheme_or_schedule_supports_is_a_declared_feature():
    listed = [*SCHEMES.values(), *SCHEDULES.values()]
    assert all(entry.supports <= set(FEATURES) for entry in listed)
    assert {r.feature for r in RULES} | {r.other for r in RULES} <= set(FEATURES)


def test_a_feature_the_scheme_does_not_list_is_refused():
    """The allow-list: a scheme that does not list a feature refuses it."""
    plan = ParallelPlan(tp=4, tp_scheme="2d", micro_batch=2, compile=True, dp=1)
    assert "compile" not in plan.scheme.supports
    with pytest.raises(SettingError) as refused:
        check_capabilities(plan, TINY)
    assert refused.value.code.name == "COMPILE_SCHEME"


def test_the_pair_counts():
    """Both verdicts occur, and a pair left out as one setting does set one setting two ways."""
    counts = {kind: len(pairs) for kind, pairs in PAIRS.items()}
    print(counts)
    assert counts["refused"] and counts["allowed"]
    assert all(any(key in ITEMS[second] and ITEMS[second][key] != value
                   for key, value in ITEMS[first].items())
               for first, second, _ in PAIRS["one setting"])


@pytest.mark.parametrize("first,second,settings", PAIRS["refused"],
                         ids=[f"{a}+{b}" for a, b, _ in PAIRS["refused"]])
def test_a_refused_pair_gives_its_code(first, second, settings):
    """Validation refuses the pair as the declarations do, with a code that names one of its
    features: no value check (divisibility, lengths) gets there first."""
    plan, model, world, batch = _layout(settings)
    expected = refusal(plan, model)
    with pytest.raises(SettingError) as refused:
        plan.validate(model, world_size=world, global_batch=batch, seq_len=SEQ_LEN)
    assert (refused.value.code, str(refused.value)) == (expected.code, str(expected))
    assert expected.code in _declared_codes(first, second)


@pytest.mark.parametrize("first,second,settings", PAIRS["allowed"],
                         ids=[f"{a}+{b}" for a, b, _ in PAIRS["allowed"]])
def test_an_allowed_pair_validates(first, second, settings):
    plan, model, world, batch = _layout(settings)
    plan.validate(model, world_size=world, global_batch=batch, seq_len=SEQ_LEN)


def _one_step(corpus: str, out: str, settings: dict) -> None:
    """One training step of the tiny model with `settings` (plan fields in their sections,
    model fields in [model])."""
    sections: dict[str, dict] = {"model": {}, "parallel": {"device": "cpu"}, "train": {}}
    for key, value in settings.items():
        section = PLAN_FIELDS[key].metadata["section"] if key in PLAN_FIELDS else "model"
        sections[section][key] = value
    plan, _, _, batch = _layout(settings)
    sections["train"] |= dict(steps=1, global_batch=batch, micro_batch=plan.micro_batch,
                              seq_len=SEQ_LEN, eval_every=0, seed=5, warmup_steps=0)
    if "fp8" in settings:
        sections["parallel"]["device"] = "cuda"
    cfg = build_config({}, sections | {"data": {"data": corpus}, "checkpoint": {"out": out}})
    run_training(cfg)


@pytest.mark.extended
@pytest.mark.timeout(900)
@pytest.mark.parametrize("first,second,settings", PAIRS["allowed"],
                         ids=[f"{a}+{b}" for a, b, _ in PAIRS["allowed"]])
def test_an_allowed_pair_takes_a_step(corpus, tmp_path, first, second, settings):
    if "fp8" in settings and not torch.cuda.is_available():
        pytest.skip("fp8 needs a GPU with FP8 tensor cores and torchao")
    _, _, world, _ = _layout(settings)
    run_on_ranks(world, _one_step, corpus, str(tmp_path), settings, timeout=600)


def test_the_table_lists_every_feature():
    rows = table()
    assert [row.split(" | ")[0].strip("| ") for row in rows[2:]] == list(FEATURES)
