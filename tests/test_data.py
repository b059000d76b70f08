"""Tokenizer, corpora, token files and stateless, DP-invariant batch sampling."""

import hashlib
import json
import re

import numpy as np
import pytest
import torch
from harness import raises_as_flags

from meshtrain.data.corpus import (
    BatchSampler,
    TokenDataset,
    decode,
    encode,
    load_corpus,
    split_tokens,
    stdlib_corpus,
    synthetic_corpus,
)
from meshtrain.errors import Code

# Changing the synthetic corpus changes every golden loss: update both together, deliberately.
SYNTHETIC_10K_SHA256 = "567bce7bc6980ab087c3f17d12cdb28e98c7a1e4007a440603795228d643b6d1"


def test_tokenizer_round_trip():
    text = "def f(x):\n    return x  # é, 漢字, 🙂"
    ids = encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert decode(ids) == text
    assert decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert decode(ids[:-1]).endswith("\ufffd")  # a cut multi-byte character is replaced


def test_synthetic_corpus_is_deterministic_ascii():
    corpus = synthetic_corpus(10_000, seed=0)
    assert corpus.dtype == np.uint8 and corpus.shape == (10_000,)
    assert hashlib.sha256(corpus.tobytes()).hexdigest() == SYNTHETIC_10K_SHA256
    assert np.array_equal(corpus, synthetic_corpus(10_000, seed=0))
    assert not np.array_equal(corpus, synthetic_corpus(10_000, seed=1))
    assert corpus.max() < 128
    assert len(synthetic_corpus()) == 200_000
    # A longer corpus extends the shorter one: the length only decides where it stops.
    assert np.array_equal(synthetic_corpus(20_000)[:10_000], corpus)


def test_stdlib_corpus():
    corpus = stdlib_corpus(max_bytes=1 << 20)
    assert corpus.dtype == np.uint8 and len(corpus) == 1 << 20
    assert np.array_equal(corpus, stdlib_corpus(max_bytes=1 << 20))
    assert b"def " in corpus.tobytes()
    assert np.array_equal(stdlib_corpus(max_bytes=1000), corpus[:1000])


