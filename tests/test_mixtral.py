"""Mixtral (`mixtral-tiny`: every layer 8 full-width experts, top 2 renormalised, dropless)
trains the 5-step trajectory of one process, every token going to the same experts at every
step and layer, at ep 2 x dp 2, tp 2 x ep 2, pp 2 x ep 2 and ZeRO-3 x ep 2 (the harness of
test_moe_layouts.py). Hugging Face interop is tested in test_hf_moe.py."""

import pytest
from harness import run_on_ranks
from test_moe_layouts import (
    STEPS,
    _assert_same_choices,
    _assert_same_trajectory,
    _reference,
    _run,
    _world,
)

MODEL = {"model": "mixtral-tiny", "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}
LAYOUTS = {  # name: (degrees, plan settings)
    "ep2": ({"dp": 2, "ep": 2}, {}),
    "ep2xdp2": ({"dp": 4, "ep": 2}, {}),
    "tp2xep2": ({"tp": 2, "dp": 2, "ep": 2}, {}),
    "pp2xep2": ({"pp": 2, "dp": 2, "ep": 2}, {}),
    "zero3xep2": ({"dp": 4, "ep": 2}, {"zero": 3}),
}


@pytest.fixture(scope="module")
def reference(corpus):
    return _reference(corpus, MODEL)


@pytest.mark.parametrize("layout,steps", [
    ("ep2", 2),  # the default tier's one case: 2 ranks, 2 steps (the others, 5)
    *(pytest.param(name, STEPS, marks=pytest.mark.extended) for name in LAYOUTS
      if name != "ep2")])
def test_mixtral_trains_one_process_trajectory_and_choices(corpus, reference, layout, steps):
    degrees, parallel = LAYOUTS[layout]
    results = run_on_ranks(_world(degrees), _run, corpus, degrees, parallel, stop=steps,
                           model=MODEL, timeout=300)
    rows, choices = reference
    _assert_same_trajectory(layout, results[0][0], rows[:steps])
    _assert_same_choices(layout, [choices for _, choices in results],
                         {key: value for key, value in choices.items() if key[0] < steps})
