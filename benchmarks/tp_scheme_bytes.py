"""Tensor-parallel bytes per rank per GPT layer (forward and backward, one micro-batch of B
tokens, bf16) of each scheme at tp = P, from each scheme's formulas (`TPScheme.layer_traffic`),
and which scheme moves fewest.

    python benchmarks/tp_scheme_bytes.py              # aligned text
    python benchmarks/tp_scheme_bytes.py --markdown   # a table for the docs

2.5d shows its best depth d (P = d q^2, d >= 2; d = 1 is 2d). Left out: 2.5d's all-reduce of
the weight gradients over depth, once per optimizer step rather than per micro-batch.
"""

from __future__ import annotations

import argparse

from meshtrain.models.gpt import GPTConfig
from meshtrain.parallel.schemes.registry import tp_scheme

HIDDEN = (1024, 4096, 12288)
TOKENS = (2048, 2048 * 8)
RANKS = (4, 8, 16, 27, 64)
ELEMENT_BYTES = 2
MIB = 2**20
COLUMNS = ("h", "B", "P", "1d", "2d", "2.5d", "3d", "fewest")


def scheme_bytes(hidden: int, tokens: int, ranks: int) -> dict[str, tuple[float, int | None]]:
    """Scheme -> (bytes per rank per layer, 2.5d's best depth), for each scheme `ranks` forms
    a grid for."""
    model = GPTConfig(num_layers=1, hidden_size=hidden, num_heads=hidden // 128)
    out: dict[str, tuple[float, int | None]] = {}
    for scheme, depths in (("1d", [None]), ("2d", [None]), ("3d", [None]),
                           ("2.5d", range(2, ranks + 1))):
        scheme_def = tp_scheme(scheme)
        for depth in (d for d in depths if scheme_def.forms(ranks, d)):
            moved = scheme_def.layer_traffic(model, scheme_def.grid(ranks, depth), tokens,
                                             ELEMENT_BYTES).total_bytes
            if scheme not in out or moved < out[scheme][0]:
                out[scheme] = (moved, depth)
    return out


def _cell(found: dict[str, tuple[float, int | None]], scheme: str) -> str:
    if scheme not in found:
        return "-"
    moved, depth = found[scheme]
    return f"{moved / MIB:.1f}" + ("" if depth is None else f" (d={depth})")


def rows() -> list[list[str]]:
    table = []
    for hidden in HIDDEN:
        for tokens in TOKENS:
            for ranks in RANKS:
                found = scheme_bytes(hidden, tokens, ranks)
                fewest = min(found, key=lambda s: found[s][0])
                table.append([str(hidden), str(tokens), str(ranks),
                              *(_cell(found, s) for s in ("1d", "2d", "2.5d", "3d")), fewest])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    table = rows()
    print("MiB per rank per layer (forward + backward), bf16, GPT layer (f = 4h); '-': P forms"
          " no grid of that scheme\n")
    if args.markdown:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + "---:|" * (len(COLUMNS) - 1) + ":---|")
        for row in table:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(r[i]) for r in [list(COLUMNS), *table]) for i in range(len(COLUMNS))]
    for row in [list(COLUMNS), *table]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
