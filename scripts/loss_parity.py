"""Per-step losses of several runs (``megatron_kcp.train --kcp-log`` JSON lines, or any Megatron
training log: ``*.log``, its ``iteration N/ M | ... | lm loss: X |`` lines) against a reference.

    python scripts/loss_parity.py cp1.jsonl cp2.jsonl resume.jsonl --reference cp2.jsonl --tol 2e-2 \\
        [--plot losses.png]

For each run: the steps it shares with the reference, the largest relative loss difference and
its step, PASS/FAIL against ``--tol``; a table of every 10th step side by side. Exit status 1 if a
run fails or shares no step with the reference (a comparison that cannot fail is no check).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


MEGATRON_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*? lm loss: ([-+.0-9Ee]+) \|")


def read(path) -> dict[int, float]:
    if not Path(path).exists():          # a run that never logged a step: reported as failing below
        return {}
    text = Path(path).read_text()
    if Path(path).suffix == ".log":      # Megatron prints the loss with 7 significant digits
        return {int(m[1]): float(m[2]) for m in MEGATRON_LINE.finditer(text)}
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows}        # a restarted step overwrites its first attempt


def compare(runs: dict[str, dict], ref: dict, tol: float) -> list[str]:
    out, failed = [], False
    for name, losses in runs.items():
        steps = sorted(set(losses) & set(ref))
        if not steps:
            out.append(f"{name}: FAIL, no step in common with the reference")
            failed = True
            continue
        diffs = {s: abs(losses[s] - ref[s]) / abs(ref[s]) for s in steps}
        worst = max(diffs, key=diffs.get)
        ok = diffs[worst] <= tol
        failed |= not ok
        out.append(f"{name}: steps {steps[0]}-{steps[-1]} ({len(steps)}), max rel diff {diffs[worst]:.2e} "
                   f"at step {worst}: {'PASS' if ok else 'FAIL'} (tol {tol:g})")
    return out + (["FAILED"] if failed else ["all runs within tolerance"])


def table(runs: dict[str, dict], every: int = 10) -> list[str]:
    steps = sorted(set().union(*runs.values())) or [0]
    shown = [s for s in steps if s == steps[0] or s % every == 0 or s == steps[-1]]
    lines = ["step " + "".join(f"{n:>14}" for n in runs)]
    for s in shown:
        lines.append(f"{s:>4} " + "".join(f"{r[s]:>14.6f}" if s in r else f"{'-':>14}" for r in runs.values()))
    return lines


def plot(runs: dict[str, dict], path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in runs.items():
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], label=name, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("lm loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--reference", required=True)
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--plot", default=None, help="write the loss curves to this PNG (needs matplotlib)")
    a = p.parse_args(argv)
    runs = {Path(r).stem: read(r) for r in a.runs}
    ref = read(a.reference)
    print("\n".join(table(runs)))
    lines = compare({n: r for n, r in runs.items() if n != Path(a.reference).stem}, ref, a.tol)
    print("\n".join(lines))
    if a.plot:
        plot(runs, a.plot)
    return 1 if lines[-1] == "FAILED" else 0


if __name__ == "__main__":
    sys.exit(main())
