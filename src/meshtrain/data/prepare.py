"""`meshtrain prepare`: text files, folders, JSONL, Parquet and Arrow files -> a token file `X.bin`
(see `corpus.load_corpus`), the end-of-document token after every document, and optionally a
held-out split of whole documents in `X.val.bin`.

It streams: documents are read in pieces (`documents.read_documents`), grouped into batches of
about `batch_bytes`, tokenised by worker processes with at most two batches per worker in flight,
and written in input order as they come back, so memory is bounded by the batches in flight, not
by the corpus. A piece's tokens depend on its text alone, so any number of workers writes the same
bytes. Output goes to temporary files in the output's folder, renamed into place at the end: a
failed run leaves no partial token file.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np

from meshtrain.data.corpus import (
    remove_stale_temporaries,
    sidecar_of,
    token_dtype,
    write_atomic,
)
from meshtrain.data.documents import (
    PIECE_BYTES,
    DocumentError,
    Piece,
    Problems,
    count_records,
    input_files,
    input_progress,
    read_documents,
)
from meshtrain.data.tokenization import Tokenizer, load_tokenizer
from meshtrain.errors import Code, SettingError

BATCH_BYTES = 1 << 20  # pieces handed to a worker at once
_IN_FLIGHT_PER_WORKER = 2


@dataclasses.dataclass(frozen=True)
class Written:
    """One token file written: where, how many documents and tokens."""

    path: Path
    documents: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class PrepareReport:
    train: Written
    held_out: Written | None
    skipped: str | None  # the skip summary; None when nothing was skipped


def prepare(inputs: Iterable[str | Path], *, out: str | Path, tokenizer: str | Path = "bytes",
            text_field: str = "text", workers: int | None = None, val_fraction: float = 0.0,
            val_docs: int | None = None, on_error: str = "fail", eod_token: str | None = None,
            progress: bool = True, batch_bytes: int = BATCH_BYTES) -> PrepareReport:
    """Tokenise the documents of `inputs` into the token file `out` (see the module docstring).

    `val_fraction` (of the documents, evenly spaced) or `val_docs` (that many of them) go to the
    held-out split instead. A tokenizer.json is copied beside the output and named in the
    sidecar, so training can hand it to its run directory.
    """
    out, workers = _checked_out(out), _checked_workers(workers)
    tok = load_tokenizer(tokenizer, eod_token=eod_token)
    if tok.eod_id is None:
        raise SettingError(Code.EOD_TOKEN, f"`tokenizer` {tok.path} has no end-of-document token"
                           " that meshtrain recognises: name it with `eod_token`")
    problems = Problems(on_error)
    earlier = _output_paths(out)  # an earlier run's output inside an input folder is no input
    for path in earlier:  # what an interrupted earlier run into `out` left
        remove_stale_temporaries(path)
    files = [path for path in input_files(inputs, problems) if path.resolve() not in earlier]
    held_out = _held_out_rule(val_fraction, val_docs, files)
    pieces = read_documents(files, problems, text_field=text_field,
                            piece_bytes=min(PIECE_BYTES, batch_bytes))
    splits: list[_TokenFile] = []
    try:
        for path in (out, _held_out_path(out)):
            splits.append(_TokenFile(path, token_dtype(tok.vocab_size), tok.eod_id))
        with _worker_pool(tokenizer, workers) as pool, \
                input_progress(files, "prepare", enabled=progress) as bar:
            for batch, encoded in _encoded(_batches(pieces, batch_bytes), tok, pool, workers):
                for piece, ids in zip(batch, encoded, strict=True):
                    splits[held_out(piece.record)].take(piece, ids)
                bar.update(sum(piece.size for piece in batch))
        return _commit(*splits, tok, problems.summary())
    except BaseException:
        for split in splits:
            split.discard()
        raise


def _checked_out(out: str | Path) -> Path:
    out = Path(out)
    if out.suffix != ".bin":
        raise SettingError(Code.OUT_PATH, f"`out` {out} must end in .bin: it is a token file (with"
                           " a .bin.json sidecar)")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _held_out_path(out: Path) -> Path:
    return out.with_suffix(".val.bin")


def _tokenizer_copy_path(out: Path) -> Path:
    return out.with_suffix(".tokenizer.json")


def _output_paths(out: Path) -> set[Path]:
    """Every file a run writes, resolved."""
    held_out = _held_out_path(out)
    return {path.resolve() for path in (out, sidecar_of(out), held_out,
                                         sidecar_of(held_out), _tokenizer_copy_path(out))}


def _checked_workers(workers: int | None) -> int:
    if workers is None:
        return max(1, min(os.cpu_count() or 1, 16))
    if workers < 1:
        raise SettingError(Code.RANGE, f"`workers` must be positive, got {workers}")
    return workers


def _held_out_rule(val_fraction: float, val_docs: int | None, files: list[Path]):
    """record -> 1 if it goes to the held-out split, else 0: p of every q records, evenly spaced
    (record i iff floor((i+1)p/q) > floor(ip/q)); exactly `val_docs` of all records."""
    if not 0.0 <= val_fraction < 1.0:
        raise SettingError(Code.RANGE, f"`val_fraction` must be in [0, 1), got {val_fraction}")
    if val_docs is not None:
        if val_fraction:
            raise SettingError(Code.SETTINGS_EXCLUSIVE,
                               "pass `val_fraction` or `val_docs`, not both")
        records = count_records(files)
        if not 0 <= val_docs < records:
            raise SettingError(Code.RANGE, f"`val_docs` must be between 0 and the {records}"
                               f" documents less one, got {val_docs}")
        share = Fraction(val_docs, records)
    else:
        share = Fraction(val_fraction).limit_denominator(10**6)
    p, q = share.numerator, share.denominator
    return lambda record: int((record + 1) * p // q > record * p // q)


def _batches(pieces: Iterable[Piece], batch_bytes: int) -> Iterator[list[Piece]]:
    """Batches of about `batch_bytes` of text: measured on the text, not on the input bytes a
    piece stands for, which for a compressed Parquet file are far fewer."""
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text or "")
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class _Encoder:
    """Texts -> token arrays of the output dtype (None stays None: a dropped document)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.dtype = tokenizer, np.dtype(token_dtype(tokenizer.vocab_size))

    def __call__(self, texts: list[str | None]) -> list[np.ndarray | None]:
        return [None if text is None else self.tokenizer.encode(text).astype(self.dtype)
                for text in texts]


