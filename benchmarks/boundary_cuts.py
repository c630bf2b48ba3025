"""Modelled: what moving the contiguous layout's cuts to document boundaries would save, and cost.

    python benchmarks/boundary_cuts.py                                   # 32k and 128k, W = 2, 4, 8
    python benchmarks/boundary_cuts.py --tokens 131072 --cp 2 4 8 16 --heads 32

The contiguous layout cuts the stream at ``rT/W``, so up to W - 1 documents cross a rank edge and
their states cross with them (:func:`megatron_kcp.parallel.cost_model.layout_cost`, the exchange's
modelled fwd+bwd seconds). Moving each cut to the nearest document boundary leaves no document
crossing and so no exchange, but the ranks then hold unequal token counts, and a step waits for
the rank with the most. Per row:

* ``exchange_ms``: the contiguous layout's modelled exchange, which the moved cuts remove;
* ``imbalance``: the most tokens a rank holds after the move, over T / W, less one;
* ``pays_below_ms``: ``exchange_ms / imbalance``, the rank's step time (ms, its tokens' work) under
  which the move pays: the added tokens cost less than the exchange saved.

Nothing here is measured: the cost model's constants are fitted on H200 runs (see cost_model.py).
"""
from __future__ import annotations

import argparse
import bisect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import cu_seqlens  # noqa: E402
from megatron_kcp.parallel.cost_model import layout_cost  # noqa: E402


def boundary_cuts(cu: tuple[int, ...], world_size: int) -> list[int]:
    """The contiguous layout's cuts, each moved to the document boundary nearest to it."""
    T, cuts = cu[-1], []
    for r in range(1, world_size):
        c = r * T // world_size
        i = bisect.bisect_left(cu, c)
        cuts.append(min((cu[j] for j in (i - 1, i) if 0 <= j < len(cu)), key=lambda b: abs(b - c)))
    return cuts


def row(docs: str, T: int, W: int, heads: int, head_dim: int) -> dict:
    cu = cu_seqlens(docs, T, pad=2 * W)
    edges = [0, *boundary_cuts(cu, W), T]
    imbalance = max(b - a for a, b in zip(edges, edges[1:])) / (T / W) - 1
    exchange = layout_cost(cu, "contiguous", W, heads, head_dim) * 1e3
    return dict(docs=docs, tokens=T, W=W, exchange_ms=exchange, imbalance=imbalance,
                pays_below_ms=exchange / imbalance if imbalance > 0 else float("inf"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--docs", nargs="+", default=["varlen", "varlen100", "varlen300"])
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--heads", type=int, default=16, help="value heads a rank (Qwen3-Next at TP = 2: 16)")
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    print("| docs | tokens | W | exchange_ms | imbalance | pays_below_ms |\n|---|---|---|---|---|---|")
    for T in args.tokens:
        for docs in args.docs:
            for W in args.cp:
                r = row(docs, T, W, args.heads, args.head_dim)
                print(f"| {docs} | {T} | {W} | {r['exchange_ms']:.3f} | {100 * r['imbalance']:.1f}% | "
                      f"{r['pays_below_ms']:.1f} |")


if __name__ == "__main__":
    main()
