"""`meshtrain prepare`: documents to token files, end-of-document tokens, dtypes, the held-out
split and training on it, byte-identical output for any number of workers, saved Hugging Face
datasets (Parquet, Arrow), bad input, bounded memory, and a run that samples with the tokenizer
its data was prepared with."""

import json
import re
import sys
import tracemalloc

import numpy as np
import pytest
from harness import raises_as_flags, word_level_tokenizer

from meshtrain import ParallelMesh
from meshtrain.cli.flags import as_flags
from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.data import tables
from meshtrain.data.corpus import encode, load_corpus, synthetic_corpus
from meshtrain.data.prepare import prepare
from meshtrain.data.tokenization import EOD_TOKEN, HFTokenizer, train_bpe
from meshtrain.errors import Code
from meshtrain.training.trainer import Trainer

BYTE_EOD = 256


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE tokenizer.json of 320 ids trained on the synthetic corpus."""
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    text = synthetic_corpus(100_000, seed=4).tobytes().decode()
    path.write_text(train_bpe(text.splitlines(), vocab_size=320))
    return path


def _documents(root, count=8, lines=20):
    """`count` text files of synthetic sentences under `root`/docs (names sort as numbers)."""
    text = synthetic_corpus(count * lines * 200, seed=5).tobytes().decode().splitlines()
    (root / "docs").mkdir()
    docs = ["\n".join(text[i * lines:(i + 1) * lines]) for i in range(count)]
    assert all(docs)
    for i, doc in enumerate(docs):
        (root / "docs" / f"{i:02d}.txt").write_text(doc)
    return docs


def _byte_tokens(docs):
    return [t for doc in docs for t in [*encode(doc).tolist(), BYTE_EOD]]


def _sidecar(path):
    return json.loads(path.with_name(path.name + ".json").read_text())


def test_text_folders_and_jsonl_as_bytes(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "a").mkdir(parents=True)
    (folder / ".git").mkdir()
    files = {"a.txt": "one\n", "a/1.txt": "é two", "b.txt": "three", "empty.txt": "",
             ".hidden.txt": "no", ".git/HEAD": "no"}
    for name, text in files.items():
        (folder / name).write_text(text)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "j1"}\n\n{"text": "j2 ü", "id": 3}\n{"text": ""}\n')
    out = tmp_path / "new" / "d.bin"
    report = prepare([folder, jsonl, folder / "b.txt"], out=out, workers=1, progress=False)
    # sorted paths ("a.txt" < "a/1.txt"), hidden and empty documents left out
    docs = ["one\n", "é two", "three", "j1", "j2 ü", "three"]
    tokens, held_out = load_corpus(out).tokens, load_corpus(out).held_out
    assert tokens.dtype == np.uint16 and tokens.tolist() == _byte_tokens(docs)
    assert held_out is None and load_corpus(out).tokenizer is None
    assert _sidecar(out) == {"dtype": "uint16", "vocab_size": 257, "eod_id": 256,
                             "tokenizer": "bytes", "documents": 6, "tokens": len(tokens)}
    assert (report.train.documents, report.held_out, report.skipped) == (6, None, None)
    assert sorted(p.name for p in out.parent.iterdir()) == ["d.bin", "d.bin.json"]
    # the output inside its input folder: a re-run does not read the earlier output
    for _ in range(2):
        prepare([folder], out=folder / "a" / "self.bin", workers=1, progress=False)
        assert load_corpus(folder / "a" / "self.bin").tokens.tolist() == _byte_tokens(docs[:3])


def test_long_documents_are_read_in_pieces(tmp_path):
    """Pieces cut after line ends or between characters: the bytes of a document are whole."""
    text = "line one é\nline two 漢字 and a long line with no end " * 5 + "🙂"
    (tmp_path / "long.txt").write_text(text)
    for batch_bytes in (5, 7, 1 << 20):
        out = tmp_path / f"long{batch_bytes}.bin"
        prepare([tmp_path / "long.txt"], out=out, workers=1, progress=False,
                batch_bytes=batch_bytes)
        assert load_corpus(out).tokens.tolist() == _byte_tokens([text])


def test_a_hugging_face_tokenizer(tmp_path, bpe):
    docs = _documents(tmp_path)
    out = tmp_path / "d.bin"
    prepare([tmp_path / "docs"], out=out, tokenizer=bpe, workers=1, progress=False)
    tok = HFTokenizer(bpe)
    expected = [t for doc in docs for t in [*tok.encode(doc).tolist(), tok.eod_id]]
    corpus = load_corpus(out)
    assert corpus.tokens.dtype == np.uint16 and corpus.tokens.tolist() == expected
    assert corpus.tokenizer == tmp_path / "d.tokenizer.json"  # a copy beside the data
    assert corpus.tokenizer.read_bytes() == bpe.read_bytes()
    assert _sidecar(out) | {"tokens": 0} == {
        "dtype": "uint16", "vocab_size": 320, "eod_id": 0, "tokenizer": "d.tokenizer.json",
        "documents": 8, "tokens": 0}


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path):
    tokenizer = word_level_tokenizer(tmp_path, 70_000, "</s>")
    (tmp_path / "doc.txt").write_text("w1 w69999 w65536")
    out = tmp_path / "d.bin"
    prepare([tmp_path / "doc.txt"], out=out, tokenizer=tokenizer, workers=1, progress=False)
    tokens = load_corpus(out).tokens
    assert tokens.dtype == np.uint32 and tokens.tolist() == [1, 69999, 65536, 70001]


def test_no_end_of_document_token_is_refused(tmp_path):
    tokenizer = word_level_tokenizer(tmp_path, 5, "<stop>")
    (tmp_path / "doc.txt").write_text("w1")
    with raises_as_flags("^--tokenizer .* has no end-of-document token that meshtrain"
                         " recognises: name it with --eod-token$"):
        prepare([tmp_path / "doc.txt"], out=tmp_path / "d.bin", tokenizer=tokenizer)
    prepare([tmp_path / "doc.txt"], out=tmp_path / "d.bin", tokenizer=tokenizer,
            eod_token="<stop>", progress=False)
    assert load_corpus(tmp_path / "d.bin").tokens.tolist() == [1, 6]


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _table(path, columns, *, arrow_file=False):
    """A Parquet file (row groups of 3) or an Arrow IPC stream (batches of 3, as
    `datasets.save_to_disk` writes) or IPC file, written by pyarrow alone."""
    pa = pytest.importorskip("pyarrow")
    from pyarrow import ipc, parquet

    table = pa.table(columns)
    if path.suffix == ".parquet":
        parquet.write_table(table, path, row_group_size=3)
        return
    with (ipc.new_file if arrow_file else ipc.new_stream)(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=3):
            writer.write_batch(batch)


def _saved_dataset(root, texts):
    """The layout of `DatasetDict.save_to_disk`: dataset_dict.json, and per split two Arrow
    shards beside their JSON metadata."""
    root.mkdir()
    (root / "dataset_dict.json").write_text('{"splits": ["train"]}')
    split = root / "train"
    split.mkdir()
    for shard, part in enumerate((texts[:5], texts[5:])):
        _table(split / f"data-0000{shard}-of-00002.arrow", {"text": part})
    for name in ("dataset_info.json", "state.json"):
        (split / name).write_text(json.dumps({"_data_files": [], "text": "meta"}, indent=2))


def test_saved_datasets_read_as_their_jsonl(tmp_path, monkeypatch):
    """Parquet, a saved dataset's folder, an Arrow IPC file and JSON lines in a .json file give
    the bytes JSONL of the same texts gives: rows numbered as lines (an empty one too) for the
    held-out split, long rows cut into pieces as text files are, for one worker or two."""
    monkeypatch.setattr(tables, "ROWS_PER_CHUNK", 4)  # chunks across batches and row groups
    texts = [f"doc {i} é" for i in range(11)]
    texts[3], texts[7] = "", "a long row, cut\nafter a line end " * 9
    lines = "".join(json.dumps({"text": text}) + "\n" for text in texts)
    (tmp_path / "docs.jsonl").write_text(lines)
    (tmp_path / "lines.json").write_text(lines)
    _table(tmp_path / "docs.parquet", {"id": list(range(11)), "text": texts})
    _table(tmp_path / "docs.arrow", {"text": texts}, arrow_file=True)
    _saved_dataset(tmp_path / "saved", texts)
    formats = ["docs.parquet", "saved", "docs.arrow", "lines.json"]
    outputs = []
    for inputs, workers in [(["docs.jsonl"], 1), *(([f], 1) for f in formats),
                            (["docs.jsonl"] * 4, 1), (formats, 2)]:
        folder = tmp_path / f"out{len(outputs)}"
        folder.mkdir()
        prepare([tmp_path / name for name in inputs], out=folder / "d.bin", workers=workers,
                val_fraction=0.25, progress=False, batch_bytes=64)
        outputs.append(_files(folder))
    assert load_corpus(tmp_path / "out0" / "d.bin").held_out.tolist() == \
        _byte_tokens([texts[7]])  # record 3, the empty row, is held out with nothing in it
    assert all(output == outputs[0] for output in outputs[1:5]), [sorted(o) for o in outputs]
    assert outputs[-1] == outputs[-2]  # four inputs in two workers: the bytes of one in one


def test_json_is_json_lines_only_when_its_first_line_is_an_object(tmp_path):
    pretty = '{\n  "text": "whole"\n}\n'
    (tmp_path / "a.json").write_text('{"text": "one"}\n{"text": "two"}')
    (tmp_path / "b.json").write_text(pretty)
    prepare([tmp_path], out=tmp_path / "out" / "d.bin", workers=1, progress=False)
    assert load_corpus(tmp_path / "out" / "d.bin").tokens.tolist() == \
        _byte_tokens(["one", "two", pretty])


def test_tables_without_pyarrow_fail_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("text")
    (tmp_path / "in" / "data.parquet").write_bytes(b"unread")
    with raises_as_flags(r"^\S+/data.parquet: .parquet and .arrow files need the pyarrow library:"
                         r" pip install 'meshtrain\[datasets\]' \(from a clone: pip install -e"
                         r" '.\[datasets\]'\)$"):
        prepare([tmp_path / "in"], out=tmp_path / "out" / "d.bin", progress=False)
    assert main(["prepare", str(tmp_path / "in"), "--out", str(tmp_path / "out" / "d.bin")]) == 2
    assert "pip install 'meshtrain[datasets]'" in capsys.readouterr().err
    assert not any((tmp_path / "out").iterdir())


def test_same_bytes_for_any_number_of_workers(tmp_path, bpe):
    _documents(tmp_path, count=12)
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"the dog {i}"}) + "\n" for i in range(40)))
    outputs = {}
    for workers in (1, 3, 1):  # small batches: many of them in flight between the workers
        folder = tmp_path / "out"
        folder.mkdir(exist_ok=True)
        prepare([tmp_path / "docs", jsonl], out=folder / "d.bin", tokenizer=bpe, workers=workers,
                val_fraction=0.2, progress=False, batch_bytes=300)
        outputs.setdefault(workers, []).append(_files(folder))
    assert set(outputs[1][0]) == {"d.bin", "d.bin.json", "d.val.bin", "d.val.bin.json",
                                  "d.tokenizer.json"}
    assert outputs[1][0] == outputs[3][0] == outputs[1][1]  # a re-run over the old output too


def test_held_out_documents(tmp_path):
    docs = _documents(tmp_path)
    for kind, value, held in [("val_fraction", 0.25, {3, 7}), ("val_docs", 2, {3, 7}),
                              ("val_docs", 3, {2, 5, 7})]:
        out = tmp_path / f"{kind}{value}.bin"
        report = prepare([tmp_path / "docs"], out=out, workers=1, progress=False,
                         **{kind: value})
        corpus = load_corpus(out)
        assert corpus.tokens.tolist() == _byte_tokens(
            [d for i, d in enumerate(docs) if i not in held])
        assert corpus.held_out.tolist() == _byte_tokens([docs[i] for i in sorted(held)])
        assert report.held_out.path == tmp_path / f"{kind}{value}.val.bin"
        assert _sidecar(out)["validation"] == report.held_out.path.name
        train, validation = corpus.splits(0.05)  # the prepared split wins over the tail
        assert validation is corpus.held_out and train is corpus.tokens
    for kwargs, match, code in [
            (dict(val_fraction=0.1, val_docs=1), "pass --val-fraction or --val-docs, not both",
             Code.SETTINGS_EXCLUSIVE),
            (dict(val_docs=8), "--val-docs must be between 0 and the 8", Code.RANGE),
            (dict(val_fraction=1.0), r"--val-fraction must be in \[0, 1\)", Code.RANGE)]:
        with raises_as_flags(match) as error:
            prepare([tmp_path / "docs"], out=tmp_path / "x.bin", progress=False, **kwargs)
        assert error.value.code is code


def test_train_evaluates_on_the_held_out_split(tmp_path):
    _documents(tmp_path)
    out = tmp_path / "d.bin"
    prepare([tmp_path / "docs"], out=out, workers=1, val_docs=2, progress=False)
    cfg = build_config({}, {"data": {"data": str(out)}, "checkpoint": {"out": str(tmp_path)},
                            "train": {"seq_len": 16, "global_batch": 2, "micro_batch": 2}})
    trainer = Trainer.build(cfg, ParallelMesh.local())
    corpus = load_corpus(out)
    assert np.array_equal(trainer.eval_data.data.tokens, corpus.held_out)
    assert np.array_equal(trainer.train_data.data.tokens, corpus.tokens)  # no tail cut off
    assert trainer.model.cfg.vocab_size == 257 and trainer.tokenizer is None


def _table_bytes(suffix, columns, *, cut=0):
    """A function writing a Parquet or Arrow file of `columns` (called in the test, so that
    without pyarrow those cases are skipped), returning its bytes less the last `cut`."""
    def write(folder):
        path = folder / f"table{suffix}"
        _table(path, columns() if callable(columns) else columns)
        data = path.read_bytes()
        return data[:len(data) - cut]
    return write


def _not_utf8_strings():
    pa = pytest.importorskip("pyarrow")

    offsets = pa.py_buffer(np.array([0, 2, 4], dtype=np.int32).tobytes())
    values = pa.py_buffer(b"oka\xff")  # "ok", then "a" and a byte no UTF-8 text holds
    return {"text": pa.Array.from_buffers(pa.string(), 2, [None, offsets, values])}


# (file name, content, kind, message, its good documents) of each bad input prepare recognises
BAD_INPUTS = [
    ("bad.jsonl", b'{"text": "ok"}\n{oops\n', "invalid JSON",
     r"bad.jsonl:2: not valid JSON \(Expecting property name enclosed in double quotes,"
     r" column 2\)", ["ok"]),
    ("bad.jsonl", b'{"text": "ok"}\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n", "invalid JSON",
     r"bad.jsonl:2: JSON nested too deeply to read \(a record is an object with a text field\)",
     ["ok"]),
    ("bad.jsonl", b'{"body": "x"}\n', "without text",
     "bad.jsonl:1: no string field 'text'", []),
    ("bad.jsonl", b'{"text": 3}\n', "without text", "bad.jsonl:1: no string field 'text'", []),
    ("bad.jsonl", b'{"text": "\xff"}\n', "not UTF-8",
     "bad.jsonl:1: not UTF-8 at byte 10 of the line", []),
    ("bad.jsonl", b'{"text": "\\ud800"}\n', "not UTF-8",
     "bad.jsonl:1: field 'text' holds a lone surrogate at character 0, not text", []),
    ("bad.txt", b"fine\n" * 10 + b"\xfe", "not UTF-8", "bad.txt: not UTF-8 at byte 50", []),
    ("gone.txt", None, "unreadable", r"gone.txt: cannot read \(No such file or directory\)", []),
    ("bad.parquet", _table_bytes(".parquet", {"text": ["ok", None]}), "without text",
     "bad.parquet: row 1: no string field 'text'", ["ok"]),
    ("bad.parquet", _table_bytes(".parquet", {"body": ["x"]}), "without text",
     r"bad.parquet: no column 'text' \(its columns: body\)", []),
    ("bad.arrow", _table_bytes(".arrow", {"text": [3]}), "without text",
     "bad.arrow: row 0: no string field 'text'", []),
    ("bad.arrow", _table_bytes(".arrow", _not_utf8_strings), "not UTF-8",
     "bad.arrow: row 1: not UTF-8 at byte 1 of 'text'", ["ok"]),
    ("bad.parquet", _table_bytes(".parquet", {"text": ["ok"]}, cut=20), "unreadable",
     r"bad.parquet: cannot read \(.+\)", []),
]


@pytest.mark.parametrize("name,content,kind,message,good", BAD_INPUTS,
                         ids=[f"{kind}-{i}" for i, (_, _, kind, _, _) in enumerate(BAD_INPUTS)])
def test_bad_input_fails_whole_or_is_skipped_and_counted(tmp_path, name, content, kind, message,
                                                         good):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a_good.txt").write_text("good")
    if content is None:
        (folder / name).symlink_to(tmp_path / "nowhere")  # listed, but cannot be opened
    elif callable(content):
        (folder / name).write_bytes(content(tmp_path))
    else:
        (folder / name).write_bytes(content)
    out = tmp_path / "out" / "d.bin"
    # small batches: the bad text file is found after its first pieces were written
    settings = dict(out=out, workers=1, progress=False, batch_bytes=8)
    fix = "name the documents' field with --text-field" if kind == "without text" else \
        "fix the input"
    with raises_as_flags(f"^{folder}/{message}; {fix} or pass --on-error skip$"):
        prepare([folder], **settings)
    assert list(out.parent.iterdir()) == []  # no partial or temporary file
    report = prepare([folder], on_error="skip", **settings)
    assert load_corpus(out).tokens.tolist() == _byte_tokens(["good", *good])
    summary = rf"skipped 1 bad input\(s\) \(1 {kind}\); the first: {folder}/{message}"
    assert re.match(summary, as_flags(report.skipped)), report.skipped


def test_cli_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"\xff")
    for argv, needle in [
        (["prepare", str(tmp_path / "bad.txt"), "--out", str(tmp_path / "d.bin")],
         "bad.txt: not UTF-8 at byte 0; fix the input or pass --on-error skip"),
        (["prepare", str(tmp_path / "absent"), "--out", str(tmp_path / "d.bin")],
         "absent: no such file or folder"),
        (["prepare", str(tmp_path), "--out", str(tmp_path / "d.txt")], "--out"),
        (["prepare", str(tmp_path), "--out", str(tmp_path / "d.bin"), "--on-error", "maybe"],
         "--on-error must be fail or skip, got 'maybe'"),
        (["prepare", str(tmp_path), "--out", str(tmp_path / "d.bin"), "--workers", "0"],
         "--workers must be positive"),
        (["prepare", str(tmp_path), "--on-error", "skip", "--out", str(tmp_path / "d.bin")],
         "no documents to train on"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("meshtrain: error: ") and needle in err and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]


def test_memory_is_bounded_by_the_batches_not_the_corpus(tmp_path):
    """One document of 3 MiB, then of 12 MiB, in 64 KiB batches: the most Python and numpy memory
    held at once (tracemalloc; in the main process, which reads, gathers and writes) stays near
    a few batches and does not grow with the corpus, in-process and with worker processes."""
    block = synthetic_corpus(1 << 19, seed=6).tobytes()
    peaks = {}
    for copies in (6, 24):
        (tmp_path / "big.txt").write_bytes(block * copies)
        for workers in (1, 2):
            tracemalloc.start()
            prepare([tmp_path / "big.txt"], out=tmp_path / "d.bin", workers=workers,
                    progress=False, batch_bytes=1 << 16)
            peaks[copies, workers] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    assert load_corpus(tmp_path / "d.bin").tokens.size == 24 * len(block) + 1
    for workers in (1, 2):
        assert peaks[24, workers] < 3 << 20, peaks  # a quarter of the corpus at most
        assert peaks[24, workers] < 1.3 * peaks[6, workers], peaks  # 4x the corpus: flat


def test_a_compressed_table_is_batched_by_its_text(tmp_path):
    """Rows of a Parquet file stand for far fewer file bytes than they hold: batches are measured
    on the text, so the memory held stays flat when the table grows 4x."""
    pa = pytest.importorskip("pyarrow")
    from pyarrow import parquet

    path, peaks = tmp_path / "t.parquet", {}
    for rows in (200, 800):
        parquet.write_table(pa.table({"text": ["the same words again " * 200] * rows}), path)
        tracemalloc.start()
        prepare([path], out=tmp_path / "d.bin", workers=1, progress=False, batch_bytes=1 << 15)
        peaks[rows] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert path.stat().st_size < 1 << 15 < load_corpus(tmp_path / "d.bin").tokens.size // 100
    assert peaks[800] < 1.3 * peaks[200], peaks


def test_train_then_sample_with_the_runs_tokenizer(tmp_path, bpe, capsys):
    _documents(tmp_path)
    data, run = tmp_path / "d.bin", tmp_path / "run"
    assert main(["prepare", str(tmp_path / "docs"), "--tokenizer", str(bpe), "--workers", "2",
                 "--val-docs", "2", "--out", str(data)]) == 0
    assert main(["train", "--device", "cpu", "--data", str(data), "--seq-len", "16",
                 "--global-batch", "2", "--micro-batch", "2", "--steps", "3", "--eval-every", "3",
                 "--eval-batches", "1", "--out", str(run)]) == 0
    assert (run / "tokenizer.json").read_bytes() == bpe.read_bytes()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in row for row in rows)
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", "The dog", "--max-new-tokens", "6",
                 "--device", "cpu"]) == 0
    sample = capsys.readouterr().out
    assert sample.startswith("The dog") and len(sample) > len("The dog") + 6
    # without the run's tokenizer a vocabulary of 320 cannot be decoded: one line, no ranks
    (run / "tokenizer.json").unlink()
    assert main(["sample", str(run), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "vocabulary is 320, not bytes, and its run has no tokenizer.json" in err
    assert "\n" not in err


def test_a_byte_run_samples_with_its_end_of_document_id(tmp_path, capsys):
    _documents(tmp_path)
    data, run = tmp_path / "d.bin", tmp_path / "run"
    prepare([tmp_path / "docs"], out=data, workers=1, progress=False)
    assert main(["train", "--device", "cpu", "--data", str(data), "--seq-len", "16",
                 "--global-batch", "2", "--micro-batch", "2", "--steps", "2", "--eval-every", "0",
                 "--out", str(run)]) == 0
    assert not (run / "tokenizer.json").exists()  # bytes need none: the vocabulary says 257
    capsys.readouterr()
    assert main(["sample", str(run), "--prompt", "", "--max-new-tokens", "4", "--device",
                 "cpu"]) == 0
    assert capsys.readouterr().out.startswith(EOD_TOKEN)  # an empty prompt starts a document
