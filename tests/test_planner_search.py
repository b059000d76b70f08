"""The layout search and `meshtrain plan`: constraints with their reasons, ranking within the
memory budget, fixed fields, the printed commands, JSON and bad input; `train --layout auto`."""

import dataclasses
import itertools
import json
import os
import re
import shlex
import tomllib

import pytest
from harness import run_cli

from meshtrain.cli.auto_layout import fixed_fields
from meshtrain.cli.main import _train_config, main
from meshtrain.cli.parsers import build_parser
from meshtrain.config.run_config import build_config
from meshtrain.data.corpus import synthetic_corpus
from meshtrain.errors import Code, SettingError
from meshtrain.models import preset
from meshtrain.parallel.layers.recompute import RECOMPUTE
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.planner.costs import Prediction, predict
from meshtrain.planner.hardware import BUILT_IN, UNFITTED, Hardware
from meshtrain.planner.memory_model import MemoryBreakdown
from meshtrain.planner.published import load_rows
from meshtrain.planner.search import OVER_BUDGET, search

GIB = 2**30
GPT = dataclasses.replace(preset("gpt2"), num_layers=8, num_heads=16)
NODE = Hardware(name="node", peak_tflops=100.0, hbm_gib=10, gpus_per_node=8,
                intra_node_gbytes_per_s=100.0, inter_node_gbytes_per_s=10.0)


def stand_in(model, layout, hardware, *, seq_len, global_batch, precision) -> Prediction:
    """A cost with known answers: time falls with tp, rises with pipeline depth and recompute;
    memory (GiB) is 24 / (tp x pp) plus the micro-batch, less under recompute and ZeRO."""
    extra = {"none": 0.0, "selective": 0.1, "full": 0.3}[layout.recompute]
    step = 1.0 / layout.tp + 0.05 * layout.pp + extra + 0.01 * layout.micro_batch \
        + 0.001 * layout.zero
    gib = max(0.5, 24 / (layout.tp * layout.pp) + layout.micro_batch
              - 2 * RECOMPUTE.index(layout.recompute) - layout.zero)
    memory = MemoryBreakdown(gib * GIB, 0.0, 0.0, 0.0, 0.0)
    return Prediction(layout, step, step, 0.0, 0.0, 1.0, 0.5, memory)


def _search(model=GPT, hardware=NODE, gpus=8, fixed=None, cost=stand_in, **kw):
    kw = {"seq_len": 1024, "global_batch": 16, "precision": "bf16"} | kw
    return search(model, hardware, gpus=gpus, fixed=fixed, cost=cost, **kw)


def test_tp_not_dividing_the_heads_is_rejected_with_its_reason():
    result = _search(model=dataclasses.replace(GPT, num_heads=6, hidden_size=768))
    rejected = result.rejected["heads not divisible by tp"]
    assert {r.layout.tp for r in rejected} == {4, 8}
    assert "number of heads (6) must be divisible by tp" in rejected[0].detail
    # 2d at tp 4, 2.5d and 3d at tp 8 split the heads only q = 2 ways
    assert result.ranked and all(p.layout.tp in (1, 2) or p.layout.tp_scheme != "1d"
                                 for p in result.ranked)


def test_pp_beyond_the_layers_and_interleaving_are_checked():
    shallow = dataclasses.replace(GPT, num_layers=4)
    result = _search(model=shallow, gpus=16, fixed={"tp": 1})
    assert {r.layout.pp for r in result.rejected["pp exceeds layers"]} == {8, 16}
    # Interleaving needs the micro-batches divisible by pp and the layers by pp x vp.
    odd = _search(gpus=2, fixed={"pp": 2, "schedule": "interleaved", "vp": 2},
                  global_batch=3)
    assert not odd.ranked
    assert "interleaved: micro-batches not divisible by pp" in odd.rejected
    uneven = _search(model=dataclasses.replace(GPT, num_layers=6), gpus=2,
                     fixed={"pp": 2, "schedule": "interleaved", "vp": 2})
    assert "interleaved: layers not divisible by pp x vp" in uneven.rejected
    with pytest.raises(ValueError, match="no layout fits.*interleaved"):
        uneven.best()


