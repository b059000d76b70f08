"""What verifying a checkpoint costs: `read_manifest` (the digest record, names, piece tiling,
safetensors headers, model settings) against hashing the files alone (all the check did before
the record existed). One short run writes a checkpoint of about 160 MB (weights + Adam moments).

    python benchmarks/checkpoint_verify_cost.py
"""

import tempfile
import time
from pathlib import Path

from meshtrain.checkpointing.checkpoint import latest_checkpoint
from meshtrain.checkpointing.verify import read_manifest, sha256
from meshtrain.cli.main import main


def times_of(fn, repeats: int = 5) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` (bench_dcp times its exports with it too)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def run() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        assert main(["train", "--num-layers", "4", "--hidden-size", "512", "--num-heads", "8",
                     "--seq-len", "16", "--global-batch", "2", "--micro-batch", "2",
                     "--steps", "1", "--eval-every", "0", "--device", "cpu",
                     "--out", str(out)]) == 0
        path = latest_checkpoint(out / "checkpoints")
        size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
        verify = times_of(lambda: read_manifest(path))
        hashes = times_of(lambda: [sha256(f) for f in path.glob("rank_*.safetensors")])
        print(f"checkpoint {size:.0f} MB; read_manifest {min(verify):.3f}-{max(verify):.3f} s;"
              f" hashing the rank files alone {min(hashes):.3f}-{max(hashes):.3f} s (5 runs each,"
              " page cache warm)")


if __name__ == "__main__":
    run()
