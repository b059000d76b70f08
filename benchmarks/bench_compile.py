"""Eager against `--compile` step time of `meshtrain train`, alternating in one run.

    python benchmarks/bench_compile.py [--rounds 2] [-- TRAIN FLAGS...]

Each round trains the same settings eagerly and compiled (default: GPT with 4 layers of width
512 at sequence 256, one rank on this CPU) and reads the median step time of the steps after the
first two from metrics.jsonl; the compiled run's first step (which compiles) is shown apart.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
DEFAULT = ["--model", "tiny", "--num-layers", "4", "--hidden-size", "512", "--num-heads", "8",
           "--seq-len", "256", "--micro-batch", "4", "--global-batch", "8", "--nproc", "1",
           "--device", "cpu"]


def run(flags: list[str], compiled: bool, out: Path) -> tuple[float, float | None]:
    argv = [sys.executable, "-m", "meshtrain", "train", *flags, "--steps", "10",
            "--eval-every", "0", "--log-every", "1", "--out", str(out)]
    done = subprocess.run(argv + ["--compile"] * compiled, capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, check=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][2:]
    first = re.search(r"in the first step: it took ([\d.]+) s", done.stdout + done.stderr)
    return statistics.median(times), float(first.group(1)) if first else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args, flags = parser.parse_known_args()
    flags = [f for f in flags if f != "--"] or DEFAULT
    work = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    eager, compiled, first = [], [], []
    for r in range(args.rounds):
        eager.append(run(flags, False, work / f"eager{r}")[0])
        step, compile_step = run(flags, True, work / f"compiled{r}")
        compiled.append(step)
        first.append(compile_step)
    e, c = statistics.median(eager), statistics.median(compiled)
    print(f"flags: {' '.join(flags)}")
    print(f"eager {e * 1e3:.1f} ms/step, compiled {c * 1e3:.1f} ms/step: compiled/eager"
          f" {c / e:.3f}; first compiled step {', '.join(f'{s:.1f}' for s in first)} s")


if __name__ == "__main__":
    main()