def test_ranking_is_by_step_time_within_the_memory_budget():
    result = _search()
    times = [p.step_time_s for p in result.ranked]
    assert times == sorted(times) and len(times) > 5
    assert all(p.memory_gib <= NODE.hbm_gib for p in result.ranked)
    best = result.ranked[0].layout
    assert (best.tp, best.pp, best.micro_batch, best.recompute) == (8, 1, 1, "none")
    over = result.rejected[OVER_BUDGET]
    assert all(r.over_gib > 0 and r.detail.startswith(f"by {r.over_gib:.1f} GiB") for r in over)
    # tp=1 x pp=1 needs 24 GiB + mb: over budget even with full recompute and ZeRO 3.
    assert not any((p.layout.tp, p.layout.pp) == (1, 1) for p in result.ranked)
    assert any((r.layout.tp, r.layout.pp) == (1, 1) for r in over)


def test_recompute_is_raised_only_while_memory_demands_it():
    result = _search(fixed={"tp": 1, "pp": 2, "zero": 1, "mb": 1, "schedule": "1f1b"})
    # The probe (full recompute: 8 GiB) fits; then none (12 GiB) is over the 10 and selective
    # (10 GiB) fits, so the escalation stops there.
    assert [p.layout.recompute for p in result.ranked] == ["selective", "full"]
    assert [r.layout.recompute for r in result.rejected[OVER_BUDGET]] == ["none"]
    assert result.evaluated == 3


def test_fixed_fields_are_carried_by_every_result():
    fixed = {"tp": 2, "zero": 1, "recompute": "selective"}
    result = _search(fixed=fixed)
    assert result.ranked
    for p in result.ranked:
        assert (p.layout.tp, p.layout.zero, p.layout.recompute) == (2, 1, "selective")


def test_a_fully_fixed_layout_is_reported_even_over_budget():
    tight = dataclasses.replace(NODE, hbm_gib=1)
    spec = {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "mb": 2, "zero": 0, "recompute": "none"}
    result = _search(hardware=tight, fixed=spec)
    assert len(result.ranked) == 1 and result.ranked[0].layout.dp == 8
    assert "26.0 GiB per device, 25.0 GiB over the 1 GiB of node" in result.warnings[0]
    # Left free to search with less memory than any layout needs: one reason, the closest miss.
    with pytest.raises(ValueError, match=r"no layout fits.*memory over budget.*by 0\.2 GiB"):
        _search(hardware=dataclasses.replace(NODE, hbm_gib=0.25)).best()


def test_a_fixed_layout_that_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="number of heads"):
        _search(fixed={"tp": 8, "pp": 1, "dp": 1, "mb": 1, "zero": 0, "recompute": "none",
                       "sp": False, "scheme": "1d"}, model=dataclasses.replace(GPT, num_heads=6))


def test_fixed_degrees_must_match_the_devices():
    with pytest.raises(SettingError, match=r"tp x pp x dp x cp = 2 x 2 x 2 x 1 = 8, not `gpus`"
                                           " 16") as error:
        _search(gpus=16, fixed={"tp": 2, "pp": 2, "dp": 2, "cp": 1})
    assert error.value.code is Code.DEGREES_WORLD
    with pytest.raises(SettingError, match="fixes tp = 3, which does not divide `gpus` 8") as error:
        _search(fixed={"tp": 3})
    assert error.value.code is Code.DEGREES_WORLD


def test_2bw_only_when_asked_for():
    pipelined = _search(fixed={"tp": 1}, precision="fp32")
    assert {p.layout.pp_schedule for p in pipelined.ranked} == {"1f1b", "interleaved", "zb-h1",
                                                                "zb-v"}
    asked = _search(fixed={"tp": 1, "pp": 2, "schedule": "2bw"}, precision="fp32")
    assert asked.ranked and {p.layout.pp_schedule for p in asked.ranked} == {"2bw"}


def test_gpipe_is_never_faster_than_1f1b_in_the_cost_model():
    """Why the search leaves gpipe out unless fixed."""
    hardware = BUILT_IN["a100-40g"]
    for pp, mb, tp in ((2, 1, 1), (4, 2, 2), (8, 1, 1)):
        layouts = [ParallelPlan(tp=tp, pp=pp, dp=8 // (tp * pp) or 1, micro_batch=mb,
                                pp_schedule=s) for s in ("gpipe", "1f1b")]
        gpipe, one_f_one_b = (predict(GPT, lay, hardware, seq_len=1024, global_batch=32)
                              for lay in layouts)
        assert gpipe.step_time_s >= one_f_one_b.step_time_s * (1 - 1e-12)  # equal up to rounding
        assert gpipe.memory_gib >= one_f_one_b.memory_gib


