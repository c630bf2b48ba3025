"""The rows of a run: rank 0 fills eff and x_cp2hp, prints each row and appends it to the CSV."""
from __future__ import annotations

import csv
import math
from importlib import metadata

import torch

COLUMNS = ("level", "model", "pass", "tokens", "docs", "heads", "W", "method", "layout", "ms", "eff", "x_cp2hp",
           "peak_mib", "xchg_bytes", "xchg_calls", "exchange_ms", "err", "note", "head_dim", "dtype")


class Table:
    """Rank 0's rows: fills eff and x_cp2hp, prints each row, appends it to the CSV."""
    FMT = "{model:5} {pass:7} {tokens:>7} {docs:6} {heads:>3} {W:>2} {method:8} {layout:10} {ms:>9} {eff:>5} " \
          "{x_cp2hp:>7} {peak_mib:>9} {xchg:>8} {exchange_ms:>8} {err:>8}  {note}"

    def __init__(self, args, path, show):
        self.args, self.path, self.show, self.rows = args, path, show, []

    def header(self):
        return self.FMT.format(**{c: c for c in COLUMNS}, xchg="xchg_MiB")

    def add(self, row):
        row = {c: row.get(c, math.nan if c not in ("note", "layout") else "") for c in COLUMNS}
        row.update(head_dim=self.args.head_dim, dtype=self.args.dtype)
        case = ("level", "model", "pass", "tokens", "docs", "heads")
        same = [r for r in self.rows if all(r[c] == row[c] for c in case)]
        # layers: megatron-core's cp2hp against its own module at CP=1 where there is one (GDN; KDA has none),
        # on the same kernels (``-qla``: fla handing its call to flash-qla); a captured row (``-graph``)
        # against the captured rows of its peers
        method, graph = row["method"].removesuffix("-graph"), "-graph" * row["method"].endswith("-graph")
        bases = {"cp2hp": ("megatron", "noCP"), "cp2hp-qla": ("megatron-qla", "noCP")}.get(method, ("noCP",))
        bases = bases if row["level"] == "layers" else ("noCP",)
        base = next((r["ms"] for m in bases for r in same if r["method"] == m + graph), math.nan)
        cp2hp = next((r["ms"] for r in same if r["method"] == "cp2hp" + graph and r["W"] == row["W"]), math.nan)
        if method == "cp2hp":
            cp2hp = row["ms"]
        if row["W"] == 1:
            base = row["ms"]                      # CP=1 rows are their own reference
        ok = row["ms"] > 0                        # False for nan: a failed or skipped row
        row["eff"] = base / (row["W"] * row["ms"]) if ok else math.nan
        row["x_cp2hp"] = cp2hp / row["ms"] if ok and row["W"] > 1 else math.nan
        self.rows.append(row)
        if self.show:
            print(self.line(row), flush=True)
        if self.path:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, COLUMNS).writerow({c: _fmt(row[c], 6) for c in COLUMNS})

    def skipped(self, **meta):
        """The row of a case --budget left out."""
        self.add(dict(meta, method="-", note="skipped: --budget spent", **{"pass": "-"}))

    def line(self, r):
        def f(x, d):
            if not isinstance(x, float):
                return x
            return f"{x:.{d}f}" if math.isfinite(x) else "-"
        return self.FMT.format(**{**r, "ms": f(r["ms"], 3), "eff": f(r["eff"], 2), "x_cp2hp": f(r["x_cp2hp"], 2),
                                  "peak_mib": f(r["peak_mib"], 0), "exchange_ms": f(r["exchange_ms"], 3),
                                  "err": f"{r['err']:.1e}" if math.isfinite(r["err"]) else "-",
                                  "xchg": f(r["xchg_bytes"] / 2**20, 2) if math.isfinite(r["xchg_bytes"]) else "-"})

    def print_all(self, title):
        print(f"\nall rows:\n{title}\n{self.header()}")
        for r in self.rows:
            print(self.line(r))
        print(flush=True)


def _fmt(x, digits):
    return f"{x:.{digits}g}" if isinstance(x, float) and math.isfinite(x) else ("" if isinstance(x, float) else x)


def describe(args, W) -> str:
    def v(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"
    if args.device == "cuda":
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        dev = f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}, CUDA {torch.version.cuda}, NCCL {nccl}"
    else:
        dev = "CPU (smoke run: reference kernels over gloo, not a measurement)"
    return (f"{dev}; torch {torch.__version__}, triton {v('triton')}, fla-core {v('fla-core')}, megatron-core "
            f"{v('megatron-core')}\nW={W}, {args.dtype}, K=V={args.head_dim}, median of {args.iters} after "
            f"{args.warmup} warm-up per shape, slowest rank; varlen = VARLEN_32K scaled by T/32768")
