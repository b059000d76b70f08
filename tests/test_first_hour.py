"""What a new user meets in the first hour, each check cheap: the version, a mistyped subcommand
or flag answered with the closest name, `sample`'s readable defaults, counts and memory in
human units, an ETA that leaves out the first (compiling) step, and a calibration no machine
could have refused in one line."""

import dataclasses
from importlib.metadata import version

import pytest

from meshtrain.cli import units
from meshtrain.cli.main import main
from meshtrain.cli.parsers import build_parser
from meshtrain.planner.calibrate import CalibrationError, check_physical
from meshtrain.planner.hardware import load_hardware
from meshtrain.training import metrics


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshtrain {version('meshtrain')}"


@pytest.mark.parametrize("argv,hint", [
    (["trian"], "did you mean train?"),
    (["plan", "calibrat"], "did you mean calibrate?"),
    (["export", "RUN", "--out", "m.safetensors", "--formt", "hf"], "did you mean --format?"),
    (["export", "RUN", "--out", "m.safetensors", "--format", "hff"], "did you mean hf?"),
    (["train", "--modle", "tiny"], "did you mean --model?"),
], ids=["subcommand", "plan tool", "flag", "choice", "train flag"])
def test_a_mistyped_name_is_answered_with_the_closest(capsys, argv, hint):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(hint), last


def test_nothing_close_suggests_nothing(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--zzzzzz"])
    assert "did you mean" not in capsys.readouterr().err


def test_sample_samples_by_default_and_greedy_is_one_flag():
    args = build_parser().parse_args(["sample", "RUN"])
    assert args.top_k > 0 and 0 < args.temperature < 1
    assert build_parser().parse_args(["sample", "RUN", "--top-k", "0"]).top_k == 0


def test_human_units():
    assert [units.count_text(n) for n in (233_000, 4_091_000, 124_400_000, 8.03e9, 174.6e9)] \
        == ["233K", "4.1M", "124M", "8.0B", "175B"]
    assert units.memory_text(0.016) == "16.4 MiB" and units.memory_text(69.9) == "69.9 GiB"
    assert units.memory_unit(0.5) == ("MiB", 1024.0)


def test_eta_leaves_out_the_first_step(monkeypatch):
    clock = iter([0.0, 30.0, 31.0, 32.0])  # started; step 1 ends (30 s compiling); 1 s a step
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    progress = metrics.Progress(total=12, initial=0, enabled=False)
    progress.update(step=1, loss=1.0, tokens_per_s=1.0, tflops=1.0)
    assert progress._per_step(2) == pytest.approx(1.0)  # (31 - 30) / 1, not 31 / 2
    progress.close()


def test_a_calibration_no_machine_has_is_refused_in_one_line():
    good = load_hardware("cpu-gloo")
    check_physical(good)
    for wrong in (dict(matmul_efficiency=2.09), dict(collective_latency_s=0.0)):
        with pytest.raises(CalibrationError, match=r"^calibration: the fit gives .* no machine"
                                                   r" has: .*calibrate again") as refused:
            check_physical(dataclasses.replace(good, **wrong))
        assert "\n" not in str(refused.value)