def _exhaustive_best(model, hardware, gpus, **kw) -> Prediction:
    """The fastest valid layout within memory among every combination (gpipe included; the
    grids at micro-batches up to 8 sequences per rank, as the search tries them)."""
    degrees = [(t, p, gpus // (t * p)) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8)
               if gpus % (t * p) == 0 and t <= gpus]
    grids = [(None, "1d", None, (1, 2, 4, 8)), (4, "2d", None, (2, 4, 8, 16)),
             (8, "2.5d", 2, (4, 8, 16, 32)), (8, "3d", None, (4, 8, 16, 32))]
    fitting = []
    for (tp, pp, dp), (at, scheme, depth, mbs) in itertools.product(degrees, grids):
        if at in (None, tp):
            base = ParallelPlan(tp=tp, pp=pp, dp=dp, tp_scheme=scheme, tp_depth=depth)
            fitting += _fitting(model, hardware, gpus, base, mbs, **kw)
    return min(fitting, key=lambda p: p.step_time_s)


def _fitting(model, hardware, gpus, base: ParallelPlan, mbs, **kw) -> list[Prediction]:
    """Every valid variant of `base` within memory."""
    found = []
    for mb, zero, sp, recompute, (schedule, vp) in itertools.product(
            mbs, (0, 1, 2, 3), (False, True), RECOMPUTE,
            (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1),
             ("zb-v", 1))):
        lay = dataclasses.replace(base, micro_batch=mb, zero=zero, sequence_parallel=sp,
                                  recompute=recompute, pp_schedule=schedule, virtual_stages=vp)
        try:
            lay.validate(
                model, world_size=gpus, global_batch=kw["global_batch"], seq_len=kw["seq_len"])
        except ValueError:
            continue
        p = predict(model, lay, hardware, **kw)
        if p.memory_gib <= hardware.hbm_gib:
            found.append(p)
    return found


@pytest.mark.parametrize("name,layers,hardware,hbm,gpus,seq_len,batch", [
    ("gpt2", 4, "a100-40g", 1.2, 4, 1024, 16),      # memory binds: ZeRO, recompute
    ("gpt2", 8, "v100-32g-dgx2h", 1.0, 8, 1024, 64),
    ("llama-tiny", 4, "a100-40g", 0.01, 4, 256, 16)])  # only pipelines with recompute fit
def test_the_pruned_search_finds_the_exhaustive_best(name, layers, hardware, hbm, gpus,
                                                     seq_len, batch):
    """Against every valid layout of a small space, predicted with the real cost model."""
    model = dataclasses.replace(preset(name), num_layers=layers)
    hw = dataclasses.replace(BUILT_IN[hardware], hbm_gib=hbm)
    kw = {"seq_len": seq_len, "global_batch": batch, "precision": "bf16"}
    best = _exhaustive_best(model, hw, gpus, **kw)
    found = search(model, hw, gpus=gpus, **kw)
    assert found.ranked[0].step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    assert found.evaluated < 100  # 80 before the grids (2d at tp 4, 2.5d and 3d at tp 8)


# --- meshtrain plan --------------------------------------------------------------------------

PLAN = ["plan", "--model", "gpt2", "--num-layers", "8", "--seq-len", "1024", "--global-batch",
        "64", "--hardware", "a100-40g"]


