"""Documents from text files, folders and JSONL files, read in bounded pieces, and one policy for
bad input: `on_error` fail stops at the first problem, skip passes over it and counts it.

A text file is one document; a JSONL file holds one document per line, in a string field. Reading
never holds more than about two pieces of a file (or one JSONL line) in memory, however large the
corpus or a single file.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

JSONL_SUFFIX = ".jsonl"
# A tokenizer's working memory grows with the text of one call (a Hugging Face BPE needed over
# 100 bytes per input byte at 1 MiB, and ran 3x slower than at 64 KiB): pieces stay small.
PIECE_BYTES = 1 << 16
ON_ERROR = ("fail", "skip")


@dataclass(frozen=True)
class Piece:
    """Part of a document. `text` None: the document turned out bad after some of it was read;
    drop what was taken of it."""

    text: str | None
    record: int  # the document's place among all records (files, JSONL lines), bad ones too
    last: bool  # the document ends with this piece
    size: int  # input bytes this piece stands for


class Problems:
    """Bad input under `on_error`: fail raises at once; skip counts each kind and keeps the first
    message for the summary."""

    def __init__(self, on_error: str):
        if on_error not in ON_ERROR:
            raise ValueError(f"`on_error` must be fail or skip, got {on_error!r}")
        self.on_error = on_error
        self.counts: Counter[str] = Counter()
        self.first: str | None = None

    def report(self, kind: str, message: str, fix: str = "fix the input") -> None:
        if self.on_error == "fail":
            raise ValueError(f"{message}; {fix} or pass `on_error` skip")
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
    path order (names starting with a dot, such as .git, left out)."""
    files = []
    for given in map(Path, inputs):
        if given.is_dir():
            files += _folder_files(given, problems)
        elif given.exists():
            files.append(given)
        else:
            raise ValueError(f"{given}: no such file or folder; pass text files, folders or"
                             f" {JSONL_SUFFIX} files")
    return files


def _folder_files(folder: Path, problems: Problems) -> list[Path]:
    def unreadable(err: OSError) -> None:
        problems.report("unreadable", f"{err.filename}: cannot read ({err.strerror})")

    found = []
    for parent, dirs, names in os.walk(folder, onerror=unreadable):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(parent, name) for name in names if not name.startswith(".")]
    return sorted(found, key=Path.as_posix)


def input_progress(files: list[Path], label: str, *, enabled: bool = True) -> tqdm:
    """A progress bar over the input bytes, on stderr, shown once a run has taken a second (a
    quick failure prints its one line alone)."""
    return tqdm(total=sum(path.stat().st_size for path in files if path.is_file()), unit="B",
                unit_scale=True, desc=label, file=sys.stderr, disable=not enabled, delay=1.0)


def count_records(files: Iterable[Path]) -> int:
    """Records as `read_documents` numbers them: one per text file, one per JSONL line."""
    total = 0
    for path in files:
        if path.suffix != JSONL_SUFFIX:
            total += 1
            continue
        try:
            with open(path, "rb") as f:
                last = b"\n"
                while block := f.read(PIECE_BYTES):
                    total += block.count(b"\n")
                    last = block[-1:]
                total += last != b"\n"
        except OSError:
            pass  # reading it reports the problem
    return total


def read_documents(files: Iterable[Path], problems: Problems, *, text_field: str = "text",
                   piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """Every document of `files` in order, as pieces of at most about 2 x `piece_bytes`; empty
    documents are left out."""
    if not text_field:
        raise ValueError("`text_field` must name a JSON field, got an empty name")
    record = 0
    for path in files:
        if path.suffix == JSONL_SUFFIX:
            record = yield from _jsonl_pieces(path, record, problems, text_field)
        else:
            yield from _text_pieces(path, record, problems, piece_bytes)
            record += 1


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


def _jsonl_pieces(path: Path, record: int, problems: Problems,
                  text_field: str) -> Iterator[Piece]:
    """One piece per JSONL line with text; returns the record number after the file."""
    try:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                text = _jsonl_text(line, f"{path}:{number}", problems, text_field)
                if text:
                    yield Piece(text, record, True, len(line))
                record += 1
    except OSError as err:
        problems.report("unreadable", f"{path}: cannot read ({err.strerror})")
    return record


def _jsonl_text(line: bytes, where: str, problems: Problems, text_field: str) -> str | None:
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
    text = value.get(text_field) if isinstance(value, dict) else None
    if not isinstance(text, str):
        problems.report("without text", f"{where}: no string field {text_field!r}",
                        fix="name the documents' field with `text_field`")
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        problems.report("not UTF-8", f"{where}: field {text_field!r} holds a lone surrogate at"
                                     f" character {err.start}, not text")
        return None
    return text
