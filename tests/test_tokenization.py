"""Tokenizers: bytes with an end-of-document id, Hugging Face tokenizer.json files, training a
byte-level BPE deterministically, and finding a run's tokenizer for `sample`."""

import json
import sys

import numpy as np
import pytest
import torch
from harness import raises_as_flags, run_cli, word_level_tokenizer

from meshtrain.data.corpus import synthetic_corpus
from meshtrain.data.tokenization import (
    EOD_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    checkpoint_tokenizer,
    load_tokenizer,
    train_bpe,
    train_tokenizer_file,
)
from meshtrain.inference.generate import prompt_ids

TEXT = "def f(x):\n    return x  # é, 漢字, 🙂"


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    """A folder of text files and a JSONL file with its text in `body`."""
    root = tmp_path_factory.mktemp("corpus")
    lines = synthetic_corpus(60_000, seed=1).tobytes().decode().splitlines()
    (root / "texts").mkdir()
    for i in range(3):
        (root / "texts" / f"{i}.txt").write_text("\n".join(lines[i * 100:(i + 1) * 100]))
    with open(root / "more.jsonl", "w") as f:
        for line in lines[300:600]:
            f.write(json.dumps({"body": line}) + "\n")
    return root


def test_bytes_end_documents_with_256():
    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eod_id, tok.path) == (257, 256, None)
    ids = np.concatenate([tok.encode(TEXT), [256], tok.encode("next")])
    assert tok.decode(ids) == TEXT + EOD_TOKEN + "next"
    assert tok.decode(torch.tensor(ids)) == TEXT + EOD_TOKEN + "next"
    assert tok.decode([104, 300, 105]) == "h\ufffdi"  # an id past the vocabulary
    plain = ByteTokenizer(eod=False)
    assert (plain.vocab_size, plain.eod_id) == (256, None)
    assert plain.decode([104, 256]) == "h\ufffd"
    with raises_as_flags("^--eod-token names a token of a tokenizer.json"):
        load_tokenizer("bytes", eod_token="</s>")


def test_trained_tokenizer_is_byte_identical_and_round_trips(corpus_files, tmp_path):
    inputs = [corpus_files / "texts", corpus_files / "more.jsonl"]
    first, second = tmp_path / "a" / "tokenizer.json", tmp_path / "b.json"
    size, skipped = train_tokenizer_file(inputs, vocab_size=300, out=first, text_field="body",
                                         progress=False)
    assert size == 300 and skipped is None
    train_tokenizer_file(inputs, vocab_size=300, out=second, text_field="body", progress=False)
    assert first.read_bytes() == second.read_bytes()
    # another process (its own thread pool) writes the same bytes
    third = tmp_path / "c.json"
    run_cli("tokenizer", "train", *map(str, inputs), "--text-field", "body", "--vocab-size",
            "300", "--out", str(third))
    assert third.read_bytes() == first.read_bytes()

    tok = HFTokenizer(first)
    assert (tok.vocab_size, tok.eod_id) == (300, 0)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert len(tok.encode("the dog sees the cat")) < len("the dog sees the cat") // 2  # merges
    # text is text: the end-of-document token's spelling in a document is characters
    spelled = tok.encode(f"a{EOD_TOKEN}b")
    assert 0 not in spelled.tolist() and tok.decode(spelled) == f"a{EOD_TOKEN}b"
    assert tok.decode([5, 0, 6]).count(EOD_TOKEN) == 1
    assert tok.decode([5, 7000]) == tok.decode([5])  # ids past the vocabulary are dropped


def test_train_rejects_a_small_vocabulary(corpus_files, tmp_path):
    with raises_as_flags("^--vocab-size must be at least 257 "):
        train_tokenizer_file([corpus_files], vocab_size=256, out=tmp_path / "t.json",
                             progress=False)
    assert not (tmp_path / "t.json").exists()


def test_hf_end_of_document_token(tmp_path):
    path = word_level_tokenizer(tmp_path, 10, "</s>")
    tok = HFTokenizer(path)
    assert (tok.vocab_size, tok.eod_id) == (12, 11)
    assert tok.encode("w3 w9 zz").tolist() == [3, 9, 10]
    assert HFTokenizer(path, eod_token="w2").eod_id == 2
    with raises_as_flags(r"^--eod-token 'nope' is not a token of .*tokenizer.json"):
        HFTokenizer(path, eod_token="nope")
    # a tokenizer_config.json beside it names the token: it wins over the usual spellings
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "w4"}}))
    assert HFTokenizer(path).eod_id == 4
    (tmp_path / "other").mkdir()
    assert HFTokenizer(word_level_tokenizer(tmp_path / "other", 5, "<stop>")).eod_id is None


def test_tokenizer_file_errors(tmp_path, monkeypatch):
    with raises_as_flags(r"^--tokenizer .*absent.json: no such file; pass a tokenizer.json or"
                         " bytes$"):
        load_tokenizer(tmp_path / "absent.json")
    (tmp_path / "broken.json").write_text('{"model": 3}')
    with raises_as_flags(r"^--tokenizer .*broken.json is not a tokenizer.json the tokenizers"
                         r" library reads \(.+\); pass another$"):
        load_tokenizer(tmp_path / "broken.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # the optional library is missing
    with raises_as_flags(r"needs the tokenizers library: pip install -e '\.\[hf\]'$"):
        load_tokenizer(tmp_path / "broken.json")
    assert load_tokenizer("bytes").decode([104, 105]) == "hi"  # bytes need no library


def test_checkpoint_tokenizer_and_prompt(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003"
    checkpoint.mkdir(parents=True)
    assert checkpoint_tokenizer(checkpoint, 256).eod_id is None
    assert checkpoint_tokenizer(checkpoint, 257).eod_id == 256
    with pytest.raises(TokenizerError, match=r"vocabulary is 300, not bytes, and its run has no"
                                             r" tokenizer.json: copy the tokenizer"):
        checkpoint_tokenizer(checkpoint, 300)
    word_level_tokenizer(tmp_path / "run", 10, "</s>")  # as train and import-hf write it
    tok = checkpoint_tokenizer(checkpoint, 300)
    assert tok.path == tmp_path / "run" / "tokenizer.json"
    assert prompt_ids(tok, "w1 w2", 300) == [1, 2]
    assert prompt_ids(tok, "", 300) == [11]  # an empty prompt starts a document
    assert prompt_ids(ByteTokenizer(eod=False), "", 256) == [10]  # "\n" without one
    with pytest.raises(TokenizerError, match="token id 11, past the model's vocabulary of 8"):
        prompt_ids(tok, "", 8)


def test_train_bpe_refuses_bad_documents_midway():
    def texts():
        yield "hello world"
        raise ValueError("x.jsonl:2: not valid JSON")

    with pytest.raises(ValueError, match="x.jsonl:2"):
        train_bpe(texts(), vocab_size=260)
