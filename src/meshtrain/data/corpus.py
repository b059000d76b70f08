"""Token data: a byte tokenizer, built-in corpora, token files and stateless batch sampling.

The batch of optimizer step k depends only on (seed, k), never on what was drawn before, so a run
resumed at any step, at any data-parallel degree, sees exactly the data the uninterrupted run
would have seen. DP ranks take contiguous runs of the global batch's micro-batches, so the union
over ranks is the same list of micro-batches at every dp.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import random
import sysconfig
from pathlib import Path

import numpy as np
import torch

from meshtrain.errors import Code, SettingError

BYTE_VOCAB_SIZE = 256

_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
_BIN_DTYPES = ("uint16", "uint32")
# Seed streams: step k's global batch is drawn from (seed, _TRAIN, k), eval batch i from
# (seed, _EVAL, i): evaluating, however often, leaves the training batches unchanged.
_TRAIN, _EVAL = 0, 1


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes as uint8 token ids: any text, no unknown tokens, vocabulary 256."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(ids) -> str:
    """Token ids (array, tensor or list) back to text; a model's broken UTF-8 becomes U+FFFD."""
    return bytes(np.asarray(ids).tolist()).decode("utf-8", errors="replace")


def stdlib_corpus(*, max_bytes: int = 16 * 2**20) -> np.ndarray:
    """This interpreter's standard library source as byte tokens: real code with no download.

    `.py` files under `sysconfig.get_paths()["stdlib"]`, skipping installed packages and the
    test suites, read in sorted relative-path order and joined by blank lines; the first
    `max_bytes` bytes are kept. The text, and so every loss measured on it, differs between
    Python versions (and patch releases): use `synthetic_corpus` for golden numbers.
    """
    if max_bytes < 1:
        raise SettingError(Code.RANGE, f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP]
        paths += [Path(folder, f).relative_to(root) for f in files if f.endswith(".py")]
    buf = bytearray()
    for rel in sorted(paths, key=Path.as_posix):
        if buf:
            buf += b"\n\n"
        buf += (root / rel).read_bytes()
        if len(buf) >= max_bytes:
            break
    return np.frombuffer(buf, dtype=np.uint8)[:max_bytes]


_NOUNS = ("cat", "dog", "bird", "duck", "pig", "horse", "frog", "goat")
_ADJECTIVES = ("red", "big", "small", "quick", "lazy", "happy", "old", "green")
_VERBS = ("see", "like", "chase", "find", "follow", "help")
_PLACES = ("in the park", "by the river", "at home", "on the hill", "under the tree")
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def synthetic_corpus(num_bytes: int = 200_000, seed: int = 0) -> np.ndarray:
    """ASCII sentences from a toy grammar: the same bytes on every machine, learnable in steps.

    A tiny GPT first learns the spelling of a few dozen words, then the grammar (articles,
    singular/plural agreement, counting), so the loss drops fast and keeps dropping. Only
    `random.Random(seed).random()` is used: Python guarantees its sequence across versions,
    unlike `choice`/`randrange` or numpy's distributions.
    """
    if num_bytes < 1:
        raise SettingError(Code.RANGE, f"num_bytes must be positive, got {num_bytes}")
    rng = random.Random(seed)

    def pick(items: tuple[str, ...]) -> str:
        return items[int(rng.random() * len(items))]

    def subject() -> tuple[str, bool]:
        plural = rng.random() < 0.3
        noun = pick(_NOUNS) + ("s" if plural else "")
        return f"the {pick(_ADJECTIVES)} {noun}" if rng.random() < 0.5 else f"the {noun}", plural

    def sentence() -> str:
        roll = rng.random()
        if roll < 0.15:
            start = int(rng.random() * 6)
            return " ".join(_NUMBERS[start:start + 3 + int(rng.random() * 3)]) + "."
        who, plural = subject()
        verb = pick(_VERBS) + ("" if plural else "s")
        if roll < 0.3:  # the object comes back as the next subject: a copy to learn
            noun = pick(_NOUNS)
            return f"{who} {verb} the {noun}, and the {noun} {pick(_VERBS)}s {who}."
        return f"{who} {verb} the {pick(_NOUNS)} {pick(_PLACES)}."

    out, size = [], 0
    while size < num_bytes:
        line = " ".join(sentence().capitalize() for _ in range(1 + int(rng.random() * 4))) + "\n"
        out.append(line)
        size += len(line)
    return np.frombuffer("".join(out).encode("ascii")[:num_bytes], dtype=np.uint8)