_worker_encoder: _Encoder | None = None


def _start_worker(spec: str) -> None:
    global _worker_encoder
    # A Ctrl-C or SIGHUP to the process group is the parent's to act on (it ends the pool);
    # SIGTERM, the pool's own way to end a worker, ends one silently. Forked workers would
    # otherwise inherit the command's handler and each print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)  # blocked by `_worker_pool`
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_encoder = _Encoder(load_tokenizer(spec))


def _encode_in_worker(texts: list[str | None]) -> list[np.ndarray | None]:
    return _worker_encoder(texts)


_STOPS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def _worker_pool(spec: str | Path, workers: int):
    """A pool of `workers` encoding processes (none for one worker), made before any progress
    thread starts. Forked where there is fork: workers start at once, without importing torch
    again. Stop signals are blocked while it forks: one raised inside a fork hook (logging's)
    would be swallowed; held, it is acted on once the pool is there to be ended."""
    if workers == 1:
        yield None
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        pool = multiprocessing.get_context(method).Pool(workers, initializer=_start_worker,
                                                        initargs=(str(spec),))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        raise
    with pool:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        yield pool


def _encoded(batches: Iterator[list[Piece]], tokenizer: Tokenizer, pool, workers: int
             ) -> Iterator[tuple[list[Piece], list]]:
    """(batch, its token arrays) in input order; with a pool at most `_IN_FLIGHT_PER_WORKER`
    batches per worker are read ahead."""
    if pool is None:
        encode = _Encoder(tokenizer)
        for batch in batches:
            yield batch, encode([piece.text for piece in batch])
        return
    pending = collections.deque()
    for batch in batches:
        pending.append((batch, pool.apply_async(_encode_in_worker,
                                                ([piece.text for piece in batch],))))
        if len(pending) >= _IN_FLIGHT_PER_WORKER * workers:
            done, result = pending.popleft()
            yield done, result.get()
    while pending:
        done, result = pending.popleft()
        yield done, result.get()


class _TokenFile:
    """A token file written under a temporary name; a document can be dropped until it ends."""

    def __init__(self, path: Path, dtype: str, eod_id: int):
        self.path, self.dtype = path, np.dtype(dtype)
        self.eod = np.array([eod_id], dtype=self.dtype)
        self.tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        self.file = open(self.tmp, "wb")
        self.documents = self.tokens = self.document_start = 0

    def take(self, piece: Piece, ids: np.ndarray | None) -> None:
        if ids is None:  # the document went bad after some of it was written
            self.file.seek(self.document_start * self.dtype.itemsize)
            self.file.truncate()
            self.tokens = self.document_start
            return
        self._write(ids)
        if piece.last:
            self._write(self.eod)
            self.documents += 1
            self.document_start = self.tokens

    def _write(self, ids: np.ndarray) -> None:
        self.file.write(ids.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.tokens += len(ids)

    def commit(self, meta: dict) -> Written:
        """Rename into place, then write the sidecar (an old one is removed first, so no moment
        pairs the new tokens with a stale description)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        sidecar = sidecar_of(self.path)
        sidecar.unlink(missing_ok=True)
        os.replace(self.tmp, self.path)
        meta |= {"documents": self.documents, "tokens": self.tokens}
        write_atomic(sidecar, (json.dumps(meta, indent=1) + "\n").encode())
        return Written(self.path, self.documents, self.tokens)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _commit(train: _TokenFile, held_out: _TokenFile, tokenizer: Tokenizer,
            skipped: str | None) -> PrepareReport:
    """The tokenizer copy, the held-out file, then the training file and its sidecar last."""
    if train.tokens == 0:
        raise DocumentError("no documents to train on: the inputs are empty, skipped or all held"
                            " out; pass text, or a smaller `val_fraction` or `val_docs`")
    meta = {"dtype": train.dtype.name, "vocab_size": tokenizer.vocab_size,
            "eod_id": tokenizer.eod_id, "tokenizer": "bytes"}
    if tokenizer.path is not None:
        copy = _tokenizer_copy_path(train.path)
        write_atomic(copy, tokenizer.path.read_bytes())
        meta["tokenizer"] = copy.name
    written = None
    if held_out.tokens:
        written = held_out.commit(dict(meta))
        meta["validation"] = held_out.path.name
    else:
        held_out.discard()
    return PrepareReport(train.commit(meta), written, skipped)
