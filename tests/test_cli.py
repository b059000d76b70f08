"""The `meshtrain` command: help, config precedence, bad input, and a real multi-rank run."""

import json
import signal
import tomllib

import pytest
from harness import run_cli

from meshtrain.cli.flags import as_flags
from meshtrain.cli.main import _train_config, main
from meshtrain.cli.parsers import build_parser
from meshtrain.config import run_config as config
from meshtrain.config.run_config import build_config, flag_fields


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for _, f in flag_fields():
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        assert flag in text, flag
    assert "--config" in text and "--resume" in text and "--stop-at" in text


def test_config_file_then_flags(tmp_path):
    cfg = build_config({"train": {"steps": 7, "lr": 0.5}, "parallel": {"tp": 1}},
                       {"train": {"lr": 0.25}})
    assert (cfg.train.steps, cfg.optimizer.lr, cfg.plan.tp) == (7, 0.25, 1)
    again = build_config(tomllib.loads(cfg.to_toml()), {})
    assert again.to_dict() == cfg.to_dict()  # the resolved config round-trips through TOML


@pytest.mark.parametrize("overrides", [{}, {"model": {"model": "llama-tiny", "num_layers": 3}},
                                       {"parallel": {"tp": 2}, "train": {"seq_len": 512}}])
def test_config_toml_names_what_the_run_decided_and_reads_back_the_same(overrides):
    cfg = build_config({}, overrides)
    plan, model = cfg.plan.resolved(4), cfg.model_config(256)
    saved = tomllib.loads(cfg.resolved(model, plan).to_toml())
    assert saved["model"]["model"] == (cfg.model.model or "tiny")
    assert saved["parallel"]["dp"] == plan.dp and saved["model"]["vocab_size"] == 256
    again = build_config(saved, {})
    assert again.model_config(256) == model and again.plan == plan


def test_degrees_not_given_are_one_and_dp_fills_the_world(corpus):
    from meshtrain.cli.main import check_train

    def plan(*flags, world=None):
        cfg = _train_config(build_parser().parse_args(
            ["train", "--device", "cpu", "--data", corpus, "--micro-batch", "2", "--out",
             "/nonexistent/run", *flags]))
        return check_train(cfg, config.world_size_of(cfg, world)).degrees

    assert plan("--nproc", "4", "--dp", "4") == {"pp": 1, "dp": 4, "cp": 1, "tp": 1, "ep": 1}
    assert plan("--nproc", "4", "--tp", "2") == {"pp": 1, "dp": 2, "cp": 1, "tp": 2, "ep": 1}
    assert plan("--pp", "2", "--tp", "2")["dp"] == 1  # no --nproc: the product of the degrees
    assert plan() == {"pp": 1, "dp": 1, "cp": 1, "tp": 1, "ep": 1}  # the default run
    assert plan(world=8)["dp"] == 8  # under torchrun: its world


def test_settings_become_flags_only_in_the_cli():
    assert as_flags("`pp_schedule` 2bw needs `pp` > 1 and `micro_batch` > 0") == \
        "--pp-schedule 2bw needs --pp > 1 and --micro-batch > 0"
    assert as_flags("`model` 'tiny', `config` file, `num_kv_heads`") == \
        "--model 'tiny', --config file, --num-kv-heads"
    assert as_flags("`hidden` is no setting") == "hidden is no setting"


