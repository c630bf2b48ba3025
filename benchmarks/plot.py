"""PNG of a bench_ops.py CSV: parallel efficiency and speed-up over cp2hp vs sequence length; or of a
simulate.py CSV: predicted efficiency vs the CP size W, per strategy, and where the strategies cross.

    python benchmarks/plot.py ops.csv -o ops.png
    python benchmarks/plot.py predict.csv -o predict.png     # also prints the crossover table

bench_ops.py CSVs: one row of panels per pass (fwd, fwd+bwd); one line per (model, documents, method,
layout, H, W); op-level rows only. The device may lack matplotlib, so bench_ops.py skips the PNG there
and this script makes it from the CSV afterwards.
"""
from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _series(rows, pas, column):
    """{label: [(tokens, value), ...]} of the CP rows of one pass that have a value."""
    lines = defaultdict(list)
    for r in rows:
        if r["level"] != "ops" or r["pass"] != pas or r["method"] == "noCP":
            continue
        if column == "x_cp2hp" and r["method"] == "cp2hp":
            continue
        y = _num(r[column])
        if math.isfinite(y):
            label = f"{r['model']} {r['docs']} {r['method']}" + (f" {r['layout']}" if r["layout"] != "-" else "")
            lines[f"{label} H={r['heads']} W={r['W']}"].append((int(r["tokens"]), y))
    return {k: sorted(v) for k, v in sorted(lines.items())}


def plot(rows: list[dict], path: str) -> str:
    """Write the PNG; returns what was done (a sentence), never raises for a missing matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no PNG: matplotlib does not import (pip install matplotlib; python benchmarks/plot.py CSV -o {path})"
    passes = [p for p in ("fwd", "fwd+bwd") if any(r["level"] == "ops" and r["pass"] == p for r in rows)]
    if not passes:
        return "no PNG: the CSV has no op-level rows"
    fig, axes = plt.subplots(len(passes), 2, figsize=(13, 4.5 * len(passes)), squeeze=False)
    colors = {}
    for i, pas in enumerate(passes):
        for j, (column, title, ref) in enumerate((("eff", "parallel efficiency t_noCP / (W t)", 1.0),
                                                  ("x_cp2hp", "speed-up over cp2hp", 1.0))):
            ax = axes[i][j]
            for label, pts in _series(rows, pas, column).items():
                # colour: the method and documents; line style: the model (GDN solid, KDA dashed)
                kind = label.split(" ", 1)[1]
                color = colors.setdefault(kind, f"C{len(colors) % 10}")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=color,
                        ls="--" if label.startswith("KDA") else "-")
            ax.axhline(ref, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("total tokens T")
            ax.set_title(f"{pas}: {title}")
            ax.grid(alpha=0.3)
            if ax.lines[:-1]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def crossover(rows: list[dict]) -> list[str]:
    """Per (model, T, docs, H, layout, core) of a simulate.py CSV: the predicted efficiency of each
    strategy at each W, and the smallest W from which the all-gather is ahead (what cost_model.costs is
    fitted to)."""
    cases = defaultdict(dict)
    for r in rows:
        eff = _num(r.get("eff"))
        if math.isfinite(eff):
            key = (r["model"], r["tokens"], r["docs"], r["heads"], r["layout"], r.get("backend") or "fla")
            cases[key][(int(r["W"]), r["strategy"])] = eff
    out = []
    for (model, T, docs, H, layout, backend), effs in sorted(cases.items()):
        ws = sorted({w for w, _ in effs})

        def cell(w):
            return "/".join(f"{effs[(w, s)]:.2f}" if (w, s) in effs else "-" for s in ("relay", "gather"))
        cells = " ".join(f"W={w}: {cell(w)}" for w in ws)
        ahead = [w for w in ws if effs.get((w, "gather"), -1) > effs.get((w, "relay"), math.inf)]
        out.append(f"{model} T={T} {docs} H={H} {layout} {backend}: eff relay/gather {cells}; all-gather ahead from "
                   + (f"W={ahead[0]}" if ahead else "none of these W"))
    return out


def plot_predicted(rows: list[dict], path: str) -> str:
    """Predicted efficiency vs W: one panel per (model, T, docs, H), one line per layout and strategy."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"no PNG: matplotlib does not import (pip install matplotlib; python benchmarks/plot.py CSV -o {path})"
    panels = defaultdict(lambda: defaultdict(list))
    for r in rows:
        eff = _num(r.get("eff"))
        if math.isfinite(eff):
            key = f"{r['model']} T={r['tokens']} {r['docs']} H={r['heads']}"
            panels[key][f"{r['layout']} {r['strategy']} {r.get('backend') or 'fla'}"].append((int(r["W"]), eff))
    if not panels:
        return "no PNG: the CSV has no predicted efficiencies"
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, lines) in zip(axes[0], sorted(panels.items())):
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label,
                    ls="-" if " relay" in label else "--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CP size W")
        ax.set_title(f"{title}: predicted t_noCP / (W t)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("-o", "--output", required=True, help="PNG path")
    args = p.parse_args(argv)
    rows = read_rows(args.csv)
    if rows and "strategy" in rows[0]:           # simulate.py's CSV
        print("\n".join(crossover(rows)))
        print(plot_predicted(rows, args.output))
    else:
        print(plot(rows, args.output))


if __name__ == "__main__":
    main()
