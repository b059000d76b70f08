"""Mixtral (`mixtral-tiny`: every layer 8 full-width experts, top 2 renormalised, dropless)
trains the 5-step trajectory of one process, every token going to the same experts at every
step and layer, at ep 2 x dp 2, tp 2 x ep 2, pp 2 x ep 2 and ZeRO-3 x ep 2 (the harness of
test_moe_layouts.py). Hugging Face interop is tested in test_hf_moe.py."""

import pytest
from test_moe_layouts import (
    FAMILY_CASES,
    FAMILY_LAYOUTS,
    _reference,
    assert_trains_as_one_process,
    family_model,
)

MODEL = family_model("mixtral-tiny")


@pytest.fixture(scope="module")
def reference(corpus):
    return _reference(corpus, MODEL)


@pytest.mark.parametrize("layout,steps", FAMILY_CASES)
def test_mixtral_trains_one_process_trajectory_and_choices(corpus, reference, layout, steps):
    assert_trains_as_one_process(corpus, reference, layout, *FAMILY_LAYOUTS[layout], steps,
                                 MODEL)
