"""``compare``: the rows of a results CSV beside the same file (or another) at a base commit.

Rows are matched on :data:`schema.KEY` (a case and a method); a row prints its base and current ``ms`` and
their ratio (current / base: below 1 is faster), and the rows only one side has. ``--threshold`` makes the
exit status 1 where a matched row is slower than base by more than that fraction.
"""
from __future__ import annotations

import argparse
import math
import subprocess

from benchmarks import schema


def at_commit(path: str, commit: str) -> str:
    """The text of ``path`` (relative to the repository root) at ``commit``."""
    rel = str(schema.ROOT.joinpath(path).resolve().relative_to(schema.ROOT))
    r = subprocess.run(["git", "show", f"{commit}:{rel}"], cwd=schema.ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"compare: {rel} at {commit}: {r.stderr.strip()}")
    return r.stdout


def pair(base: list[dict], current: list[dict]) -> list[tuple[tuple, dict | None, dict | None]]:
    """(key, base row, current row) of every key either side has, in the current file's order first."""
    def keyed(rows):
        return {tuple(r[c] for c in schema.KEY): r for r in rows if schema.number(r["ms"]) == schema.number(r["ms"])}
    b, c = keyed(base), keyed(current)
    keys = list(c) + [k for k in b if k not in c]
    return [(k, b.get(k), c.get(k)) for k in keys]


def ratio(b: dict | None, c: dict | None) -> float:
    if b is None or c is None:
        return math.nan
    return schema.number(c["ms"]) / schema.number(b["ms"])


def lines(pairs) -> list[str]:
    out = [f"{'case':70} {'base ms':>10} {'ms':>10} {'ratio':>7}"]
    for key, b, c in pairs:
        case = " ".join(str(x) for x in key if x not in ("", None))
        ms = [f"{schema.number(r['ms']):.4g}" if r else "-" for r in (b, c)]
        x = ratio(b, c)
        out.append(f"{case[:70]:70} {ms[0]:>10} {ms[1]:>10} {'-' if math.isnan(x) else f'{x:.3f}':>7}")
    return out


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("csv", help="the current results CSV")
    p.add_argument("--base", default="HEAD", help="the base commit (default HEAD)")
    p.add_argument("--base-csv", default=None, help="the file at the base commit (default: the same path)")
    p.add_argument("--threshold", type=float, default=None, help="exit 1 where a row is this fraction slower")
    args = p.parse_args(argv)
    base_path = args.base_csv or args.csv
    pairs = pair(schema.read(base_path, at_commit(base_path, args.base)), schema.read(args.csv))
    print("\n".join(lines(pairs)))
    if args.threshold is not None:
        slower = [k for k, b, c in pairs if ratio(b, c) > 1 + args.threshold]
        return 1 if slower else 0
    return 0
