"""Tokenizers behind one small interface (encode, decode, vocab_size, eod_id): UTF-8 bytes, or a
Hugging Face `tokenizer.json`; and training a byte-level BPE `tokenizer.json` on one's own text.

The `tokenizers` library is optional (the `hf` extra): it is imported only when a tokenizer.json
is used or trained, so byte-level training and sampling work without it.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from meshtrain.data.corpus import (
    BYTE_VOCAB_SIZE,
    decode,
    encode,
    remove_stale_temporaries,
    write_atomic,
)
from meshtrain.data.documents import Problems, input_files, input_progress, read_documents
from meshtrain.errors import Code, SettingError

TOKENIZER_FILE = "tokenizer.json"  # a run directory's tokenizer; absent means bytes
EOD_TOKEN = "<|endoftext|>"  # the end-of-document token of trained tokenizers; bytes render 256 so
# Spellings of the end-of-document and begin-of-text tokens in published tokenizer.json files
# (GPT-2 and Qwen, Llama 3, Llama 2 and Mistral, Gemma), tried in this order when none is named.
_EOD_SPELLINGS = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
_BOS_SPELLINGS = ("<|begin_of_text|>", "<s>", "<bos>")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used: missing, not a tokenizer.json the library reads, absent
    from a run whose model needs it, or not the model's. A `ValueError`, as these were before
    they had their own type: the command line ends them with exit code 2 and their one line."""


