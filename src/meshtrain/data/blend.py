"""What a run trains on: one corpus (`data`, or the built-in one) or several token files blended
by weight (`data_path`, as Megatron-LM's `--data-path W1 FILE1 W2 FILE2 ...`).

A blend keeps the sampler's promise: the global batch of step k depends only on (seed, k) and the
blend, never on dp, the micro-batch or what was drawn before, so a run resumed at any layout
continues the same sample stream.
"""

from __future__ import annotations

import dataclasses
import itertools
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from meshtrain.data.corpus import (
    BYTE_VOCAB_SIZE,
    BatchSampler,
    Corpus,
    DataFileError,
    TokenDataset,
    as_pair,
    load_corpus,
    stdlib_corpus,
)
from meshtrain.errors import Code, SettingError

_EXAMPLE = "`data_path` 0.7 a.bin 0.3 b.bin"


def parse_data_path(values: list[str]) -> list[tuple[Fraction, str]]:
    """`data_path`'s (weight, file) pairs: WEIGHT FILE pairs, or one FILE (weight 1). Weights
    are exact fractions ("0.7" is 7/10), so the blend's proportions carry no rounding."""
    if len(values) == 1:
        return [(Fraction(1), values[0])]
    if not values or len(values) % 2:
        raise SettingError(Code.DATA_BLEND, f"`data_path` takes WEIGHT FILE pairs (or one FILE),"
                                            f" got {len(values)} values: give a weight before"
                                            f" each file, as in {_EXAMPLE}")
    pairs = []
    for text, file in zip(values[::2], values[1::2], strict=True):
        try:
            weight = Fraction(text)
        except (ValueError, ZeroDivisionError):
            raise SettingError(Code.DATA_BLEND, f"`data_path` weight {text!r} (before {file}) is"
                                                " not a number: give a positive weight before"
                                                f" each file, as in {_EXAMPLE}") from None
        if weight <= 0:
            raise SettingError(Code.DATA_BLEND, f"`data_path` weight {text} of {file} must be"
                                                " positive: drop the file or give it a weight"
                                                " above 0")
        pairs.append((weight, file))
    return pairs


@dataclasses.dataclass(frozen=True)
class Blend:
    """Corpora drawn by weight (normalized: they sum to 1). They share vocab_size, tokenizer and
    eod_id, so one model, one `sample` decoder and one packing rule fit them all."""

    corpora: tuple[Corpus, ...]
    weights: tuple[Fraction, ...]
    names: tuple[str, ...]  # how messages name each corpus

    @property
    def vocab_size(self) -> int:
        return self.corpora[0].vocab_size

    @property
    def tokenizer(self) -> Path | None:
        return self.corpora[0].tokenizer

    @property
    def eod_id(self) -> int | None:
        return self.corpora[0].eod_id

    def samplers(self, val_fraction: float, **sizes) -> tuple[BatchSampler, BatchSampler]:
        """(training, evaluation) samplers over each corpus's splits (see `Corpus.splits`), the
        evaluation one blending the validation splits with the same weights; `sizes` are
        `BatchSampler`'s. One corpus keeps `BatchSampler`'s own draws: `data` runs stay
        bitwise what they were."""
        splits = [corpus.splits(val_fraction) for corpus in self.corpora]
        if len(splits) == 1:
            return tuple(BatchSampler(part, name=self.names[0], **sizes) for part in splits[0])
        return tuple(BlendedSampler([split[i] for split in splits], self.weights,
                                    names=self.names, **sizes) for i in (0, 1))


def load_data(data: str | None, data_path: list[str] | None) -> Blend:
    """The run's data: the `data_path` blend, the `data` file, or the built-in corpus."""
    if data_path is not None:
        return load_blend(data_path)
    corpus = load_corpus(data) if data is not None else Corpus(stdlib_corpus(), BYTE_VOCAB_SIZE)
    return Blend((corpus,), (Fraction(1),), ("`data`",))


