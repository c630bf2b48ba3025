"""The results schema: one row per (level, model, case, W, method, layout, pass), with where it was made.

``COLUMNS`` are the tables' columns; ``PROVENANCE`` says where a row comes from: ``source`` (measured |
predicted), ``commit`` (the checkout's, ``+`` where it had changes), ``gpu``, ``versions`` (torch, triton,
fla, megatron-core, flash-qla where importable) and ``date`` (UTC). A bench with columns of its own (the
conv's, the host-time split's) writes them first and the provenance after them. :func:`read` reads every
result file under ``benchmarks/results/``, those written before the provenance columns existed too: a
missing column reads as ``""``, ``source`` from the file's name (``*_predicted.csv``) where absent.
"""
from __future__ import annotations

import csv
import datetime
import functools
import math
import os
import subprocess
from importlib import metadata
from pathlib import Path

COLUMNS = ("level", "model", "pass", "tokens", "docs", "heads", "W", "method", "layout", "ms", "eff", "x_cp2hp",
           "peak_mib", "xchg_bytes", "xchg_calls", "exchange_ms", "err", "note", "head_dim", "dtype")
PROVENANCE = ("source", "commit", "gpu", "versions", "date")
KEY = ("level", "model", "pass", "tokens", "docs", "heads", "W", "method", "layout")   # one case, one method
PACKAGES = ("torch", "triton", "fla-core", "megatron-core", "flash-qla")
ROOT = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def commit() -> str:
    """The checkout's commit, ``+`` where its tracked files have changes; ``""`` outside git."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+" if head and git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def versions() -> str:
    """``name=version`` of :data:`PACKAGES` installed, space-separated."""
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name}={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return " ".join(out)


def gpu() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def provenance(source: str) -> dict:
    """The provenance columns of a row made now (``source``: measured | predicted)."""
    if source not in ("measured", "predicted"):
        raise ValueError(f"source {source!r}: measured or predicted")
    return dict(source=source, commit=commit(), gpu=gpu(), versions=versions(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"))


class Writer:
    """Rows appended to the CSV at ``path`` (none where ``path`` is None) as they finish, so that a run cut
    short keeps them: its header first, each row with the provenance of ``source``."""

    def __init__(self, path: str | None, source: str, columns=COLUMNS):
        self.path, self.columns = path, [c for c in columns if c not in PROVENANCE] + list(PROVENANCE)
        self.meta = provenance(source)
        if path:
            with open(path, "w", newline="") as f:
                csv.DictWriter(f, self.columns).writeheader()

    def __call__(self, row: dict) -> None:
        if self.path:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns, extrasaction="ignore").writerow({**self.meta, **row})


def read(path, text: str | None = None) -> list[dict]:
    """The rows of a result file (or of ``text``, its contents at another commit), every column of
    :data:`COLUMNS` and :data:`PROVENANCE` present."""
    if text is None:
        with open(path, newline="") as f:
            text = f.read()
    rows = list(csv.DictReader(text.splitlines()))
    source = "predicted" if "predicted" in os.path.basename(str(path)) else "measured"
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k is not None}
        full = {c: r.get(c, "") or "" for c in (*COLUMNS, *PROVENANCE)}
        full.update({k: v for k, v in r.items() if k not in full})
        full["source"] = full["source"] or source
        out.append(full)
    return out


def number(x) -> float:
    """A cell as a float (``nan`` where empty or not a number)."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan
