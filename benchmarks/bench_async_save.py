"""How long a checkpoint save blocks the step loop: synchronous (`save_checkpoint`) against
`async_save` (a host snapshot, then a background writer), on one CPU process with a model of
about 100 M parameters (weights + Adam moments: about 1.2 GB on disk). The async time is what
`Trainer.save(background=True)` takes; the write's own time is measured by settling it.

    python benchmarks/bench_async_save.py
"""

import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29517")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

from meshtrain.checkpointing.async_save import AsyncSaver  # noqa: E402
from meshtrain.config.run_config import build_config  # noqa: E402
from meshtrain.parallel.runtime.process_groups import init_parallel  # noqa: E402
from meshtrain.training.trainer import Trainer  # noqa: E402

REPEATS = 3


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run() -> None:
    mesh = init_parallel(device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cfg = build_config({}, {
            "train": {"steps": 2, "global_batch": 2, "micro_batch": 2, "seq_len": 16},
            "model": {"num_layers": 8, "hidden_size": 1024, "num_heads": 16},
            "parallel": {"device": "cpu"}, "checkpoint": {"out": str(out), "keep_last": 1}})
        trainer = Trainer.build(cfg, mesh)
        trainer.train_step(0)
        params = sum(p.numel() for p in trainer.model.parameters())
        sync = [_timed(lambda s=s: trainer.save(out, s)) for s in range(1, REPEATS + 1)]
        trainer.saver = AsyncSaver(mesh)
        blocking, written = [], []
        for s in range(REPEATS + 1, 2 * REPEATS + 1):
            blocking.append(_timed(lambda s=s: trainer.save(out, s, background=True)))
            written.append(_timed(trainer.settle_save))  # the write finishing, off the loop
        size = sum(f.stat().st_size for f in (out / "checkpoints" / f"step_{s:08d}").iterdir())
    print(f"{params / 1e6:.0f} M parameters, checkpoint {size / 1e9:.2f} GB, best of {REPEATS}:"
          f" synchronous save blocks {min(sync):.2f} s; async save blocks {min(blocking):.3f} s"
          f" (ratio {min(blocking) / min(sync):.3f}); its background write then took"
          f" {min(written):.2f} s more\n  every run: sync {_list(sync)}; async {_list(blocking)}"
          " (the first async save allocates the host snapshot buffers the others reuse)")


def _list(times: list[float]) -> str:
    return ", ".join(f"{t:.3f}" for t in times)


if __name__ == "__main__":
    run()