def _run(capsys, *args):
    code = main([*PLAN, *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_is_one_object_best_first(capsys):
    code, out, _ = _run(capsys, "--gpus", "8", "--json", "--top", "3")
    assert code == 0
    report = json.loads(out)
    layouts = report["layouts"]
    assert len(layouts) == 3
    for entry in layouts:
        assert {"step_time_s", "tflops_per_gpu", "mfu", "memory_gib", "layout", "command",
                "compute_s", "exposed_comm_s", "bubble_s", "memory"} <= entry.keys()
        assert entry["step_time_s"] == pytest.approx(
            entry["compute_s"] + entry["exposed_comm_s"] + entry["bubble_s"])
        assert entry["memory_gib"] == pytest.approx(sum(entry["memory"].values()))
    assert [e["step_time_s"] for e in layouts] == sorted(e["step_time_s"] for e in layouts)
    assert "rejected" not in report


def test_plan_precision_fp8_is_bf16_with_float8_matmuls(capsys):
    """`--precision fp8` plans bf16 layouts with `fp8` tensorwise, and they come out faster."""
    steps = {}
    for precision in ("bf16", "fp8"):
        code, out, _ = _run(capsys, "--gpus", "8", "--json", "--top", "1",
                            "--layout", "tp=1,pp=1,mb=8", "--precision", precision,
                            "--hardware", "h100-80g")
        best = json.loads(out)["layouts"][0]
        steps[precision] = best["step_time_s"]
        assert code == 0 and "--precision bf16" in best["command"]
        assert ("--fp8 tensorwise" in best["command"]) == (precision == "fp8")
    assert steps["fp8"] < steps["bf16"]


def _parsed(command: str):
    """The layout and config a printed command trains with, and the words before `train`."""
    words = shlex.split(command)
    start = words.index("train")
    cfg = _train_config(build_parser().parse_args(words[start:]))
    return cfg.plan, cfg, words[:start]


@pytest.mark.parametrize("gpus,launcher,nproc", [
    (8, ["meshtrain"], 8),
    (32, ["torchrun", "--nnodes", "4", "--nproc-per-node", "8"], None)])
def test_the_printed_command_trains_the_same_layout(capsys, gpus, launcher, nproc):
    code, out, _ = _run(capsys, "--gpus", str(gpus), "--json")
    assert code == 0
    for entry in json.loads(out)["layouts"]:
        layout, cfg, words = _parsed(entry["command"])
        assert layout.searched_view() == entry["layout"]
        assert words[:len(launcher)] == launcher and cfg.parallel.nproc == nproc
        assert (cfg.model.model, cfg.model.num_layers, cfg.train.seq_len,
                cfg.train.global_batch, cfg.plan.precision) == ("gpt2", 8, 1024, 64, "bf16")


def test_plan_table_and_explain(capsys):
    code, out, _ = _run(capsys, "--gpus", "16", "--num-heads", "6", "--explain")
    assert code == 0
    lines = out.splitlines()
    assert "on 16 x a100-40g" in lines[1] and "this machine's" not in lines[1]
    counts = re.search(r"(\d+) layout\(s\) considered .*: (\d+) fit, (\d+) over memory,"
                       r" (\d+) invalid", lines[1])
    total, fit, over, invalid = map(int, counts.groups())
    assert total == fit + over + invalid and fit > 0 and invalid > 0  # the header adds up
    rows = [line for line in lines if line.lstrip().startswith(("1 ", "2 "))]
    assert len(rows) == 2 and "tp=" in rows[0]
    assert "rejected layouts by reason:" in lines
    heads = next(line for line in lines if "heads not divisible by tp:" in line)
    assert int(heads.rsplit(":", 1)[1]) > 0
    example = lines[lines.index(heads) + 1]
    assert "tp=4" in example or "tp=8" in example
    code, out, _ = _run(capsys, "--gpus", "16", "--num-heads", "6", "--explain", "--json")
    rejected = json.loads(out)["rejected"]
    assert rejected["heads not divisible by tp"]["count"] > 0
    assert rejected["heads not divisible by tp"]["examples"][0]["layout"]["tp"] in (4, 8)


def test_plan_layout_over_budget_warns(capsys):
    code, out, err = _run(capsys, "--gpus", "1", "--global-batch", "128", "--layout",
                          "tp=1,pp=1,dp=1,mb=128,zero=0,recompute=none", "--json")
    assert code == 0
    assert json.loads(out)["layouts"][0]["layout"]["mb"] == 128
    assert err.startswith("meshtrain: warning: layout tp=1") and "over the 40 GiB" in err


@pytest.mark.parametrize("args,message", [
    (["--gpus", "12", "--layout", "tp=8,pp=2,dp=1,cp=1"], "not --gpus 12"),
    (["--gpus", "8", "--hardware", "tpu-v9"], "--hardware 'tpu-v9' is neither"),
    (["--gpus", "8", "--layout", "tp=3"], "does not divide --gpus 8"),
    (["--gpus", "8", "--layout", "wide=2"], "is not KEY=VALUE"),
    (["--gpus", "8", "--hidden-size", "49152", "--num-layers", "200"], "no layout fits"),
    (["--gpus", "8", "--hidden-size", "49152", "--num-layers", "200"],
     "planned for 8 x a100-40g (40 GiB each): choose the devices you will train on with"
     " --hardware"),
    (["--json"], "--gpus is required"),
    (["--gpus", "8", "--seq-len", "0"], "--seq-len must be positive, got 0"),
    (["--gpus", "8", "--global-batch", "-1"], "--global-batch must be positive, got -1"),
    (["--gpus", str(10**20)], f"--gpus {10**20} is more than any cluster holds: plan at most"
                              " 1048576"),  # the divisor walk never ended
    (["--gpus", "8", "--global-batch", str(10**20)], "sequences per step is past any run"),
    # issue 56: each was a raw Python error, a search that never ended, or a silent default
    (["--gpus", "0"], "--gpus must be positive, got 0"),  # was ZeroDivisionError
    (["--gpus", "-3", "--hardware", "h100-80g"], "--gpus must be positive, got -3"),
    (["--gpus", "8", "--num-layers", str(10**8)], "--num-layers 100000000 is past any model the"
                                                  " planner prices"),  # was a search of hours
    (["--gpus", "8", "--num-layers", "0"], "--num-layers must be positive, got 0"),
    (["--gpus", "8", "--hidden-size", "-1"], "--hidden-size must be positive, got -1"),
    (["--gpus", "8", "--dropout", "nan"], "--dropout must be a finite number, got nan"),
    (["--gpus", "8", "--moe-experts", "8", "--moe-capacity-factor", "inf"],
     "--moe-capacity-factor must be a finite number, got inf"),
    (["--gpus", "8", "--precision", ""],
     "--precision must be one of fp32, bf16, fp16 or fp8, got ''"),
    (["--gpus", "8", "--hardware", ""], "--hardware '' is neither"),
    (["--gpus", "8", "--layout", "tp=2,sp=1,tp=4"], "--layout fixes tp twice"),
    (["--gpus", "8", "--layout", "tp=0"], "--layout tp=0"),
    (["--gpus", "8", "--top", "0"], "--top must be positive, got 0"),
    (["--gpus", "8", "--seq-len", "4096", "--max-seq-len", "1024"], "exceeds --max-seq-len 1024"),
])
def test_plan_bad_input_is_one_line(capsys, args, message):
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("model,seq_len", [("gpt2", 1024), ("llama-tiny", 256)])
def test_plan_defaults_name_the_profile_and_take_the_models_sequence(capsys, monkeypatch, model,
                                                                     seq_len):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # this machine: no GPU
    assert main(["plan", "--model", model, "--gpus", "4", "--top", "1"]) == 0
    header = capsys.readouterr().out.splitlines()
    assert f"seq {seq_len}," in header[0]
    assert "cpu-gloo" in header[1] and "this machine's profile, no --hardware given" in header[1]
    assert main(["plan", "--model", model, "--gpus", "4", "--max-seq-len", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 512


@pytest.mark.parametrize("args,message", [
    (["--ranks", "10000000"], "--ranks 10000000 is more processes than this machine's memory"),
    (["--ranks", "1"], "--ranks must be at least 2"),
    (["--out", ""], "--out is empty"),
    (["--out", "profile.txt"], "must be a .toml file"),
    (["--out", "/proc/no/such/x.toml"], "its folder cannot be created"),
    (["--hardware", "h200"], "--hardware names the profile --from-run fits"),
    (["--from-run", "/no/such/run"], "is not a run directory"),
])
def test_plan_calibrate_bad_input_is_one_line_before_measuring(capsys, args, message):
    """Refused before anything is measured (a measurement takes minutes); was a MemoryError,
    a profile measured then not written, or a flag silently ignored."""
    if "/proc/no/such/x.toml" in args and not os.path.isdir("/proc/self"):
        pytest.skip("needs /proc, where no folder can be created")
    code = main(["plan", "calibrate", *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_plan_calibrate_writes_a_profile_atomically(tmp_path, monkeypatch, capsys):
    import sys
    import types

    from meshtrain.planner.calibrate import check_physical

    def calibrate_machine(ranks, report):
        report("matmul fit: ...")
        return dataclasses.replace(NODE, name=f"here-{ranks}")

    fake = types.ModuleType("meshtrain.planner.calibrate")
    fake.calibrate_machine, fake.check_physical = calibrate_machine, check_physical
    monkeypatch.setitem(sys.modules, "meshtrain.planner.calibrate", fake)
    out = tmp_path / "here.toml"
    assert main(["plan", "calibrate", "--out", str(out), "--ranks", "2"]) == 0
    assert tomllib.loads(out.read_text())["name"] == "here-2"
    assert [p.name for p in tmp_path.iterdir()] == ["here.toml"]
    said = capsys.readouterr().out.splitlines()  # what it measured, the profile, the file
    assert said[0].startswith("meshtrain: measuring this machine with 2 ranks")
    assert said[1] == "meshtrain: matmul fit: ..."
    assert said[2].startswith("meshtrain: profile here-2:")
    assert f"--hardware {out}" in said[3]
    # a fit no machine has is refused in one line, and nothing is written
    fake.calibrate_machine = lambda ranks, report: dataclasses.replace(NODE, matmul_efficiency=2.09)
    assert main(["plan", "calibrate", "--out", str(tmp_path / "bad.toml"), "--ranks", "2"]) == 2
    refused = capsys.readouterr().err.strip().splitlines()
    assert len(refused) == 1 and "matmul_efficiency 2.09 (not in (0, 1])" in refused[0]
    assert not (tmp_path / "bad.toml").exists()


# --- train --layout auto ---------------------------------------------------------------------

def test_layout_flags_given_are_fixed():
    cfg = build_config({}, {"parallel": {"layout": "zero=1", "tp": 2},
                            "train": {"micro_batch": 4}})
    assert fixed_fields(cfg, {("parallel", "tp"), ("train", "micro_batch")}) == {
        "zero": 1, "tp": 2, "micro_batch": 4}
    cfg = build_config({}, {"parallel": {"layout": "tp=1", "tp": 2}})
    with pytest.raises(ValueError, match="`tp` 2 contradicts `layout` tp=1"):
        fixed_fields(cfg, {("parallel", "tp")})


def test_train_layout_auto_end_to_end(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(synthetic_corpus(20_000, seed=3).tobytes())
    hardware = tmp_path / "cpu.toml"
    hardware.write_text(Hardware(
        name="test-cpu", peak_tflops=0.05, hbm_gib=4, gpus_per_node=2,
        intra_node_gbytes_per_s=2.0, inter_node_gbytes_per_s=1.0, hbm_gbytes_per_s=10.0,
        layer_overhead_s=1e-4, default_precision="fp32").to_toml())
    out = tmp_path / "run"
    done = run_cli("train", "--nproc", "2", "--layout", "auto", "--hardware", str(hardware),
                   "--device", "cpu", "--data", str(corpus), "--seq-len", "32",
                   "--global-batch", "4", "--steps", "3", "--eval-every", "0",
                   "--out", str(out))
    chose = next(line for line in done.stderr.splitlines() if "chose" in line)
    assert chose.startswith("meshtrain: --layout auto chose tp=")
    assert "for 2 rank(s) on test-cpu: predicted" in chose and "runner-up" in done.stderr
    spec = chose.split(" chose ")[1].split(" ")[0]
    saved = tomllib.loads((out / "config.toml").read_text())
    chosen = dict(item.split("=") for item in spec.split(","))
    assert str(saved["parallel"]["tp"]) == chosen["tp"]
    assert str(saved["train"]["micro_batch"]) == chosen["mb"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


@pytest.mark.parametrize("name,profile", [("NVIDIA H100 80GB HBM3", "h100-80g"),
                                          ("NVIDIA A100-SXM4-80GB", "a100-80g-selene"),
                                          ("NVIDIA A100-SXM4-40GB", "a100-40g"),
                                          ("Tesla V100-SXM3-32GB", "v100-32g-dgx2h"),
                                          ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"),
                                          ("AMD Instinct MI300X", "mi300x"),
                                          ("NVIDIA GeForce RTX 4090", None)])
def test_default_hardware_follows_the_cuda_device(monkeypatch, name, profile):
    import torch

    from meshtrain.cli.auto_layout import default_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    if profile is None:
        with pytest.raises(ValueError, match="no built-in hardware profile matches"):
            default_hardware("auto")
    else:
        assert default_hardware("auto").name == profile
    # --device cpu plans for the CPU even with CUDA present.
    assert default_hardware("cpu") is BUILT_IN["cpu-gloo"]


@pytest.mark.parametrize("field,value,bound", [
    ("peak_tflops", "nan", "(0, inf)"), ("hbm_gib", "inf", "(0, inf)"),
    ("intra_node_gbytes_per_s", "-5.0", "(0, inf)"), ("collective_latency_s", "-1e-05",
                                                      "[0, inf)"),
    ("overlap_efficiency", "1.5", "[0, 1]"), ("matmul_efficiency", "0.0", "(0, inf)")])
def test_a_hardware_file_with_impossible_numbers_is_refused(capsys, tmp_path, field, value,
                                                           bound):
    text = BUILT_IN["a100-40g"].to_toml()
    path = tmp_path / "hw.toml"
    path.write_text(re.sub(rf"^{field} = .*$", f"{field} = {value}", text, flags=re.M))
    assert main(["plan", "--gpus", "8", "--hardware", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"meshtrain: error: --hardware file {path}: {field} must be a number in {bound}, got"
        f" {float(value)!r}; fix the file or calibrate again\n")


@pytest.mark.parametrize("name", UNFITTED)
def test_the_data_sheet_profiles_plan_and_say_they_are_unfitted(capsys, name):
    assert not any(row["hardware"] == name for row in load_rows())  # left out of validate
    hw = BUILT_IN[name]
    assert hw.peak_tflops > BUILT_IN["a100-80g-selene"].peak_tflops and hw.attention_efficiency
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "8192", "--global-batch", "64",
                 "--gpus", "8", "--hardware", name, "--top", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[1]
    assert f"8 x {name} ({hw.hbm_gib:g} GiB" in header and "not fitted" in header


def test_zero_impl_deepspeed_is_planned_as_zero3_and_never_trained(capsys, tmp_path):
    found = search(preset("llama3-8b"), BUILT_IN["h100-80g"], gpus=8, seq_len=8192,
                   global_batch=64, precision="bf16", fixed={"zero_impl": "deepspeed"})
    assert found.ranked and {p.layout.zero for p in found.ranked} == {3}
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "8192", "--global-batch", "64",
                 "--gpus", "8", "--hardware", "h100-80g", "--top", "1", "--layout",
                 "zero_impl=deepspeed"]) == 0
    assert "\n     (no command: --zero-impl deepspeed prices" in capsys.readouterr().out
    assert main(["train", "--model", "gpt2", "--zero", "3", "--zero-impl", "deepspeed",
                 "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (
        "meshtrain: error: --zero-impl deepspeed prices another system's ZeRO-3 in the planner;"
        " meshtrain trains with its own: drop --zero-impl\n")
    assert not (tmp_path / "run").exists()
    plan = ParallelPlan(dp=8, zero=3, zero_impl="deepspeed")  # the Python API refuses it too
    with pytest.raises(SettingError) as refused:
        plan.check_trainable()
    assert refused.value.code is Code.ZERO_IMPL_TRAIN
    with pytest.raises(SettingError) as refused:
        dataclasses.replace(plan, zero=1).validate(preset("gpt2"), world_size=8,
                                                   global_batch=8, seq_len=64)
    assert refused.value.code is Code.ZERO_IMPL_STAGE


def test_a_cpu_profile_measured_at_four_ranks_is_scaled_to_the_ranks_planned():
    """cpu-gloo is one of 4 one-thread ranks sharing 2 cores: 2 ranks compute on a core each
    and share nothing, 8 on a quarter each; GPU profiles and the measured count stay as they
    are. Unscaled, 2 ranks were priced at half a core with the pipeline bubble absorbed by
    sharing they do not have, and the search put the tiny model on pp 2 (measured 0.077 s a
    step against dp 2's 0.043)."""
    cpu, gpu = BUILT_IN["cpu-gloo"], BUILT_IN["h100-80g"]
    assert cpu.for_ranks(4) is cpu and gpu.for_ranks(2) is gpu
    two, eight = cpu.for_ranks(2), cpu.for_ranks(8)
    assert two.fp32_peak_tflops == pytest.approx(2 * cpu.fp32_peak_tflops)
    assert two.hbm_gbytes_per_s == pytest.approx(2 * cpu.hbm_gbytes_per_s)
    assert two.layer_overhead_s == pytest.approx(cpu.layer_overhead_s / 2)
    assert (two.oversubscription, eight.oversubscription) == (1.0, 4.0)
    assert eight.fp32_peak_tflops == pytest.approx(cpu.fp32_peak_tflops / 2)
    best = search(preset("tiny"), cpu, gpus=2, seq_len=256, global_batch=16,
                  precision="fp32").best()
    assert (best.layout.pp, best.layout.dp) == (1, 2)
