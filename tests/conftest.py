import json
import os
import shutil
import sys
import tempfile

# Single-process tests share two cores with rank pools: keep torch to one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The golden runs compare floats bitwise, and ATen, MKL and oneDNN pick kernels by the CPU's
# instruction set (an AVX-512 host rounds matmuls differently from an AVX2 one). Pin all three
# to AVX2, before torch loads, so every x86 machine of this kind computes the same bits; the rank
# processes and CLI runs the tests start inherit it.
os.environ.update(ATEN_CPU_CAPABILITY="avx2", MKL_CBWR="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
# Inductor's on-disk cache does not key its CPU kernels by that pin (torch 2.13): kernels cached
# under it corrupt the heap of a later unpinned run loading them, and the other way round. The
# compile tests therefore cache in a folder of their own session, removed at its end.
_INDUCTOR_CACHE = tempfile.mkdtemp(prefix="meshtrain-tests-inductor-")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
# `plan` and `train --layout auto` prefer a profile `plan calibrate` measured on this machine
# ($MESHTRAIN_HOME/hardware): the tests must not read the user's, so they get an empty home.
_HOME = tempfile.mkdtemp(prefix="meshtrain-tests-home-")
os.environ["MESHTRAIN_HOME"] = _HOME
sys.path.insert(0, os.path.dirname(__file__))
# This tree's own sources first, also for the CLI subprocesses the tests start, so a git worktree
# tests its code even where the environment's editable install points at another checkout.
_SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
sys.path.insert(0, _SRC)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_SRC, os.environ.get("PYTHONPATH")]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402

from meshtrain.data.corpus import synthetic_corpus  # noqa: E402


def pytest_unconfigure(config):
    shutil.rmtree(_INDUCTOR_CACHE, ignore_errors=True)
    shutil.rmtree(_HOME, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _meshes_per_module():
    """Rank pools keep the meshes of one test module (see harness.forget_meshes)."""
    yield
    if "harness" in sys.modules:
        sys.modules["harness"].forget_meshes()


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory):
    """`corpus_file(size, seed)`: the path of a synthetic byte corpus, written once a session."""
    written: dict[tuple[int, int], str] = {}

    def make(size: int, seed: int) -> str:
        if (size, seed) not in written:
            path = tmp_path_factory.mktemp("data") / f"corpus_{size}_{seed}.txt"
            path.write_bytes(synthetic_corpus(size, seed=seed).tobytes())
            written[size, seed] = str(path)
        return written[size, seed]

    return make


@pytest.fixture(scope="session")
def corpus(corpus_file) -> str:
    """The corpus the training tests share (layouts are compared on the same tokens)."""
    return corpus_file(60_000, seed=0)


@pytest.fixture(scope="session")
def documents_file(tmp_path_factory) -> str:
    """A token file of byte documents, each ending with the end-of-document id 256
    (packed-document tests)."""
    text = bytes(np.frombuffer(b"the cat sat. a dog ran far away. birds sing", np.uint8))
    g = np.random.default_rng(0)
    tokens = []
    while len(tokens) < 20_000:
        start, length = g.integers(0, len(text) - 8), g.integers(3, 40)
        tokens += list(text[start:start + length]) + [256]
    path = tmp_path_factory.mktemp("docs") / "docs.bin"
    np.asarray(tokens, dtype="<u2").tofile(path)
    path.with_name("docs.bin.json").write_text(json.dumps(
        {"dtype": "uint16", "vocab_size": 257, "eod_id": 256, "tokenizer": "bytes"}))
    return str(path)