class DataFileError(ValueError):
    """A data file that cannot be used, named with the setting that gave it (`data` unless
    `named` says another): the same problem reads right for `data` and for `data_path`."""

    def __init__(self, path: Path, problem: str, setting: str = "data"):
        super().__init__(f"`{setting}` {path}: {problem}")
        self.path, self.problem = path, problem

    def named(self, setting: str) -> DataFileError:
        return DataFileError(self.path, self.problem, setting)


def _data_error(path: Path, problem: str) -> DataFileError:
    return DataFileError(path, problem)


def sidecar_of(path: Path) -> Path:
    """The JSON file describing the token file `path`: `X.bin` -> `X.bin.json`."""
    return path.with_name(path.name + ".json")


def token_dtype(vocab_size: int) -> str:
    """The narrowest token file dtype holding every id below `vocab_size`."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporaries of `path` (`.NAME.tmpPID`, see `write_atomic`) that a run killed
    or interrupted while writing it left, those of a process that no longer lives."""
    for tmp in path.parent.glob(f".{path.name}.tmp*"):
        pid = tmp.name.removeprefix(f".{path.name}.tmp")
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def write_atomic(path: Path, content: bytes) -> None:
    """Write `path` whole or not at all: a temporary file in the same folder, renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> tuple[np.ndarray, dict]:
    """Tokens and the sidecar's fields (`vocab_size` 256 alone for a text file) of a text file
    (bytes) or a pre-tokenised `.bin` file.

    A `.bin` file is raw little-endian uint16/uint32 ids described by a sidecar `<file>.json`
    such as `{"dtype": "uint16", "vocab_size": 50257}` (other fields are `load_corpus`'s or
    ignored); it is memory-mapped read-only, so a corpus larger than memory costs only the pages
    a batch touches.
    """
    if not path.is_file():
        raise _data_error(path, "no such file: pass a text file or a .bin token file")
    size = path.stat().st_size
    if size == 0:
        raise _data_error(path, "the file is empty: pass a file with some text or tokens")
    if path.suffix != ".bin":
        return _text_bytes(path), {"vocab_size": BYTE_VOCAB_SIZE}

    sidecar = sidecar_of(path)
    example = '{"dtype": "uint16", "vocab_size": 50257}'
    if not sidecar.is_file():
        raise _data_error(path, f"a .bin file needs a sidecar {sidecar.name} like {example}")
    try:
        meta = json.loads(sidecar.read_text())
        dtype, vocab_size = meta["dtype"], meta["vocab_size"]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError) as err:
        raise _data_error(path, f"cannot read {sidecar.name} ({err}): write it like {example}") \
            from None
    if dtype not in _BIN_DTYPES:
        raise _data_error(path, f"unsupported dtype {dtype!r} in {sidecar.name}: use one of"
                                f" {', '.join(_BIN_DTYPES)}")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise _data_error(path, f"vocab_size in {sidecar.name} must be a positive integer,"
                                f" got {vocab_size!r}")
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise _data_error(path, f"its size {size} is not a multiple of {itemsize} bytes"
                                f" ({dtype}): check the dtype in {sidecar.name}")
    tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    top = int(tokens.max())  # one streaming pass, no copy of the file in memory
    if top >= vocab_size:
        raise _data_error(path, f"token id {top} is >= vocab_size {vocab_size}: fix vocab_size in"
                                f" {sidecar.name} or the tokenisation")
    return tokens, meta


def _text_bytes(path: Path) -> np.ndarray:
    """A text file's bytes as byte tokens; refuses what is not UTF-8 text (an image, a NumPy
    array, a token file without its .bin name), which would otherwise train on noise."""
    content = path.read_bytes()
    fix = ("pass UTF-8 text, or a token file from `meshtrain prepare` (FILE.bin with its"
           " FILE.bin.json)")
    if path.suffix == ".npy" or content.startswith(b"\x93NUMPY"):
        raise _data_error(path, f"a NumPy array is not text nor a token file: {fix}")
    if b"\0" in content:
        raise _data_error(path, f"binary content (a NUL byte at offset {content.index(0)}):"
                                f" {fix}")
    decoder, block = codecs.getincrementaldecoder("utf-8")(), 1 << 20
    for start in range(0, len(content), block):  # in blocks: no whole-file str copy
        try:
            decoder.decode(content[start:start + block], final=start + block >= len(content))
        except UnicodeDecodeError as err:
            raise _data_error(path, f"not UTF-8 text (near byte offset {start + err.start}):"
                                    f" {fix}") from None
    return np.frombuffer(content, dtype=np.uint8)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Tokens to train on, and what `meshtrain prepare` recorded with them."""

    tokens: np.ndarray
    vocab_size: int
    held_out: np.ndarray | None = None  # the prepared validation split: whole documents
    tokenizer: Path | None = None  # the tokenizer.json that made the tokens; None: bytes
    eod_id: int | None = None  # the token that ends each document; None: not recorded

    def splits(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """(train, validation): the prepared held-out split if any, else the tail (see
        `split_tokens`)."""
        if self.held_out is not None:
            return self.tokens, self.held_out
        return split_tokens(self.tokens, val_fraction)


def load_corpus(path: str | Path) -> Corpus:
    """`_load`'s tokens and vocabulary, plus the sidecar's `validation` (a sibling token file
    of held-out documents) and `tokenizer` (a tokenizer.json beside it, or "bytes") when it
    names them."""
    path = Path(path)
    tokens, meta = _load(path)
    held_out = None
    if meta.get("validation"):
        held_out, held_meta = _load(path.parent / meta["validation"])
        if held_meta["vocab_size"] != meta["vocab_size"]:
            raise _data_error(path, f"its validation file {meta['validation']} has vocab_size"
                                    f" {held_meta['vocab_size']}, not {meta['vocab_size']}:"
                                    " prepare both again together")
    tokenizer, eod_id = meta.get("tokenizer"), meta.get("eod_id")
    if tokenizer in (None, "bytes"):
        return Corpus(tokens, meta["vocab_size"], held_out, None, eod_id)
    tokenizer = path.parent / tokenizer
    if not tokenizer.is_file():
        raise _data_error(path, f"{sidecar_of(path).name} names the tokenizer {tokenizer.name},"
                                " which is missing: put it back beside the data or prepare again")
    return Corpus(tokens, meta["vocab_size"], held_out, tokenizer, eod_id)


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) as views: the last `val_fraction` of the stream is held out whole, so
    no validation sequence shares text with a training sequence."""
    if not 0.0 < val_fraction < 1.0:
        raise SettingError(Code.RANGE, f"`val_fraction` must be in (0, 1), got {val_fraction}")
    num_val = int(len(tokens) * val_fraction)
    return tokens[:len(tokens) - num_val], tokens[len(tokens) - num_val:]


class TokenDataset:
    """Every window of `seq_len + 1` consecutive tokens, addressed by its start offset. `name`
    says in messages where the tokens came from."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, name: str = "`data`"):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if seq_len < 1:
            raise SettingError(Code.RANGE, f"`seq_len` must be positive, got {seq_len}")
        if len(tokens) < seq_len + 1:
            raise SettingError(Code.DATA_SEQ_LEN,
                               f"{name} is too short for `seq_len` {seq_len}: a split of"
                               f" {len(tokens)} tokens cannot hold {seq_len + 1}; use more"
                               f" data, a smaller `seq_len` or another `val_fraction`")
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) - self.seq_len

    def __getitem__(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(np.array([start]))
        return inputs[0], targets[0]

    def batch(self, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, int64 `[len(starts), seq_len]` each."""
        return as_pair(self.windows(starts))

    def windows(self, starts: np.ndarray) -> np.ndarray:
        """The windows at `starts`, int64 `[len(starts), seq_len + 1]`."""
        assert 0 <= starts.min() and starts.max() < len(self), "start offset out of range"
        return self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)


def as_pair(windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows `[b, seq_len + 1]` as (inputs, next-token targets), `[b, seq_len]` each."""
    seqs = torch.from_numpy(windows)
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def check_seed(seed: int) -> None:
    """A seed torch's and numpy's generators both take: a 64-bit signed non-negative integer."""
    if not 0 <= seed < 2**63:
        raise SettingError(Code.RANGE, f"`seed` must be an integer from 0 to 2**63 - 1, got"
                                       f" {seed}")


MAX_GLOBAL_BATCH = 2**24  # sequences per step; Llama 3's 16M-token batches are 2**11 of 8192


def check_batch_sizes(*, global_batch: int, micro_batch: int, dp: int) -> None:
    """Raise ValueError unless every DP rank gets the same whole number of micro-batches."""
    for name, value in (("`global_batch`", global_batch), ("`micro_batch`", micro_batch),
                        ("dp", dp)):
        if value < 1:
            raise SettingError(Code.RANGE, f"{name} must be positive, got {value}")
    if max(global_batch, micro_batch) > MAX_GLOBAL_BATCH:  # a draw per sequence per step
        raise SettingError(Code.RANGE, (
            f"`global_batch` {global_batch} and `micro_batch` {micro_batch} are sequences per"
            f" step: past any run at more than {MAX_GLOBAL_BATCH}; lower them"))
    if global_batch % (micro_batch * dp):
        raise SettingError(Code.BATCH_SPLIT, (
            f"`global_batch` {global_batch} must be divisible by `micro_batch` x dp"
            f" = {micro_batch} x {dp} = {micro_batch * dp}"))


def to_device(batches: list[tuple[torch.Tensor, torch.Tensor]],
              device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) micro-batches on `device` in one transfer: stacked, pinned and copied
    without the host waiting (a copy from pageable memory per micro-batch makes the host wait for
    the device's queue each time). On the CPU they stay as they are."""
    if torch.device(device).type == "cpu":
        return batches
    stacked = torch.stack([torch.stack(pair) for pair in batches])  # [m, 2, micro_batch, seq]
    moved = stacked.pin_memory().to(device, non_blocking=True)
    return [(pair[0], pair[1]) for pair in moved]


class BatchSampler:
    """Global batches of random windows of `tokens`, each a pure function of (seed, step).

    Build one per split (see `split_tokens`): `micro_batches` for training, `eval_batches` for
    evaluation; the two draw from separate seed streams. `name` says in messages where the
    tokens came from. Subclasses draw a batch otherwise (`_draw`) and share the rest.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, micro_batch: int,
                 seed: int, name: str = "`data`"):
        self._set_sizes(global_batch=global_batch, micro_batch=micro_batch, seed=seed)
        self.data = TokenDataset(tokens, seq_len=seq_len, name=name)

    def _set_sizes(self, *, global_batch: int, micro_batch: int, seed: int) -> None:
        check_batch_sizes(global_batch=global_batch, micro_batch=micro_batch, dp=1)
        check_seed(seed)
        self.global_batch, self.micro_batch, self.seed = global_batch, micro_batch, seed

    def micro_batches(self, step: int, *, dp_rank: int,
                      dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's micro-batches of optimizer step `step` (0-based), as (inputs, targets)
        int64 `[micro_batch, seq_len]`: rank r gets micro-batches r*m .. (r+1)*m - 1."""
        assert step >= 0, step
        return self._rank_share(_TRAIN, step, dp_rank, dp_size)

    def eval_batches(self, num_batches: int, *, dp_rank: int,
                     dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's micro-batches of `num_batches` fixed global batches: the same windows at
        every step and dp, and the first k global batches do not depend on `num_batches`."""
        if num_batches < 1:
            raise SettingError(Code.RANGE, f"`eval_batches` must be positive, got {num_batches}")
        return [mb for i in range(num_batches)
                for mb in self._rank_share(_EVAL, i, dp_rank, dp_size)]

    def _rank_share(self, stream: int, index: int, dp_rank: int,
                    dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Global batch `index` of `stream`, as micro-batches: this rank's run of them."""
        check_batch_sizes(global_batch=self.global_batch, micro_batch=self.micro_batch,
                          dp=dp_size)
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        per_rank = self.global_batch // dp_size
        return self._draw(stream, index, slice(dp_rank * per_rank, (dp_rank + 1) * per_rank))

    def _draw(self, stream: int, index: int,
              mine: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The micro-batches of the sequences `mine` of global batch `index` of `stream`."""
        # Raw PCG64 output is stable across numpy versions (Generator methods may change); the
        # modulo bias is below len(data) / 2**64.
        raw = np.random.PCG64([self.seed, stream, index]).random_raw(self.global_batch)
        starts = (raw % np.uint64(len(self.data))).astype(np.int64)[mine]
        return [self.data.batch(chunk) for chunk in starts.reshape(-1, self.micro_batch)]
