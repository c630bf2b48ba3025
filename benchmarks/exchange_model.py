"""Cost model of KCP's exchange beside megatron-core's cp2hp all-to-all, W = 2 .. 1024.

    python benchmarks/exchange_model.py                      # the table (per layer, fwd+bwd)
    python benchmarks/exchange_model.py --check ops.csv      # beside bench_ops.py's measurements
    python benchmarks/exchange_model.py --check ops.csv --fit   # NVLink fitted to them, then the table

Per layer and direction (forward [H | M], backward [dH | M^T]), every rank all-gathers one fp32
map per continuing piece ("slot": 2 in Megatron's zigzag layout, 1 in contiguous):
``state = H * K * (K + V) * 4`` bytes per slot, so a rank receives ``(W - 1) * slots * state``.
With the short conv, the layer also all-gathers each piece's last ``conv - 1`` tokens of q|k|v
(bf16) forward and their gradients backward. A ring all-gather of ``b`` bytes per rank takes
``(W - 1) * (alpha + b / bw)``. The fold is ``slots * W - 1`` steps on the slowest rank (every
zigzag rank folds 2W - 1 maps over its two pieces; contiguous: W - 1), each H heads of a
K x K @ K x V fp32 product, ``max(flops / F, bytes / HBM)``, plus one kernel launch per slot.

cp2hp (op level, as bench_ops.py's cp2hp rows): one all-to-all of [q|k|v|beta] (2K + V + 1 bf16
values per head and token) with the fp32 gate (1 value for GDN, K for KDA), and one of o (V bf16)
forward, the same two backward. Each rank holds T/W tokens and sends (W - 1) / W of them:
``(W - 1) * (alpha + shard / W / bw)`` per all-to-all. It needs H divisible by W (n/a beyond).

Links: within a node of --gpus-per-node GPUs, NVLink (H200: alpha ~10 us, ~150 GB/s effective
per direction, both flags); a collective spanning nodes is modelled at the network's alpha and
bandwidth for every step (the slowest hop paces a ring). Both are assumptions, not measurements:
``--check`` puts the model beside the measured times.
"""
from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass

MiB = 2**20


@dataclass(frozen=True)
class Link:
    name: str
    alpha: float          # seconds per message
    bw: float             # bytes per second, per direction


@dataclass(frozen=True)
class Setup:
    heads: int = 16
    head_dim: int = 128           # K = V
    tokens: int = 1048576
    model: str = "gdn"
    slots: int = 2
    conv: int = 4
    dtype_bytes: int = 2
    flops: float = 150e12         # fp32 (TF32x3) product throughput for the fold
    hbm: float = 4.0e12           # bytes/s the fold reads its maps at
    launch: float = 5e-6          # one fold kernel launch


def state_bytes(H: int, K: int, V: int) -> int:
    """One fp32 map [H | M] (or [dH | M^T]) of H heads: K x (V + K) each."""
    return H * K * (K + V) * 4


def allgather_time(W: int, bytes_per_rank: float, link: Link) -> float:
    return (W - 1) * (link.alpha + bytes_per_rank / link.bw)


def alltoall_time(W: int, shard_bytes: float, link: Link) -> float:
    """Pairwise all-to-all: W - 1 steps, each moving a 1/W block of the rank's shard."""
    return (W - 1) * (link.alpha + shard_bytes / W / link.bw)


def link_for(W: int, gpus_per_node: int, nvlink: Link, network: Link) -> Link:
    return nvlink if W <= gpus_per_node else network


def kcp_cost(W: int, s: Setup, link: Link) -> dict:
    """Bytes a rank receives and seconds, per layer, forward + backward."""
    K = V = s.head_dim
    state = s.slots * state_bytes(s.heads, K, V)
    halo = s.slots * (s.conv - 1) * s.heads * (2 * K + V) * s.dtype_bytes      # q|k|v tails
    recv = 2 * (W - 1) * (state + halo)
    t_ag = 2 * allgather_time(W, state, link) + (2 * allgather_time(W, halo, link) if s.conv > 1 else 0.0)
    step = max(2 * s.heads * K * K * V / s.flops, state_bytes(s.heads, K, V) / s.hbm)
    t_fold = 2 * (s.slots * s.launch + (s.slots * W - 1) * step)
    return dict(recv=recv, t_ag=t_ag, t_fold=t_fold)


