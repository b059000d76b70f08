"""Dropless MoE at every layout against one process: a top-2-of-8 fp32 model trains the same
5-step trajectory, and every token goes to the same experts at every step and MoE layer, at
ep x dp, tp x ep, pp x ep under zb-v and zb-h1, sequence parallelism x ep, cp x ep (ring and
all2all), with ZeRO 1, 2 and 3, and with whole experts spread over the tp ranks too (`etp` 1:
tp 2 x ep 4 on 4 ranks, tp 2 x dp 2 x ep 2, with sequence parallelism and ZeRO 1, with ZeRO 3,
pp 2 under zb-h1, cp 2); a run saved
at one layout resumes at another on the same trajectory (between etp 1 and etp = tp too).

The choices are recorded by a test-only wrap of the MoE layer's `route`, keyed by global token
(step, micro-batch of the global batch, layer, sequence, position in the sequence); a context
parallel rank's tokens are its head and tail chunks, mapped back by their positions. A choice
that differs names its token, layer and the score gap that decided it; no choice of the
reference is within `MIN_GAP` of a tie (the smallest gap is printed).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from harness import run_on_ranks, worker_mesh

import meshtrain.parallel.layers.expert as expert_layer
from meshtrain import ParallelMesh
from meshtrain.config.run_config import build_config
from meshtrain.parallel.layers.context_parallel import context_parallel_positions
from meshtrain.parallel.layers.expert import MoE
from meshtrain.parallel.layers.routing import choice_keys, scores_of
from meshtrain.training.trainer import Trainer

MODEL = {"num_layers": 4, "moe_experts": 8, "moe_top_k": 2, "moe_every": 2,
         "moe_capacity_factor": 0.0, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001,
         "moe_shared_ffn_size": 32, "moe_shared_gate": "sigmoid", "moe_bias_rate": 0.002}
"""The model settings of every run: dropless top-2 of 8 experts beside a gated shared expert,
balanced by the routing bias (updated after every step) as well as the loss."""
GROUPED = MODEL | {"moe_score": "sigmoid", "moe_groups": 4, "moe_topk_groups": 2,
           "moe_norm_topk_prob": True, "moe_routed_scaling": 1.5, "moe_shared_gate": "none"}
"""DeepSeek-V3's routing on that model: 4 groups of 2 experts, each token's 2 experts from its
best 2 groups (ranked with the bias), scaled sigmoid weights, an ungated shared expert."""
TRAIN = {"steps": 5, "global_batch": 8, "micro_batch": 2, "seq_len": 16, "seed": 3,
         "clip_grad": 0.0, "eval_every": 0}
STEPS = TRAIN["steps"]
MIN_GAP = 1e-6  # no reference choice closer to a tie than this
REL = 1e-5  # fp32 trajectories within this of one process's
METRICS = ("loss", "grad_norm", "moe_aux_loss")


def _cfg(corpus: str, degrees: dict, parallel: dict, model: dict = MODEL):
    cfg = build_config({}, {"model": model, "train": TRAIN,
                            "parallel": {"device": "cpu", **degrees, **parallel},
                            "data": {"data": corpus}, "checkpoint": {"out": "/nonexistent"}})
    cfg.plan = dataclasses.replace(cfg.plan, **degrees)
    return cfg


class _Choices:
    """This rank's routing choices while installed: {(step, micro-batch, layer, sequence,
    position): (experts, gap)}, the gap the smallest difference of adjacent sorted keys among
    the top k + 1 (what a choice and its order turn on; with groups, also the gap between the
    last chosen group's rank and the next's). Each MoE layer's forwards run its
    micro-batches in order, so a layer's n-th forward is local micro-batch n % m."""

    def __init__(self, model, mesh, cfg, first_step: int):
        self.records: dict[tuple, tuple[tuple[int, ...], float]] = {}
        self.calls: dict[str, int] = {}
        self.layer = ""
        self.first_step, self.mesh, self.cfg = first_step, mesh, cfg
        self.m = cfg.train.global_batch // (cfg.plan.micro_batch * mesh.dp.size)
        self.positions = context_parallel_positions(cfg.train.seq_len, mesh.cp.size,
                                                    mesh.cp.rank)
        self.hooks = [module.register_forward_pre_hook(
            lambda _m, _args, name=name: setattr(self, "layer", name))
            for name, module in model.named_modules() if isinstance(module, MoE)]
        self.route = expert_layer.route
        expert_layer.route = self._route

    def _route(self, logits, rule, **kwargs):
        routing = self.route(logits, rule, **kwargs)
        n = self.calls[self.layer] = self.calls.get(self.layer, 0) + 1
        step, local = self.first_step + (n - 1) // self.m, (n - 1) % self.m
        micro_batch = self.mesh.dp.rank * self.m + local
        gaps = _gaps(logits, rule, kwargs.get("bias"))
        per_sequence = len(self.positions)
        for t, (experts, gap) in enumerate(zip(routing.experts.tolist(), gaps.tolist(),
                                               strict=True)):
            position = int(self.positions[t % per_sequence])
            key = (step, micro_batch, self.layer, t // per_sequence, position)
            self.records[key] = (tuple(experts), gap)
        return routing

    def remove(self) -> None:
        expert_layer.route = self.route
        for hook in self.hooks:
            hook.remove()


def _gaps(logits, rule, bias) -> torch.Tensor:
    """Per token, how far the routing's choice is from a tie (`_Choices`)."""
    scores = scores_of(logits.detach().float(), rule.score)[0]
    keys = choice_keys(scores, rule, bias).sort(dim=-1, descending=True).values
    gaps = (keys[:, :rule.top_k] - keys[:, 1:rule.top_k + 1]).min(dim=-1).values
    if rule.topk_groups < rule.groups:
        biased = scores if bias is None else scores + bias
        ranked = biased.unflatten(-1, (rule.groups, -1)).topk(2, dim=-1).values.sum(dim=-1)
        ranked = ranked.sort(dim=-1, descending=True).values
        gaps = torch.minimum(gaps, ranked[:, rule.topk_groups - 1] - ranked[:, rule.topk_groups])
    return gaps


def _metrics(row: dict) -> dict:
    return {name: float(row[name]) for name in METRICS}


def _run(corpus: str, degrees: dict, parallel: dict, *, stop: int = STEPS, save=None,
         resume=None, model: dict = MODEL) -> tuple[list[dict], dict]:
    """Steps up to `stop` at a layout (from a checkpoint in `resume`; saving in `save`) of
    `model`'s settings: each step's metrics and this rank's routing choices."""
    cfg = _cfg(corpus, degrees, parallel, model)
    trainer = Trainer.build(cfg, worker_mesh(**degrees) if degrees else ParallelMesh.local())
    start = trainer.resume(resume) if resume else 0
    choices = _Choices(trainer.model, trainer.mesh, cfg, start)
    try:
        rows = [_metrics(trainer.train_step(step)) for step in range(start, stop)]
    finally:
        choices.remove()
    if save:
        trainer.save(save, stop)
    return rows, choices.records


def _reference(corpus: str, model: dict = MODEL, stop: int = STEPS
               ) -> tuple[list[dict], dict]:
    rows, choices = _run(corpus, {}, {}, model=model, stop=stop)  # in this process
    gap = min(g for _, g in choices.values())
    print(f"smallest reference gap between routing scores: {gap:.3e}")
    assert gap > MIN_GAP, f"a reference choice is within {gap:.1e} of a tie: change the seed"
    return rows, choices


@pytest.fixture(scope="module")
def reference(corpus):
    return _reference(corpus)


@pytest.fixture(scope="module")
def grouped_reference(corpus):
    """The group-limited model's one-process run of a number of steps (each length once)."""
    return functools.cache(lambda steps: _reference(corpus, GROUPED, steps))


def _assert_same_choices(layout: str, per_rank: list[dict], reference: dict) -> None:
    """Every token of every step and layer recorded by some rank, each rank's choice the
    reference's."""
    seen = set()
    for rank, choices in enumerate(per_rank):
        for key, (experts, _) in choices.items():
            want, gap = reference[key]
            step, micro_batch, layer, sequence, position = key
            assert experts == want, (
                f"{layout} rank {rank}: step {step} micro-batch {micro_batch} {layer} sequence"
                f" {sequence} position {position} chose experts {experts}, one process"
                f" {want} (score gap {gap:.2e})")
        seen |= choices.keys()
    assert seen == reference.keys(), f"{layout}: tokens not recorded: {len(reference) - len(seen)}"


def _assert_same_trajectory(layout: str, rows: list[dict], reference: list[dict]) -> None:
    assert len(rows) == len(reference)
    for step, (row, want) in enumerate(zip(rows, reference, strict=True)):
        for name in METRICS:
            assert row[name] == pytest.approx(want[name], rel=REL), (layout, step, name)


LAYOUTS = {  # name: (degrees, plan settings)
    "cp2xep2": ({"cp": 2, "ep": 2}, {"cp_mode": "ring"}),
    "ep2xdp2": ({"dp": 4, "ep": 2}, {}),
    "tp2xep2": ({"tp": 2, "dp": 2, "ep": 2}, {}),
    "pp2xep2-zb-v": ({"pp": 2, "dp": 2, "ep": 2}, {"pp_schedule": "zb-v"}),
    "sp-tp2xep2": ({"tp": 2, "dp": 2, "ep": 2}, {"sequence_parallel": True}),
    "cp2xdp2xep2-all2all": ({"cp": 2, "dp": 2, "ep": 2}, {"cp_mode": "all2all"}),
    "pp2xep2-zb-h1": ({"pp": 2, "dp": 2, "ep": 2}, {"pp_schedule": "zb-h1"}),
    "sp-tp2xep2-zero1": ({"tp": 2, "dp": 2, "ep": 2}, {"sequence_parallel": True, "zero": 1}),
    "cp2xdp2xep2-zero2": ({"cp": 2, "dp": 2, "ep": 2}, {"cp_mode": "ring", "zero": 2}),
    "zero3-ep2xdp4": ({"dp": 4, "ep": 2}, {"zero": 3}),
    "tp2xep4-etp1": ({"tp": 2, "dp": 2, "ep": 4, "etp": 1}, {}),
    "tp2xdp2xep2-etp1": ({"tp": 2, "dp": 2, "ep": 2, "etp": 1}, {}),
    "sp-tp2xep4-etp1-zero1": ({"tp": 2, "dp": 2, "ep": 4, "etp": 1},
                              {"sequence_parallel": True, "zero": 1}),
    "tp2xep2-etp1": ({"tp": 2, "ep": 2, "etp": 1}, {}),
    "zero3-tp2xdp2xep2-etp1": ({"tp": 2, "dp": 2, "ep": 2, "etp": 1}, {"zero": 3}),
    "pp2xtp2xep2-etp1": ({"pp": 2, "tp": 2, "ep": 2, "etp": 1}, {"pp_schedule": "zb-h1"}),
    "cp2xtp2xep4-etp1": ({"cp": 2, "tp": 2, "ep": 4, "etp": 1}, {"cp_mode": "ring"}),
}
DEFAULT = "cp2xep2"  # the default tier's layout: context parallelism's token split
DEFAULT_ETP = "tp2xep2-etp1"  # and whole experts spread over the tp ranks (etp 1)


def _world(degrees: dict) -> int:
    world = 1
    for axis in ("tp", "pp", "cp", "dp"):
        world *= degrees.get(axis, 1)
    return world


def assert_trains_as_one_process(corpus: str, reference, layout: str, degrees: dict,
                                 parallel: dict, steps: int, model: dict = MODEL) -> None:
    """`steps` steps at this layout: one process's trajectory, and every token the experts one
    process chose (`reference`: `_reference`'s rows and choices of at least `steps` steps)."""
    results = run_on_ranks(_world(degrees), _run, corpus, degrees, parallel, stop=steps,
                           model=model, timeout=300)
    rows, choices = reference
    _assert_same_trajectory(layout, results[0][0], rows[:steps])
    _assert_same_choices(layout, [choices for _, choices in results],
                         {key: value for key, value in choices.items() if key[0] < steps})


FAMILY_LAYOUTS = {  # name: (degrees, plan settings)
    "ep2": ({"dp": 2, "ep": 2}, {}),
    "ep2xdp2": ({"dp": 4, "ep": 2}, {}),
    "tp2xep2": ({"tp": 2, "dp": 2, "ep": 2}, {}),
    "pp2xep2": ({"pp": 2, "dp": 2, "ep": 2}, {}),
    "zero3xep2": ({"dp": 4, "ep": 2}, {"zero": 3}),
}
"""The layouts an MoE family's tiny preset trains at (test_mixtral.py, test_qwen3_moe.py)."""
FAMILY_CASES = [
    ("ep2", 2),  # the default tier's one case: 2 ranks, 2 steps (the others, 5)
    *(pytest.param(name, STEPS, marks=pytest.mark.extended) for name in FAMILY_LAYOUTS
      if name != "ep2")]


def family_model(preset: str) -> dict:
    """A family's tiny preset with the balancing and z losses on (they move the trajectory)."""
    return {"model": preset, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}


@pytest.mark.parametrize("layout,steps", [
    (DEFAULT, 2),  # the default tier's cases: 2 steps (the other cases, 5)
    (DEFAULT_ETP, 2),
    *(pytest.param(name, STEPS, marks=pytest.mark.extended) for name in LAYOUTS)])
def test_dropless_layout_trains_one_process_trajectory_and_choices(corpus, reference, layout,
                                                                   steps):
    assert_trains_as_one_process(corpus, reference, layout, *LAYOUTS[layout], steps)


@pytest.mark.extended
@pytest.mark.parametrize("saved,resumed", [
    ("ep2xdp2", "tp2xep2"),
    ("tp2xep4-etp1", "tp2xep2"),  # whole experts -> experts split over tp
    ("tp2xep2", "tp2xdp2xep2-etp1")])  # and back
def test_resume_at_another_layout_continues_the_trajectory(corpus, reference, tmp_path, saved,
                                                           resumed):
    """Saved after 3 steps at one layout, resumed at another."""
    first = run_on_ranks(4, _run, corpus, *LAYOUTS[saved], stop=3, save=tmp_path, timeout=300)
    second = run_on_ranks(4, _run, corpus, *LAYOUTS[resumed], resume=tmp_path, timeout=300)
    _assert_same_trajectory("resumed", first[0][0] + second[0][0], reference[0])
    _assert_same_choices("resumed", [a[1] | b[1] for a, b in zip(first, second, strict=True)],
                         reference[1])


@pytest.mark.parametrize("layout,steps", [
    ("ep2xdp1", 2),  # the default tier's one case: 2 ranks, 2 steps
    *(pytest.param(name, STEPS, marks=pytest.mark.extended) for name in ("ep2xdp2", "tp2xep2"))])
def test_group_limited_routing_trains_one_process_trajectory_and_choices(
        corpus, grouped_reference, layout, steps):
    """DeepSeek-V3's group-limited routing, its bias moving every step: the same trajectory and
    expert choices as one process."""
    degrees, parallel = ({"dp": 2, "ep": 2}, {}) if layout == "ep2xdp1" else LAYOUTS[layout]
    assert_trains_as_one_process(corpus, grouped_reference(steps), layout, degrees, parallel,
                                 steps, GROUPED)
