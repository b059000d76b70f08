"""What splitting a backward costs: one pipeline chunk's fused backward (B) against its input-
gradient half (I) followed by its weight-gradient half (W), as zb-h1 and zb-v run them.

One process, one thread, the last stage of a GPT (layers, final norm, output layer, loss) on
hidden-state input; gradients preallocated, as under data-parallel buckets. B and I + W
alternate; medians of the repetitions.

    python benchmarks/bench_split_backward.py                 # 3 layers, h 512, V 8192, s 256
    python benchmarks/bench_split_backward.py --quick         # tiny sizes
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshtrain import ParallelMesh
from meshtrain.contracts import StageSpec
from meshtrain.models import preset
from meshtrain.parallel.layers.weight_grads import accumulate_deferred, defer_weight_gradients
from meshtrain.parallelize import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    h, vocab, seq, layers = (64, 256, 32, 2) if args.quick else (512, 8192, 256, 3)
    cfg = preset("tiny", num_layers=layers, hidden_size=h, num_heads=8, vocab_size=vocab,
                 max_seq_len=seq)
    model = build_model(cfg, ParallelMesh.local(),
                        stage=StageSpec((range(layers),), has_embedding=False))
    params = list(model.parameters())
    targets = torch.randint(0, vocab, (1, seq))
    weight_grads = defer_weight_gradients(model)
    layers_with = [m for m in model.modules() if hasattr(m, "weight_grads")]

    def loss(x: torch.Tensor) -> torch.Tensor:
        return model.cross_entropy(model(x, torch.arange(seq)), targets)

    def fused() -> tuple[float, float]:
        for m in layers_with:
            m.weight_grads = None
        x = torch.randn(1, seq, h, requires_grad=True)
        value, start = loss(x), time.perf_counter()
        value.backward()
        return time.perf_counter() - start, 0.0

    def split() -> tuple[float, float]:
        for m in layers_with:
            m.weight_grads = weight_grads
        x = torch.randn(1, seq, h, requires_grad=True)
        value, start = loss(x), time.perf_counter()
        with weight_grads.deferred() as queued:
            grads = torch.autograd.grad([value], [x, *params], allow_unused=True)
        middle = time.perf_counter()
        kept = [(p, g) for p, g in zip(params, grads[1:], strict=True) if g is not None]
        accumulate_deferred(kept, queued)  # as the executor's W
        return middle - start, time.perf_counter() - middle

    times: dict[str, list[tuple[float, float]]] = {"B": [], "I+W": []}
    for repeat in range(args.repeats + 1):
        for name, run in (("B", fused), ("I+W", split)):
            for p in params:
                p.grad = torch.zeros_like(p)
            if repeat:  # the first round warms up
                times[name].append(run())
            else:
                run()
    b = statistics.median(t for t, _ in times["B"])
    i = statistics.median(t for t, _ in times["I+W"])
    w = statistics.median(t for _, t in times["I+W"])
    print(f"fused B {1e3 * b:.1f} ms; I {1e3 * i:.1f} ms + W {1e3 * w:.1f} ms ="
          f" {1e3 * (i + w):.1f} ms ({(i + w) / b:.2f}x B)")


if __name__ == "__main__":
    main()
