"""The benchmark scripts on the CPU: bench_ops.py --smoke (rows, columns, CSV, bytes exchanged, outputs
agreeing across methods), the exchange model (monotone in W, one case by hand, --check) and plot.py."""
from __future__ import annotations

import csv
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
W, T, H, K = 2, 128, 2, 16                  # bench_ops.py --smoke sizes (fp32 on the CPU)


def _load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    path = out / "smoke.csv"
    run = subprocess.run([sys.executable, str(BENCH / "bench_ops.py"), "--smoke", "--what", "ops", "layers",
                          "--warmup", "0", "--iters", "1", "--csv", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(path, newline="") as f:
        return run.stdout, list(csv.DictReader(f)), path


def test_smoke_prints_and_writes_every_row(smoke):
    stdout, rows, path = smoke
    bench = _load("bench_ops")
    assert list(rows[0]) == list(bench.COLUMNS)
    assert "all rows:" in stdout and "x_cp2hp" in stdout and "CPU (smoke run" in stdout
    ops = {(r["model"], r["pass"], r["docs"], r["method"], r["layout"]) for r in rows if r["level"] == "ops"}
    methods = {("noCP", "-"), ("cp2hp", "zigzag"), ("kcp", "zigzag"), ("kcp", "contiguous")}
    assert ops == {(m, p, d, *x) for m in ("GDN", "KDA") for p in ("fwd", "fwd+bwd") for d in ("single", "varlen")
                   for x in methods}
    layers = {(r["model"], r["method"], r["W"]) for r in rows if r["level"] == "layers"}
    assert layers == {("GDN", "megatron", "1"), ("GDN", "noCP", "1"), ("GDN", "cp2hp", "2"), ("GDN", "kcp", "2"),
                      ("KDA", "noCP", "1"), ("KDA", "kcp", "2")}
    for r in rows:
        assert r["note"] == "", r
        assert float(r["ms"]) > 0 and float(r["eff"]) > 0, r
        # every method computes the single-device function (fp32 reference kernels): cp2hp's
        # permutations and KCP's exchange are right, and megatron's GDN matches ours
        assert float(r["err"]) < 1e-5, r
        if r["W"] == "2":
            assert math.isfinite(float(r["exchange_ms"])) and int(r["xchg_calls"]) > 0, r


def test_smoke_bytes_exchanged_match_hand_count(smoke):
    _, rows, _ = smoke
    got = {(r["model"], r["pass"], r["method"], r["layout"]): int(r["xchg_bytes"])
           for r in rows if r["level"] == "ops" and r["docs"] == "single" and r["W"] == "2"}
    state = H * K * (K + K) * 4                          # one fp32 [H | M] map per continuing piece
    tl = T // W
    for model, g in (("GDN", 1), ("KDA", K)):
        cp2hp_fwd = (W - 1) * tl * H * ((2 * K + K + g + 1) + K) * 4 // W     # [q|k|v|g|beta] out, o back
        for passes, pas in ((1, "fwd"), (2, "fwd+bwd")):
            assert got[model, pas, "kcp", "zigzag"] == passes * (W - 1) * 2 * state
            assert got[model, pas, "kcp", "contiguous"] == passes * (W - 1) * state
            assert got[model, pas, "cp2hp", "zigzag"] == passes * cp2hp_fwd


def test_plot_from_csv(smoke, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "ops.png"
    run = subprocess.run([sys.executable, str(BENCH / "plot.py"), str(smoke[2]), "-o", str(png)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert png.stat().st_size > 10_000


def test_exchange_model_by_hand():
    m = _load("exchange_model")
    link = m.Link("NVLink", 10e-6, 150e9)
    k = m.kcp_cost(2, m.Setup(heads=16, head_dim=128, slots=2, conv=1), link)
    state = 2 * 16 * 128 * 256 * 4                      # 2 slots of 16 heads x 128 x (128 + 128) fp32
    assert state == 4 * 2**20
    assert k["recv"] == 2 * state                        # forward and backward, from the one other rank
    assert k["t_ag"] == pytest.approx(2 * (10e-6 + state / 150e9))    # 2 x 37.96 us
    c = m.cp2hp_cost(2, m.Setup(heads=16, head_dim=128, tokens=32768, model="gdn"), link)
    shard = 16384 * 16                                   # T/W tokens x H heads on a rank
    b_in, b_out = (2 * 128 + 128 + 1) * 2 + 4, 128 * 2   # [q|k|v|beta] bf16 + fp32 g; o bf16
    assert c["recv"] == 2 * shard * (b_in + b_out) // 2  # forward and backward, half of each shard
    assert c["t"] == pytest.approx(2 * ((10e-6 + shard * b_in / 2 / 150e9) + (10e-6 + shard * b_out / 2 / 150e9)))
    assert m.cp2hp_cost(32, m.Setup(heads=16), link) is None        # 16 heads cannot go over 32 ranks


def test_exchange_model_table_is_monotone_in_w(capsys):
    m = _load("exchange_model")
    m.main([])
    lines = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert [int(ln[0]) for ln in lines] == [2**i for i in range(1, 11)]
    kcp_mib, kcp_ms = [float(ln[2]) for ln in lines], [float(ln[5]) for ln in lines]
    assert all(a < b for a, b in zip(kcp_mib, kcp_mib[1:])) and all(a < b for a, b in zip(kcp_ms, kcp_ms[1:]))
    assert [ln[6] for ln in lines[4:]] == ["n/a"] * 6      # W > H = 16: cp2hp cannot split the heads


def test_exchange_model_check_reads_the_benchmark_csv(smoke, capsys):
    m = _load("exchange_model")
    m.main(["--check", str(smoke[2])])
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if " single " in ln]
    assert len(rows) == 2 * 2 * 3                        # GDN, KDA x fwd, fwd+bwd x cp2hp, kcp x 2 layouts
    for r in rows:
        assert r[9] == r[10], r                          # measured bytes = the model's formula
