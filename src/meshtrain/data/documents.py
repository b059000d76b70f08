"""Documents from text files, folders, JSONL files and locally saved Hugging Face `datasets`
(Parquet and Arrow files), read in bounded pieces, and one policy for bad input: `on_error` fail
stops at the first problem, skip passes over it and counts it.

A text file is one document; a JSONL file holds one document per line, in a string field; a
table one per row, in a string column (`tables`). Reading never holds more than about two pieces
of a file (or one JSONL line, or a chunk of table rows) in memory, however large the corpus or a
single file. A document longer than a piece is tokenized piece by piece, whatever its source.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from meshtrain.data import tables
from meshtrain.data.tables import TABLE_SUFFIXES
from meshtrain.errors import Code, SettingError

JSONL_SUFFIX = ".jsonl"
# What `datasets.save_to_disk` writes beside its data: metadata, not documents (see _folder_files).
SAVED_DATASET_METADATA = ("dataset_dict.json", "dataset_info.json", "state.json")
_NAME_THE_FIELD = "name the documents' field with `text_field`"
# A tokenizer's working memory grows with the text of one call (a Hugging Face BPE needed over
# 100 bytes per input byte at 1 MiB, and ran 3x slower than at 64 KiB): pieces stay small.
PIECE_BYTES = 1 << 16
ON_ERROR = ("fail", "skip")


class DocumentError(ValueError):
    """An input document that cannot be read (a missing file or folder, bad bytes, JSON, field,
    column or row under `on_error` fail), or inputs that hold nothing to train on. A
    `ValueError`, as these were before they had their own type: the command line ends them with
    exit code 2 and their one line."""


@dataclass(frozen=True)
class Piece:
    """Part of a document. `text` None: the document turned out bad after some of it was read;
    drop what was taken of it."""

    text: str | None
    record: int  # the document's place among all records (files, JSONL lines, rows), bad too
    last: bool  # the document ends with this piece
    size: int  # input bytes this piece stands for


class Problems:
    """Bad input under `on_error`: fail raises at once; skip counts each kind and keeps the first
    message for the summary."""

    def __init__(self, on_error: str):
        if on_error not in ON_ERROR:
            raise SettingError(Code.CHOICE, f"`on_error` must be fail or skip, got {on_error!r}")
        self.on_error = on_error
        self.counts: Counter[str] = Counter()
        self.first: str | None = None

    def report(self, kind: str, message: str, fix: str = "fix the input") -> None:
        if self.on_error == "fail":
            raise DocumentError(f"{message}; {fix} or pass `on_error` skip")
        self.counts[kind] += 1
        self.first = self.first or message

    def summary(self) -> str | None:
        """One line counting what was skipped, or None when nothing was."""
        if not self.counts:
            return None
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(self.counts.items()))
        return f"skipped {self.counts.total()} bad input(s) ({kinds}); the first: {self.first}"


def input_files(inputs: Iterable[str | Path], problems: Problems) -> list[Path]:
    """The files to read, in order: each input as given, a folder's files recursively in sorted
    path order (see `_folder_files`). Tables without pyarrow are refused here, before any work."""
    files = []
    for given in map(Path, inputs):
        if given.is_dir():
            files += _folder_files(given, problems)
        elif given.exists():
            files.append(given)
        else:
            raise DocumentError(f"{given}: no such file or folder; pass text files, folders,"
                                f" {JSONL_SUFFIX}, .parquet or .arrow files")
    tables.require_pyarrow(files)
    return files


def _folder_files(folder: Path, problems: Problems) -> list[Path]:
    """Names starting with a dot (such as .git) are left out, and so is the metadata of a folder
    that `datasets.save_to_disk` wrote (one with .arrow files or a dataset_dict.json): its JSON
    would otherwise be read as documents."""
    def unreadable(err: OSError) -> None:
        problems.report("unreadable", f"{err.filename}: cannot read ({err.strerror})")

    found = []
    for parent, dirs, names in os.walk(folder, onerror=unreadable):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if "dataset_dict.json" in names or any(name.endswith(".arrow") for name in names):
            names = [name for name in names if name not in SAVED_DATASET_METADATA]
        found += [Path(parent, name) for name in names if not name.startswith(".")]
    return sorted(found, key=Path.as_posix)


def _kind(path: Path) -> str:
    """text, jsonl or table. A .json file is JSON lines (as `datasets`' to_json writes) when its
    first line is one JSON object; other JSON (pretty-printed, an array) stays text."""
    if path.suffix in TABLE_SUFFIXES:
        return "table"
    if path.suffix == JSONL_SUFFIX:
        return "jsonl"
    if path.suffix == ".json":
        try:
            with open(path, "rb") as f:
                if f.read(1) == b"{" and f.readline().rstrip().endswith(b"}"):
                    return "jsonl"
        except OSError:
            pass  # reading it reports the problem
    return "text"


def input_progress(files: list[Path], label: str, *, enabled: bool = True) -> tqdm:
    """A progress bar over the input bytes, on stderr, shown once a run has taken a second (a
    quick failure prints its one line alone)."""
    return tqdm(total=sum(path.stat().st_size for path in files if path.is_file()), unit="B",
                unit_scale=True, desc=label, file=sys.stderr, disable=not enabled, delay=1.0)


def count_records(files: Iterable[Path]) -> int:
    """Records as `read_documents` numbers them: one per text file, JSONL line and table row."""
    total = 0
    for path in files:
        try:
            kind = _kind(path)
            total += (_line_count(path) if kind == "jsonl" else
                      tables.row_count(path) if kind == "table" else 1)
        except (OSError, tables.UnreadableTable):
            pass  # reading it reports the problem
    return total


def _line_count(path: Path) -> int:
    total, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(PIECE_BYTES):
            total += block.count(b"\n")
            last = block[-1:]
    return total + (last != b"\n")


def read_documents(files: Iterable[Path], problems: Problems, *, text_field: str = "text",
                   piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """Every document of `files` in order, as pieces of at most about 2 x `piece_bytes`; empty
    documents are left out."""
    if not text_field:
        raise SettingError(Code.RANGE,
                           "`text_field` must name a JSON field or table column, got an empty name")
    record = 0
    for path in files:
        kind = _kind(path)
        if kind == "text":
            yield from _text_pieces(path, record, problems, piece_bytes)
            record += 1
        else:
            read = _jsonl_pieces if kind == "jsonl" else _table_pieces
            record = yield from read(path, record, problems, text_field, piece_bytes)


def _text_pieces(path: Path, record: int, problems: Problems,
                 piece_bytes: int) -> Iterator[Piece]:
    """A text file as one document, one piece behind so that the last one is marked."""
    offset, pending, started = 0, None, False
    try:
        with open(path, "rb") as f:
            for chunk in _chunks(f, piece_bytes):
                text = chunk.decode("utf-8")
                if pending is not None:
                    yield pending
                    started = True
                pending = Piece(text, record, False, len(chunk))
                offset += len(chunk)
    except OSError as err:
        problems.report("unreadable", f"{path}: cannot read ({err.strerror})")
    except UnicodeDecodeError as err:
        problems.report("not UTF-8", f"{path}: not UTF-8 at byte {offset + err.start}")
    else:
        if pending is not None:
            yield Piece(pending.text, record, True, pending.size)
        return
    if started:
        yield Piece(None, record, True, 0)


def _chunks(f, piece_bytes: int) -> Iterator[bytes]:
    """The file in pieces of about `piece_bytes` (at most twice that): while more follows, a
    piece ends after its last line end or, without one, at a character boundary; the rest of the
    file is the last piece. A piece never splits a UTF-8 character."""
    buffered = f.read(piece_bytes)
    while more := f.read(piece_bytes):
        cut = buffered.rfind(b"\n") + 1 or _last_character_start(buffered) or len(buffered)
        yield buffered[:cut]
        buffered = buffered[cut:] + more
    if buffered:
        yield buffered


def _last_character_start(buffered: bytes) -> int:
    """Index of the last byte in `buffered` that starts a UTF-8 character (0 if none is near the
    end: the bytes are not UTF-8, which decoding reports)."""
    for index in range(len(buffered) - 1, max(len(buffered) - 5, -1), -1):
        if buffered[index] & 0xC0 != 0x80:
            return index
    return 0


def _jsonl_pieces(path: Path, record: int, problems: Problems, text_field: str,
                  piece_bytes: int) -> Iterator[Piece]:
    """The document of each JSONL line with text; returns the record number after the file."""
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                text = _jsonl_text(line, f"{path}:{number}", problems, text_field)
                if text:
                    yield from _document_pieces(text, record, len(line), piece_bytes)
                record += 1
    except OSError as err:
        problems.report("unreadable", f"{path}: cannot read ({err.strerror})")
    return record


def _jsonl_text(line: bytes, where: str, problems: Problems, text_field: str) -> bytes | None:
    if not line.strip():
        return None
    try:
        value = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        problems.report("not UTF-8", f"{where}: not UTF-8 at byte {err.start} of the line")
        return None
    except json.JSONDecodeError as err:
        problems.report("invalid JSON", f"{where}: not valid JSON ({err.msg}, column {err.colno})")
        return None
    except RecursionError:  # arrays or objects nested deeper than Python's parser recurses
        problems.report("invalid JSON", f"{where}: JSON nested too deeply to read (a record is"
                                        " an object with a text field)")
        return None
    return _checked_text(value.get(text_field) if isinstance(value, dict) else None, where,
                         problems, text_field)


def _table_pieces(path: Path, record: int, problems: Problems, text_field: str,
                  piece_bytes: int) -> Iterator[Piece]:
    """The document of each row of a Parquet or Arrow file (rows count from 0 in messages, as
    `datasets` indexes them); returns the record number after the file, all of its rows counted
    as `count_records` does, even when reading stopped early."""
    start = end = record
    try:
        with tables.Table(path) as table:
            end = start + table.rows
            if text_field not in table.columns:
                problems.report("without text", f"{path}: no column {text_field!r} (its columns:"
                                f" {', '.join(table.columns)})", fix=_NAME_THE_FIELD)
                return end
            for chunk in table.values(text_field):
                for value in chunk:
                    row = record - start
                    text = _checked_text(value, f"{path}: row {row}", problems, text_field)
                    if text:
                        yield from _document_pieces(text, record, table.row_bytes(row),
                                                    piece_bytes)
                    record += 1
    except tables.UnreadableTable as err:
        problems.report("unreadable", f"{path}: cannot read ({err})")
    return end


def _checked_text(value, where: str, problems: Problems, text_field: str) -> bytes | None:
    """A document's text, encoded: it must be a string (a lone surrogate is not text)."""
    if isinstance(value, UnicodeDecodeError):
        problems.report("not UTF-8", f"{where}: not UTF-8 at byte {value.start} of"
                                     f" {text_field!r}")
        return None
    if not isinstance(value, str):
        problems.report("without text", f"{where}: no string field {text_field!r}",
                        fix=_NAME_THE_FIELD)
        return None
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as err:
        problems.report("not UTF-8", f"{where}: field {text_field!r} holds a lone surrogate at"
                                     f" character {err.start}, not text")
        return None


def _document_pieces(text: bytes, record: int, size: int, piece_bytes: int) -> Iterator[Piece]:
    """A document read whole (a JSONL line, a table row) in the pieces a text file of the same
    bytes would be cut into; the last piece stands for all `size` input bytes."""
    chunks = list(_chunks(io.BytesIO(text), piece_bytes))
    for index, chunk in enumerate(chunks, 1):
        last = index == len(chunks)
        yield Piece(chunk.decode("utf-8"), record, last, size if last else 0)