def load_blend(data_path: list[str]) -> Blend:
    """`data_path`'s files, weights normalized; refuses missing files and files that differ in
    vocab_size, tokenizer or eod_id."""
    pairs = parse_data_path(data_path)
    missing = [file for _, file in pairs if not Path(file).is_file()]
    if missing:
        raise SettingError(Code.DATA_BLEND, f"`data_path` names {', '.join(missing)}: no such"
                                            " file; prepare it or fix the path")
    corpora = []
    for _, file in pairs:
        try:
            corpora.append(load_corpus(file))
        except DataFileError as err:
            raise err.named("data_path") from None
    _check_compatible(corpora, [file for _, file in pairs])
    total = sum(weight for weight, _ in pairs)
    return Blend(tuple(corpora), tuple(weight / total for weight, _ in pairs),
                 tuple(f"`data_path` file {file}" for _, file in pairs))


def _check_compatible(corpora: list[Corpus], files: list[str]) -> None:
    """Refuse a blend whose files a single model and decoder cannot share."""
    def tokenizer(corpus: Corpus) -> bytes | None:  # copies beside each file: compare content
        return corpus.tokenizer.read_bytes() if corpus.tokenizer is not None else None

    for what, key in (("vocab_size", lambda c: c.vocab_size), ("tokenizer", tokenizer),
                      ("eod_id", lambda c: c.eod_id)):
        for corpus, file in zip(corpora[1:], files[1:], strict=True):
            if key(corpus) != key(corpora[0]):
                shown = ("" if what == "tokenizer" else
                         f" ({key(corpora[0])} and {key(corpus)})")
                raise SettingError(Code.DATA_BLEND, f"`data_path` files {files[0]} and {file}"
                                                    f" differ in {what}{shown}: blend files"
                                                    " prepared with the same tokenizer")


class BlendedSampler(BatchSampler):
    """Global batches drawn from several token streams by weight, each a pure function of
    (seed, step).

    Which source each sequence comes from: with C_i the cumulative weight of sources 0..i, the
    first n sequences of the run hold floor(C_i n) from sources 0..i, so source i's count is
    within 1 of its weight times n after every global batch, in any run, resumed or not (the
    count of a batch is the difference of two such floors, O(sources) exact integer arithmetic
    on fractions). Within the batch a seeded permutation spreads the sources over the slots, so
    every micro-batch and dp rank sees the mix; then each slot takes a random window of its
    source. Both come from raw PCG64 output of (seed, stream, index), as `BatchSampler`'s do:
    its first `global_batch` values pick the windows, the next ones order the sources.
    """

    def __init__(self, sources: list[np.ndarray], weights: tuple[Fraction, ...], *,
                 seq_len: int, global_batch: int, micro_batch: int, seed: int,
                 names: tuple[str, ...]):
        self._set_sizes(global_batch=global_batch, micro_batch=micro_batch, seed=seed)
        self.datasets = [TokenDataset(tokens, seq_len=seq_len, name=name)
                         for tokens, name in zip(sources, names, strict=True)]
        self.lengths = np.array([len(data) for data in self.datasets], dtype=np.uint64)
        self.cumulative = list(itertools.accumulate(weights))
        assert self.cumulative[-1] == 1, weights

    def source_counts(self, index: int) -> np.ndarray:
        """How many sequences of global batch `index` each source gives."""
        def first(n: int) -> np.ndarray:  # of the first n sequences, those from sources <= i
            return np.diff([0] + [c.numerator * n // c.denominator for c in self.cumulative])

        return first((index + 1) * self.global_batch) - first(index * self.global_batch)

    def _draw(self, stream: int, index: int,
              mine: slice) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = self.global_batch
        raw = np.random.PCG64([self.seed, stream, index]).random_raw(2 * size)
        sources = np.repeat(np.arange(len(self.datasets)), self.source_counts(index))
        sources = sources[np.argsort(raw[size:], kind="stable")][mine]
        starts = (raw[:size][mine] % self.lengths[sources]).astype(np.int64)
        step = self.micro_batch
        return [self._windows(sources[i:i + step], starts[i:i + step])
                for i in range(0, len(starts), step)]

    def _windows(self, sources: np.ndarray,
                 starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = np.empty((len(starts), self.datasets[0].seq_len + 1), dtype=np.int64)
        for i, data in enumerate(self.datasets):
            if (picked := sources == i).any():
                seqs[picked] = data.windows(starts[picked])
        return as_pair(seqs)