def _error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert len(err.splitlines()) == 1 and err.startswith("meshtrain: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("flags,needle", [
    (["--tp", "3"], "number of heads (4) must be divisible by tp (3)"),
    (["--tp", "1", "--hidden-size", "66"], "divisible by the number of heads"),
    (["--nproc", "3", "--tp", "2"], "world size 3 is not divisible by tp x pp x cp"),
    (["--nproc", "4", "--tp", "2", "--dp", "3"], "does not equal the world size 4"),
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--steps", "0"], "--steps must be positive"),
    (["--seq-len", "-4"], "--seq-len must be positive"),
    (["--global-batch", "0"], "--global-batch must be positive"),
    (["--lr", "-1"], "--lr and --min-lr must be >= 0"),
    (["--global-batch", "10", "--micro-batch", "4"], "--global-batch 10 must be divisible by"
                                                     " --micro-batch x dp = 4 x 1 = 4"),
    (["--stop-at", "50", "--steps", "20"], "--stop-at must be between 1 and --steps (20)"),
    (["--data", "/nonexistent/corpus.txt"], "--data"),
    (["--config", "/nonexistent.toml"], "--config /nonexistent.toml: no such file"),
    (["--seq-len", "20000"], "too short for --seq-len 20000"),
    (["--nproc", "4", "--tp", "1", "--ep", "4", "--moe-experts", "6", "--micro-batch", "4"],
     "--moe-experts 6 must be divisible by --ep 4"),
    (["--moe-experts", "2", "--moe-top-k", "3"], "--moe-top-k 3 exceeds --moe-experts 2"),
    (["--moe-experts", "4", "--moe-capacity-factor", "-1"],
     "--moe-capacity-factor must be > 0, or 0 for dropless"),
    (["--moe-experts", "4", "--moe-bias-rate", "-0.5"], "--moe-bias-rate must be a finite"),
    (["--nproc", "4", "--tp", "2", "--ep", "4", "--moe-experts", "4"],
     "ep=4 must divide dp x cp = 2 x 1 = 2"),
    (["--tp", "1", "--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    (["--nproc", "4", "--tp", "2", "--cp", "2", "--seq-len", "34"],
     "--seq-len 34 must be divisible by 2 x cp = 4"),
    (["--recompute", "most"], "--recompute must be none, selective or full"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**63 - 1, got -1"),
    (["--seed", str(2**64)], f"--seed must be an integer from 0 to 2**63 - 1, got {2**64}"),
    (["--threads", "100000"], "--threads 100000 is more than this machine's"),
    (["--nproc", "8", "--tp", "1", "--pp", "8"], "--pp 8 exceeds the model's 4 layers"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "2bw", "--trace", "t"],
     "--trace draws one flush step; a 2bw step overlaps its neighbours"),
    (["--nproc", "2", "--tp", "1", "--zero", "2", "--pp", "2"],
     "--zero 2 does not combine with --pp 2"),
    (["--nproc", "2", "--tp", "1", "--offload-optimizer", "cpu"],
     "--offload-optimizer cpu offloads ZeRO's optimizer shard: add --zero 1"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-layers", "1,2"],
     "--pp-layers 1,2 sums to 3: the counts must sum to the model's 4 layers"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-layers", "1,1,2"],
     "--pp-layers 1,1,2 has 3 entries: give one layer count per pipeline stage (2)"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-layers", "0,4"],
     "--pp-layers 0,4 leaves a stage without layers"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-layers", "2;2"],
     "--pp-layers must be comma-separated layer numbers"),

    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "zigzag"],
     "--pp-schedule must be gpipe, 1f1b, interleaved, 2bw, zb-h1, zb-v or eager-1f1b, got"
     " 'zigzag'"),
    (["--tp", "1", "--pp-schedule", "2bw"], "--pp-schedule 2bw needs --pp > 1"),
    (["--nproc", "4", "--tp", "1", "--pp", "4", "--pp-schedule", "2bw", "--global-batch", "6",
      "--micro-batch", "2"], "2bw needs at least --pp (4) micro-batches per step, got global"
                             " batch / (micro-batch x dp) = 3"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "2bw", "--precision", "bf16"],
     "--pp-schedule 2bw supports --precision fp32 only, got bf16"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "2bw", "--moe-experts", "2"],
     "--pp-schedule 2bw does not support MoE layers yet"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "interleaved",
      "--global-batch", "24"], "(global batch / (micro-batch x dp) = 3) divisible by --pp 2"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "interleaved",
      "--virtual-stages", "2", "--num-layers", "6"],
     "needs the 6 layers divisible by --pp x --virtual-stages = 2 x 2"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "interleaved",
      "--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
    (["--tp", "1", "--pp-schedule", "interleaved", "--virtual-stages", "2"],
     "--virtual-stages 2 needs --pp > 1"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--virtual-stages", "2"],
     "--virtual-stages 2 needs --pp-schedule interleaved (got 1f1b)"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "interleaved",
      "--virtual-stages", "4"], "--pp x --virtual-stages = 2 x 4 exceeds the model's 4 layers"),
    (["--nproc", "2", "--tp", "1", "--pp", "2", "--pp-schedule", "interleaved",
      "--virtual-stages", "2", "--pp-layers", "2,2"], "--pp-layers 2,2 has 2 entries"),
    (["--seq-len", "64", "--max-seq-len", "32"], "--seq-len 64 exceeds --max-seq-len 32"),
    (["--nproc", "2", "--tp", "2", "--etp", "3", "--moe-experts", "4"],
     "--etp 3 must be 1 (whole experts) or --tp 2"),
    (["--nproc", "4", "--tp", "2", "--ep", "8", "--etp", "1", "--moe-experts", "8"],
     "--ep x --etp = 8 x 1 must divide tp x dp x cp = 2 x 2 x 1 = 4"),
    (["--nproc", "2", "--tp", "2", "--etp", "1"], "--etp 1 keeps MoE experts whole: it needs"),
    (["--bucket-mb", "1e-9"], "--bucket-mb must be positive"),
])
def test_bad_input_is_one_line(capsys, corpus, tmp_path, flags, needle):
    argv = ["train", "--device", "cpu", "--data", corpus, "--out", str(tmp_path / "run"), *flags]
    assert needle in _error(capsys, argv)


