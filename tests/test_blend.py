"""Blended data (`data_path`): exact proportions, batches independent of the layout, refusals,
and a run that trains, evaluates and resumes at another layout on two token files."""

import json
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from harness import raises_as_flags

from meshtrain.cli.main import _train_config, check_train, main
from meshtrain.cli.parsers import build_parser
from meshtrain.config.run_config import build_config, validate
from meshtrain.data.blend import BlendedSampler, load_data
from meshtrain.data.corpus import BatchSampler, synthetic_corpus
from meshtrain.errors import Code, SettingError
from meshtrain.training.metrics import read_metrics

WEIGHTS = (Fraction(7, 10), Fraction(3, 10))
OFFSETS = (0, 1000)  # source i's tokens lie in [OFFSETS[i], OFFSETS[i] + 256)


def _sampler(global_batch=8, micro_batch=2, weights=WEIGHTS):
    sources = [synthetic_corpus(5_000, seed=i).astype(np.uint16) + OFFSETS[i]
               for i in range(len(weights))]
    return BlendedSampler(sources, weights, seq_len=16, global_batch=global_batch,
                          micro_batch=micro_batch, seed=3, names=("`a`", "`b`"))


def _sequences(micro_batches) -> torch.Tensor:
    return torch.cat([inputs for inputs, _ in micro_batches])


def _source_of(sequences: torch.Tensor) -> np.ndarray:
    return (sequences[:, 0] >= OFFSETS[1]).long().numpy()


def test_proportions_are_exact_after_every_step():
    """After n sequences, source i gave within 1 of w_i n (0.7 x 8 = 5.6 per step)."""
    sampler, counts = _sampler(), np.zeros(2, dtype=np.int64)
    for step in range(100):
        sources = _source_of(_sequences(sampler.micro_batches(step, dp_rank=0, dp_size=1)))
        counts += np.bincount(sources, minlength=2)
        n = 8 * (step + 1)
        assert all(abs(count - w * n) < 1 for count, w in zip(counts, WEIGHTS, strict=True))
    assert counts.tolist() == [560, 240]
    eval_sources = _source_of(_sequences(sampler.eval_batches(5, dp_rank=0, dp_size=1)))
    assert np.bincount(eval_sources).tolist() == [28, 12]  # evaluation blends alike


@pytest.mark.parametrize("dp,micro_batch", [(2, 2), (4, 1), (1, 4)])
def test_the_global_batch_is_the_same_at_any_layout(dp, micro_batch):
    """The ranks' sequences, concatenated, are the dp 1 batch: a resume at any layout reads the
    same stream. A fresh sampler gives the same batch: nothing depends on earlier draws."""
    reference = _sampler()
    for step in (0, 13):
        whole = _sequences(reference.micro_batches(step, dp_rank=0, dp_size=1))
        ranks = [_sampler(micro_batch=micro_batch).micro_batches(step, dp_rank=r, dp_size=dp)
                 for r in range(dp)]
        assert torch.equal(torch.cat([_sequences(share) for share in ranks]), whole)
    assert not torch.equal(_sequences(reference.micro_batches(1, dp_rank=0, dp_size=1)), whole)
    assert set(_source_of(whole)) == {0, 1}  # the sources are spread over the batch
    assert _source_of(whole).tolist() != sorted(_source_of(whole))


def _token_file(tmp_path, name, seed, *, vocab_size=257, eod_id=256):
    """A byte token file whose lines are documents (each newline becomes `eod_id`)."""
    tokens = synthetic_corpus(6_000, seed=seed).astype(np.uint16)
    tokens[tokens == ord("\n")] = eod_id
    path = tmp_path / name
    tokens.tofile(path)
    meta = {"dtype": "uint16", "vocab_size": vocab_size, "eod_id": eod_id, "tokenizer": "bytes"}
    (tmp_path / f"{name}.json").write_text(json.dumps(meta))
    return str(path)


def test_one_file_is_that_file(tmp_path):
    """`data_path` FILE draws `data` FILE's batches, with `BatchSampler`'s own arithmetic (so
    does a one-source `BlendedSampler`)."""
    path = _token_file(tmp_path, "a.bin", 1)
    sizes = dict(seq_len=16, global_batch=4, micro_batch=2, seed=0)
    blended = load_data(None, ["2.5", path]).samplers(0.1, **sizes)
    plain = load_data(path, None).samplers(0.1, **sizes)
    one = BlendedSampler([plain[0].data.tokens], (Fraction(1),), names=("`a`",), **sizes)
    assert type(blended[0]) is BatchSampler
    for a, b, c in zip(blended[0].micro_batches(3, dp_rank=0, dp_size=1),
                       plain[0].micro_batches(3, dp_rank=0, dp_size=1),
                       one.micro_batches(3, dp_rank=0, dp_size=1), strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[0], c[0])


def _validate(data_path, data=None):
    cfg = build_config({}, {"data": {"data": data, "data_path": data_path}})
    validate(cfg, 1)