class Tokenizer(ABC):
    """Text <-> token ids. `eod_id` is the token that ends a document, `bos_id` the one the
    tokenizer puts before an input (None: it has none)."""

    vocab_size: int
    eod_id: int | None
    bos_id: int | None = None
    path: Path | None  # the tokenizer.json behind it; None for bytes

    @abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """A document's ids; text is always text (a special token's spelling stays characters)."""

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt's ids, with whatever the tokenizer adds to an input of its own (Llama's
        begin-of-text token)."""
        return self.encode(text).tolist()

    @abstractmethod
    def decode(self, ids) -> str:
        """Ids (list, array or tensor) back to text, the end-of-document token spelled out."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes, ids 0..255 (`data.encode`); with `eod`, id 256 ends a document (vocabulary
    257). Ids past the bytes other than that one decode to U+FFFD."""

    def __init__(self, *, eod: bool = True):
        self.eod_id = BYTE_VOCAB_SIZE if eod else None
        self.vocab_size = BYTE_VOCAB_SIZE + int(eod)
        self.path = None

    def encode(self, text: str) -> np.ndarray:
        return encode(text)

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        parts, start = [], 0
        for index in np.flatnonzero(ids >= BYTE_VOCAB_SIZE):
            parts += [decode(ids[start:index]),
                      EOD_TOKEN if ids[index] == self.eod_id else "\ufffd"]
            start = index + 1
        return "".join(parts) + decode(ids[start:])


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`. Its end-of-document token: `eod_token` if given, else
    the `eos_token` of a `tokenizer_config.json` beside it, else the first of `_EOD_SPELLINGS`
    that is one of its special tokens."""

    def __init__(self, path: str | Path, *, eod_token: str | None = None):
        tokenizers = _import_tokenizers()
        self.path = Path(path)
        if not self.path.is_file():
            raise TokenizerError(f"`tokenizer` {path}: no such file; pass a tokenizer.json or"
                                 " bytes")
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as err:  # the library raises a bare Exception for a malformed file
            problem = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise TokenizerError(f"`tokenizer` {path} is not a tokenizer.json the tokenizers"
                                 f" library reads ({problem}); pass another") from None
        self._tokenizer.encode_special_tokens = True
        self.vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        if eod_token is not None and self._tokenizer.token_to_id(eod_token) is None:
            raise SettingError(Code.EOD_TOKEN, f"`eod_token` {eod_token!r} is not a token of"
                               f" {self.path}: name one of its tokens")
        self.eod_id = self._special_id(eod_token, "eos_token", _EOD_SPELLINGS)
        self.bos_id = self._special_id(None, "bos_token", _BOS_SPELLINGS)

    def _special_id(self, named: str | None, config_key: str, spellings: tuple) -> int | None:
        """The id of `named`, else of the token a tokenizer_config.json beside the file names
        under `config_key`, else of the first of `spellings` that is a special token."""
        named = named or _configured_token(self.path.parent / "tokenizer_config.json", config_key)
        if named is not None and self._tokenizer.token_to_id(named) is not None:
            return self._tokenizer.token_to_id(named)
        special = {token.content: index for index, token
                   in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        return next((special[name] for name in spellings if name in special), None)

    def token(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id)

    def encode(self, text: str) -> np.ndarray:
        return np.array(self._tokenizer.encode(text, add_special_tokens=False).ids,
                        dtype=np.uint32)

    def encode_prompt(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _configured_token(config: Path, key: str) -> str | None:
    """The token (`eos_token`, `bos_token`) a Hugging Face tokenizer_config.json names, if it is
    there and readable."""
    try:
        token = json.loads(config.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return token.get("content") if isinstance(token, dict) else \
        token if isinstance(token, str) else None


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise SettingError(Code.TOKENIZERS_PACKAGE, "a tokenizer.json needs the `tokenizers`"
                           " library: pip install -e '.[hf]'", settings=("tokenizer",)) from None
    return tokenizers


def load_tokenizer(spec: str | Path, *, eod_token: str | None = None) -> Tokenizer:
    """`bytes` (with the end-of-document id 256) or the tokenizer.json at `spec`."""
    if str(spec) == "bytes":
        if eod_token is not None:
            raise SettingError(Code.EOD_TOKEN, "`eod_token` names a token of a tokenizer.json;"
                               f" bytes end documents with id {BYTE_VOCAB_SIZE}: leave it out")
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)


def checkpoint_tokenizer(checkpoint: Path, vocab_size: int, *,
                         required: bool = True) -> Tokenizer | None:
    """The tokenizer of a checkpoint's model: its run's tokenizer.json (beside the checkpoint or
    in the run directory holding `checkpoints/`), else bytes when the vocabulary is bytes (256,
    or 257 with the end-of-document id); else an error, or None when not `required`."""
    candidates = [checkpoint / TOKENIZER_FILE]
    if checkpoint.parent.name == "checkpoints":
        candidates.append(checkpoint.parent.parent / TOKENIZER_FILE)
    found = next((path for path in candidates if path.is_file()), None)
    if found is not None:
        return HFTokenizer(found)
    if vocab_size in (BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + 1):
        return ByteTokenizer(eod=vocab_size > BYTE_VOCAB_SIZE)
    if not required:
        return None
    raise TokenizerError(f"{checkpoint}: the model's vocabulary is {vocab_size}, not bytes, and its"
                         f" run has no {TOKENIZER_FILE}: copy the tokenizer its data was prepared"
                         f" with to RUN/{TOKENIZER_FILE}")


def train_bpe(texts: Iterable[str], *, vocab_size: int) -> str:
    """A byte-level BPE tokenizer.json (as text) learned from `texts`: `EOD_TOKEN` (id 0), the 256
    byte symbols, then the most frequent merges up to `vocab_size` ids. The same texts give the
    same file byte for byte: merges are ranked by count, ties by the pair, whatever the number of
    threads counting."""
    _check_vocab_size(vocab_size)
    tokenizers = _import_tokenizers()
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                             initial_alphabet=byte_level.alphabet(),
                                             show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str(pretty=True)


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < BYTE_VOCAB_SIZE + 1:
        raise SettingError(Code.RANGE, f"`vocab_size` must be at least {BYTE_VOCAB_SIZE + 1} (the"
                           f" 256 bytes and the end-of-document token), got {vocab_size}")


def train_tokenizer_file(inputs: Iterable[str | Path], *, vocab_size: int, out: str | Path,
                         text_field: str = "text", on_error: str = "fail",
                         progress: bool = True) -> tuple[int, str | None]:
    """`meshtrain tokenizer train`: `train_bpe` on the documents of `inputs` (see
    `documents.read_documents`), written to `out` whole or not at all; returns the vocabulary
    size reached and the skip summary (None when nothing was skipped)."""
    out = Path(out)
    _check_vocab_size(vocab_size)
    _import_tokenizers()
    problems = Problems(on_error)
    files = input_files(inputs, problems)
    with input_progress(files, "read", enabled=progress) as bar:
        def texts():
            for piece in read_documents(files, problems, text_field=text_field):
                bar.update(piece.size)
                if piece.text:  # a dropped document's counts stay: BPE counts cannot be undone
                    yield piece.text

        content = train_bpe(texts(), vocab_size=vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out)  # of a killed earlier run into `out`
    write_atomic(out, content.encode("utf-8"))
    return len(json.loads(content)["model"]["vocab"]), problems.summary()