def cp2hp_bytes(model: str, K: int, V: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """Bytes per head and token of the two all-to-alls: [q|k|v|beta] with the fp32 gate, and o."""
    gate = K if model.lower() == "kda" else 1
    return (2 * K + V + 1) * dtype_bytes + 4 * gate, V * dtype_bytes


def cp2hp_cost(W: int, s: Setup, link: Link) -> dict | None:
    if s.heads % W:
        return None
    K = V = s.head_dim
    shard = s.tokens // W * s.heads                   # head-tokens a rank holds
    b_in, b_out = cp2hp_bytes(s.model, K, V, s.dtype_bytes)
    recv = 2 * (W - 1) * shard * (b_in + b_out) // W
    t = 2 * (alltoall_time(W, shard * b_in, link) + alltoall_time(W, shard * b_out, link))
    return dict(recv=recv, t=t)


def table(s: Setup, nvlink: Link, network: Link, gpus_per_node: int, max_w: int = 1024) -> list[dict]:
    rows = []
    W = 2
    while W <= max_w:
        link = link_for(W, gpus_per_node, nvlink, network)
        rows.append(dict(W=W, link=link.name, kcp=kcp_cost(W, s, link), cp2hp=cp2hp_cost(W, s, link)))
        W *= 2
    return rows


def print_table(s: Setup, nvlink: Link, network: Link, gpus_per_node: int):
    print(f"KCP exchange vs cp2hp per layer, fwd+bwd: {s.model.upper()}, H={s.heads}, K=V={s.head_dim}, "
          f"T={s.tokens}, slots={s.slots}, conv={s.conv}\n"
          f"assumed: {nvlink.name} alpha={nvlink.alpha * 1e6:.0f} us bw={nvlink.bw / 1e9:.0f} GB/s within "
          f"{gpus_per_node} GPUs; {network.name} alpha={network.alpha * 1e6:.0f} us bw={network.bw / 1e9:.0f} GB/s "
          f"beyond; fold {s.flops / 1e12:.0f} TFLOP/s, {s.hbm / 1e12:.1f} TB/s, {s.launch * 1e6:.0f} us/launch")
    print(f"{'W':>5} {'link':8} {'KCP MiB':>9} {'KCP ag ms':>10} {'fold ms':>8} {'KCP ms':>8} "
          f"{'cp2hp MiB':>10} {'cp2hp ms':>9} {'cp2hp/KCP':>10}")
    for r in table(s, nvlink, network, gpus_per_node):
        k, c = r["kcp"], r["cp2hp"]
        t_k = k["t_ag"] + k["t_fold"]
        tail = (f"{c['recv'] / MiB:10.1f} {c['t'] * 1e3:9.3f} {c['t'] / t_k:10.1f}" if c
                else f"{'n/a (W > H)':>10} {'-':>9} {'-':>10}")
        print(f"{r['W']:5d} {r['link']:8} {k['recv'] / MiB:9.2f} {k['t_ag'] * 1e3:10.3f} {k['t_fold'] * 1e3:8.3f} "
              f"{t_k * 1e3:8.3f} {tail}")


def _f(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def measured_rows(paths: list[str]) -> list[dict]:
    """bench_ops.py's op-level CP rows that carry a measured exchange."""
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += [r for r in csv.DictReader(f)
                     if r["level"] == "ops" and r["method"] in ("kcp-gather", "fla-cp", "cp2hp")
                     and r["layout"] in ("contiguous", "zigzag")
                     and math.isfinite(_f(r.get("exchange_ms")))]
    return rows


def fit_link(rows: list[dict]) -> Link:
    """Least-squares alpha and bw of ``ms = calls * (W - 1) * alpha + bytes / bw`` over the rows."""
    xs = [(int(_f(r["xchg_calls"])) * (int(r["W"]) - 1), _f(r["xchg_bytes"])) for r in rows]
    ys = [_f(r["exchange_ms"]) * 1e-3 for r in rows]
    a11, a12, a22 = (sum(x[i] * x[j] for x in xs) for i, j in ((0, 0), (0, 1), (1, 1)))
    b1, b2 = sum(x[0] * y for x, y in zip(xs, ys)), sum(x[1] * y for x, y in zip(xs, ys))
    det = a11 * a22 - a12 * a12
    if len(rows) < 2 or det <= 0:
        raise SystemExit("--fit needs measured rows of at least two sizes")
    alpha, inv_bw = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
    if alpha <= 0 or inv_bw <= 0:
        raise SystemExit(f"--fit: no physical fit (alpha {alpha * 1e6:.1f} us, 1/bw {inv_bw:.3g} s/B): "
                         "measure more sizes")
    return Link("NVLink", alpha, 1 / inv_bw)


def check(paths: list[str], nvlink: Link):
    """Model beside bench_ops.py's measured exchange (the collectives of one pass, replayed alone):
    bytes from the formulas, time = calls * (W - 1) * alpha + measured bytes / bw."""
    rows = measured_rows(paths)
    print(f"model vs measured exchange, {' '.join(paths)}: {nvlink.name} alpha={nvlink.alpha * 1e6:.0f} us, "
          f"bw={nvlink.bw / 1e9:.0f} GB/s (bytes received per rank per layer, one pass)")
    print(f"{'model':5} {'pass':7} {'T':>7} {'docs':6} {'H':>3} {'W':>2} {'method':7} {'layout':10} {'calls':>5} "
          f"{'MiB meas':>9} {'MiB model':>9} {'ms meas':>8} {'ms model':>8} {'meas/model':>10}")
    for r in rows:
        W, H, T, calls = int(r["W"]), int(r["heads"]), int(r["tokens"]), int(_f(r["xchg_calls"]))
        K, dtype_bytes = int(r["head_dim"]), 2 if r["dtype"] == "bfloat16" else 4
        passes = 2 if r["pass"] == "fwd+bwd" else 1
        if r["method"] == "cp2hp":
            b_in, b_out = cp2hp_bytes(r["model"], K, K, dtype_bytes)
            model_bytes = passes * (W - 1) * (T // W) * H * (b_in + b_out) // W
        else:
            # zigzag: a front and a back slot, but at W=2 rank 1's two chunks are one segment
            slots = 2 if r["layout"] == "zigzag" and W > 2 else 1
            model_bytes = passes * (W - 1) * slots * state_bytes(H, K, K)
        meas_bytes = _f(r["xchg_bytes"])
        model_ms = (calls * (W - 1) * nvlink.alpha + meas_bytes / nvlink.bw) * 1e3
        meas_ms = _f(r["exchange_ms"])
        print(f"{r['model']:5} {r['pass']:7} {T:7d} {r['docs']:6} {H:3d} {W:2d} {r['method']:7} {r['layout']:10} "
              f"{calls:5d} {meas_bytes / MiB:9.3f} {model_bytes / MiB:9.3f} {meas_ms:8.3f} {model_ms:8.3f} "
              f"{meas_ms / model_ms:10.2f}")
    if not rows:
        print("(no CP rows with an exchange time in this CSV)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    d = Setup()
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="K = V")
    p.add_argument("--tokens", type=int, default=d.tokens, help="total tokens T (cp2hp's volume scales with T/W)")
    p.add_argument("--model", choices=["gdn", "kda"], default=d.model)
    p.add_argument("--slots", type=int, default=d.slots, help="continuing pieces per rank: 2 zigzag, 1 contiguous")
    p.add_argument("--conv", type=int, default=d.conv, help="short conv kernel size (1: no halo)")
    p.add_argument("--alpha-us", type=float, default=10.0, help="NVLink latency per message")
    p.add_argument("--bw-gbs", type=float, default=150.0, help="NVLink effective GB/s per direction")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--net-alpha-us", type=float, default=20.0, help="inter-node latency per message")
    p.add_argument("--net-bw-gbs", type=float, default=40.0, help="inter-node GB/s per GPU (400 Gb/s NIC, effective)")
    p.add_argument("--fold-tflops", type=float, default=d.flops / 1e12)
    p.add_argument("--hbm-tbs", type=float, default=d.hbm / 1e12)
    p.add_argument("--check", metavar="CSV", nargs="+", help="bench_ops.py CSVs: model beside the measured exchange")
    p.add_argument("--fit", action="store_true",
                   help="with --check: NVLink alpha and bw fitted to the measured rows (least squares), then the table")
    a = p.parse_args(argv)
    nvlink = Link("NVLink", a.alpha_us * 1e-6, a.bw_gbs * 1e9)
    network = Link("network", a.net_alpha_us * 1e-6, a.net_bw_gbs * 1e9)
    if a.fit:
        if not a.check:
            p.error("--fit fits the link to measured rows: give them with --check CSV")
        rows = measured_rows(a.check)
        nvlink = fit_link(rows)
        print(f"NVLink fitted to the {len(rows)} measured rows: alpha={nvlink.alpha * 1e6:.0f} us, "
              f"bw={nvlink.bw / 1e9:.0f} GB/s")
    if a.check:
        check(a.check, nvlink)
        if not a.fit:
            return
        print()
    s = Setup(heads=a.heads, head_dim=a.head_dim, tokens=a.tokens, model=a.model, slots=a.slots, conv=a.conv,
              flops=a.fold_tflops * 1e12, hbm=a.hbm_tbs * 1e12)
    print_table(s, nvlink, network, a.gpus_per_node)


if __name__ == "__main__":
    main()