def test_bad_files_are_one_line(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "--data" in _error(capsys, ["train", "--device", "cpu", "--data", str(empty)])
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[train\nsteps = ")
    assert "is not valid TOML" in _error(capsys, ["train", "--device", "cpu", "--config",
                                                  str(bad_toml)])
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nstepz = 3\n")
    assert "unknown setting train.stepz" in _error(capsys, ["train", "--device", "cpu",
                                                            "--config", str(unknown)])


@pytest.mark.extended  # the README's commands run this path in the default suite (test_docs.py)
def test_train_resume_export_sample_end_to_end(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--device", "cpu", "--data", corpus, "--seq-len", "32", "--global-batch", "4",
              "--micro-batch", "2",
              "--steps", "6", "--eval-every", "3", "--out", str(out)]
    stopped = run_cli("train", "--nproc", "2", "--tp", "2", "--stop-at", "3", *common)
    assert "stopped at step 3 of 6 as --stop-at asked; continue: the same command with --resume" \
        in stopped.stdout  # not a run that looks finished
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= train_rows[0].keys()
    assert any("eval_loss" in r for r in rows)
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["parallel"]["tp"] == 2 and saved["train"]["steps"] == 6
    assert (saved["model"]["model"], saved["model"]["vocab_size"], saved["model"]["max_seq_len"],
            saved["parallel"]["dp"]) == ("tiny", 256, 256, 1)  # what the run decided

    # An earlier run in --out without --resume is refused, before any rank starts (so here).
    capsys.readouterr()
    assert main(["train", "--nproc", "2", *common]) == 2
    refused = capsys.readouterr().err
    assert "holds an earlier run" in refused and len(refused.strip().splitlines()) == 1

    # Resume at another layout (dp=2 instead of tp=2) and finish.
    run_cli("train", "--nproc", "2", "--tp", "1", "--resume", *common)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]

    # A corrupt checkpoint stops a resume with one line, before any rank starts.
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
    assert main(["export", str(out), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert (tmp_path / "model.safetensors").stat().st_size > 0
    sample = run_cli("sample", str(out), "--prompt", "the ", "--max-new-tokens", "12",
                      "--device", "cpu")
    assert sample.stdout.startswith("the ") and len(sample.stdout) >= 12

    (latest / "rank_00000.safetensors").write_bytes(b"garbage")
    capsys.readouterr()
    assert main(["train", "--nproc", "2", "--resume", *common[:-2], "--steps", "8",
                 "--out", str(out)]) == 2
    corrupt = capsys.readouterr().err
    assert "corrupt or truncated" in corrupt and len(corrupt.strip().splitlines()) == 1


def test_trace_writes_the_pipeline_timeline(corpus, tmp_path, capsys):
    common = ["--device", "cpu", "--data", corpus, "--seq-len", "16", "--global-batch", "4",
              "--micro-batch", "2", "--steps", "2", "--eval-every", "0", "--tp", "1",
              "--trace", str(tmp_path / "trace")]
    result = run_cli("train", "--nproc", "2", "--pp", "2", "--out", str(tmp_path / "pp"),
                      *common)
    assert "pipeline timeline of step 2" in result.stderr
    trace = json.loads((tmp_path / "trace" / "pipeline.json").read_text())
    names = sorted(e["name"] for e in trace["traceEvents"] if e.get("cat") == "compute")
    assert names == sorted([f"{k}{i}" for k in "FB" for i in range(2)] * 2)  # two stages
    idle = json.loads((tmp_path / "trace" / "pipeline_idle.json").read_text())
    assert [r["stage"] for r in idle["stages"]] == [0, 1]
    # without a pipeline: a notice, no files
    capsys.readouterr()
    assert main(["train", "--nproc", "1", "--out", str(tmp_path / "dense"), *common[:-1],
                 str(tmp_path / "dense_trace")]) == 0
    assert "with --pp 1 it writes nothing" in capsys.readouterr().err
    assert not (tmp_path / "dense_trace").exists()


def test_train_run_in_this_process_gives_its_signal_handlers_back(capsys):
    """`train` holds stop signals until its run arms; called in a process that goes on, the
    handlers it found come back (else that process, and what it forks, ignores SIGTERM)."""
    from meshtrain.operations.stopping import STOP_SIGNALS

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    assert main(["train", "--device", "cpu", "--steps", "0"]) == 2  # refused before arming
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before