def _write_bin(tmp_path, tokens, meta, name="data.bin"):
    path = tmp_path / name
    np.asarray(tokens).tofile(path)
    if meta is not None:
        (tmp_path / f"{name}.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    return path


def _tokens_and_vocab(path):
    corpus = load_corpus(path)
    return corpus.tokens, corpus.vocab_size


def test_load_text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("hello, wörld\n", encoding="utf-8")
    tokens, vocab = _tokens_and_vocab(str(path))
    assert vocab == 256 and decode(tokens) == "hello, wörld\n"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_load_bin(tmp_path, dtype):
    ids = np.array([0, 5, 50256, 17, 3], dtype=dtype)
    path = _write_bin(tmp_path, ids, {"dtype": dtype, "vocab_size": 50257})
    tokens, vocab = _tokens_and_vocab(path)
    assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
    assert vocab == 50257 and tokens.dtype == np.dtype(dtype)
    assert np.array_equal(tokens, ids)
    (inputs, targets), = BatchSampler(tokens, seq_len=4, global_batch=1, micro_batch=1,
                                      seed=0).micro_batches(0, dp_rank=0, dp_size=1)
    assert inputs.tolist() == [ids[:4].tolist()] and targets.tolist() == [ids[1:].tolist()]


@pytest.mark.parametrize("meta, match", [
    (None, "needs a sidecar data.bin.json"),
    ("{not json", "cannot read data.bin.json"),
    ('["uint16"]', "cannot read data.bin.json"),
    ({"dtype": "uint16"}, "cannot read data.bin.json"),
    ({"dtype": "int64", "vocab_size": 10}, "unsupported dtype 'int64'"),
    ({"dtype": "uint16", "vocab_size": 0}, "vocab_size .* must be a positive integer"),
    ({"dtype": "uint32", "vocab_size": 10}, "not a multiple of 4 bytes"),
    ({"dtype": "uint16", "vocab_size": 10}, "token id 11 is >= vocab_size 10"),
])
def test_load_bin_errors(tmp_path, meta, match):
    path = _write_bin(tmp_path, np.array([1, 11, 2], dtype=np.uint16), meta)
    with raises_as_flags(f"^--data .*{match}"):
        load_corpus(path)


def test_load_missing_and_empty(tmp_path):
    with raises_as_flags("^--data .*no such file"):
        load_corpus(tmp_path / "absent.txt")
    for name in ("empty.txt", "empty.bin"):
        (tmp_path / name).write_bytes(b"")
        with raises_as_flags("^--data .*empty"):
            load_corpus(tmp_path / name)


def test_split_and_dataset():
    tokens = np.arange(100, dtype=np.uint16)
    train, val = split_tokens(tokens, val_fraction=0.1)
    assert np.array_equal(train, tokens[:90]) and np.array_equal(val, tokens[90:])
    with raises_as_flags("--val-fraction"):
        split_tokens(tokens, val_fraction=1.0)
    data = TokenDataset(val, seq_len=4)
    assert len(data) == 6
    inputs, targets = data[5]
    assert inputs.tolist() == [95, 96, 97, 98] and targets.tolist() == [96, 97, 98, 99]
    with raises_as_flags("^--data is too short for --seq-len 10: a split of 10 ") as error:
        TokenDataset(val, seq_len=10)
    assert error.value.code is Code.DATA_SEQ_LEN


def _sampler(**kw):
    args = dict(seq_len=16, global_batch=8, micro_batch=2, seed=3) | kw
    return BatchSampler(synthetic_corpus(20_000), **args)


def _stack(batches):
    return [torch.stack(parts) for parts in zip(*batches, strict=True)]


def test_same_step_same_batch_and_steps_differ():
    sampler = _sampler()
    first = _stack(sampler.micro_batches(5, dp_rank=0, dp_size=1))
    again = _stack(_sampler().micro_batches(5, dp_rank=0, dp_size=1))
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    other = _stack(sampler.micro_batches(6, dp_rank=0, dp_size=1))
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(first[0], _stack(_sampler(seed=4).micro_batches(
        5, dp_rank=0, dp_size=1))[0])


def test_targets_are_inputs_shifted():
    for inputs, targets in _sampler().micro_batches(0, dp_rank=0, dp_size=1):
        assert inputs.dtype == targets.dtype == torch.int64
        assert inputs.shape == targets.shape == (2, 16)
        assert torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_ranks_partition_the_global_batch(dp):
    sampler = _sampler()
    for step in (0, 7):
        reference = sampler.micro_batches(step, dp_rank=0, dp_size=1)
        assert len(reference) == 4
        union = [mb for rank in range(dp)
                 for mb in sampler.micro_batches(step, dp_rank=rank, dp_size=dp)]
        assert len(union) == len(reference)
        for (x, y), (ref_x, ref_y) in zip(union, reference, strict=True):
            assert torch.equal(x, ref_x) and torch.equal(y, ref_y)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_eval_batches_fixed_and_split(dp):
    sampler = _sampler()
    reference = sampler.eval_batches(3, dp_rank=0, dp_size=1)
    assert len(reference) == 3 * 4
    # Rank r takes its run of each global batch, so rank-major order interleaves them.
    by_rank = [sampler.eval_batches(3, dp_rank=rank, dp_size=dp) for rank in range(dp)]
    per_rank = 4 // dp
    union = [mb for i in range(3) for rank_batches in by_rank
             for mb in rank_batches[i * per_rank:(i + 1) * per_rank]]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(union, reference, strict=True))
    prefix = sampler.eval_batches(1, dp_rank=0, dp_size=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(prefix, reference[:4], strict=True))
    train = sampler.micro_batches(0, dp_rank=0, dp_size=1)
    assert not torch.equal(train[0][0], reference[0][0])
    with raises_as_flags("--eval-batches must be positive"):
        sampler.eval_batches(0, dp_rank=0, dp_size=1)


def test_invalid_batch_sizes():
    sampler = _sampler(global_batch=10, micro_batch=2)
    msg = "--global-batch 10 must be divisible by --micro-batch x dp = 2 x 2 = 4"
    with raises_as_flags(f"^{re.escape(msg)}$"):
        sampler.micro_batches(0, dp_rank=0, dp_size=2)
    with raises_as_flags("--global-batch 10 must be divisible by --micro-batch"):
        _sampler(global_batch=10, micro_batch=4)
    with raises_as_flags("--micro-batch must be positive"):
        _sampler(micro_batch=0)
    with raises_as_flags("^--data is too short for --seq-len 20000"):
        _sampler(seq_len=20_000)