@pytest.mark.parametrize("data_path,message", [
    (["0.7", "a.bin", "0.3"], "--data-path takes WEIGHT FILE pairs (or one FILE), got 3 values:"
                              " give a weight before each file, as in --data-path 0.7 a.bin 0.3"
                              " b.bin"),
    (["a.bin", "b.bin"], "--data-path weight 'a.bin' (before b.bin) is not a number"),
    (["nan", "a.bin"], "--data-path weight 'nan' (before a.bin) is not a number"),
    (["0.5", "a.bin", "0", "b.bin"], "--data-path weight 0 of b.bin must be positive: drop the"
                                     " file or give it a weight above 0"),
    ([], "got 0 values"),
])
def test_malformed_blends_are_refused_at_validation(data_path, message):
    with raises_as_flags(re.escape(message)) as error:
        _validate(data_path)
    assert error.value.code is Code.DATA_BLEND


def test_refusals_name_the_settings_and_files(tmp_path):
    a, b = _token_file(tmp_path, "a.bin", 1), _token_file(tmp_path, "b.bin", 2)
    with raises_as_flags("^--data and --data-path exclude each other: put every file in"
                         " --data-path"):
        _validate(["1", a], data=b)
    missing = str(tmp_path / "missing.bin")
    with raises_as_flags(f"^--data-path names {missing}: no such file"):
        load_data(None, ["1", a, "1", missing])
    (tmp_path / "b.bin.json").unlink()
    with raises_as_flags(f"^--data-path {b}: a .bin file needs a sidecar b.bin.json"):
        load_data(None, ["1", a, "1", b])
    for name, kw, what in [("c.bin", {"vocab_size": 300}, "vocab_size (257 and 300)"),
                           ("d.bin", {"eod_id": 10}, "eod_id (256 and 10)")]:
        other = _token_file(tmp_path, name, 3, **kw)
        with pytest.raises(SettingError, match=re.escape(f"`data_path` files {a} and {other}"
                                                         f" differ in {what}: blend files")):
            load_data(None, ["1", a, "1", other])


def test_the_command_line_refuses_in_one_line_before_any_rank(tmp_path, capsys):
    a = _token_file(tmp_path, "a.bin", 1)
    for values, needle in [(["0.7", a, "0.3"], "--data-path takes WEIGHT FILE pairs"),
                           (["0.7", a, "0.3", "absent.bin"], "--data-path names absent.bin: no"
                                                              " such file")]:
        argv = ["train", "--device", "cpu", "--nproc", "2", "--data-path", *values, "--out",
                str(tmp_path / "run")]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert not (tmp_path / "run").exists()


def test_toml_weights_may_be_numbers_or_text():
    cfg = build_config({"data": {"data_path": [0.7, "a.bin", "3", "b.bin"]}}, {})
    assert cfg.data.data_path == ["0.7", "a.bin", "3", "b.bin"]
    args = build_parser().parse_args(["train", "--data-path", "0.7", "a.bin", "3", "b.bin"])
    assert _train_config(args).data.data_path == cfg.data.data_path


def test_a_blended_run_resumes_at_another_micro_batch(tmp_path, capsys):
    """Packed documents (the files share eod_id), evaluation on both held-out tails, and a
    resume at another layout (micro-batch 1) that continues the uninterrupted run's losses; a
    changed blend on resume is announced. The eod-masked loss is the batch's per-token mean,
    so it does not move with the micro-batch either."""
    a, b = _token_file(tmp_path, "a.bin", 1), _token_file(tmp_path, "b.bin", 2)
    flags = ["train", "--device", "cpu", "--num-layers", "1", "--hidden-size", "32",
             "--num-heads", "2", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2",
             "--steps", "4", "--eval-every", "2", "--eval-batches", "1", "--document-mask",
             "--reset-positions", "--eod-mask-loss", "--data-path", "0.7", a, "0.3", b]
    assert main([*flags, "--out", str(tmp_path / "whole")]) == 0
    parts = str(tmp_path / "parts")
    assert main([*flags, "--out", parts, "--stop-at", "2"]) == 0
    assert main([*flags, "--out", parts, "--resume", "--micro-batch", "1"]) == 0
    whole, resumed = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("whole", "parts"))
    assert [row["step"] for row in resumed] == [row["step"] for row in whole]
    for row, expected in zip(resumed, whole, strict=True):
        key = "loss" if "loss" in row else "eval_loss"
        assert row[key] == pytest.approx(expected[key], rel=1e-5), row
    capsys.readouterr()
    argv = [*flags[:-4], "0.5", a, "0.5", b, "--out", parts, "--resume", "--steps", "6"]
    check_train(_train_config(build_parser().parse_args(argv)), 1)
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"meshtrain: --data-path changed from 0.7 {a} 0.3 {b} to 0.5 {a} 0.5 {b} on resume: the"
        " batches from step 4 on are drawn from the new data")
