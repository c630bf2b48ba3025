"""The benchmark scripts on the CPU: bench_ops.py --smoke (rows, columns, CSV, bytes exchanged, outputs
agreeing across methods), --memory-only (the device script's command parses, the CPU is refused with
the reason, the table), --what profile, simulate.py (--smoke, and its event simulation on hand-made
timelines), host_time.py (--smoke), convert.py (--smoke, bytes by hand) and conv.py (--smoke)."""
from __future__ import annotations

import csv
import math
import os
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

from benchmarks import bench_ops, memory
from benchmarks import simulate as sim
from benchmarks.table import COLUMNS, Table

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
W, T, H, K = 2, 128, 2, 16                  # bench_ops.py --smoke sizes (fp32 on the CPU)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    path = out / "smoke.csv"
    run = subprocess.run([sys.executable, str(BENCH / "bench_ops.py"), "--smoke", "--what", "ops", "layers",
                          "--warmup", "0", "--iters", "1", "--profile", "2", "--graph", "kcp",
                          "--kcp-parts", "32", "--csv", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(path, newline="") as f:
        return run.stdout, list(csv.DictReader(f)), path


@pytest.mark.slow
def test_smoke_prints_and_writes_every_row(smoke):
    stdout, rows, path = smoke
    assert list(rows[0]) == list(COLUMNS)
    assert "all rows:" in stdout and "x_cp2hp" in stdout and "CPU (smoke run" in stdout
    ops = {(r["model"], r["pass"], r["docs"], r["method"], r["layout"]) for r in rows if r["level"] == "ops"}
    methods = {("noCP", "-"), ("cp2hp", "zigzag")} | {(m, lay) for m in ("kcp-relay", "kcp-gather")
                                                      for lay in ("contiguous", "zigzag", "zigzag_per_doc")}
    assert ops == {(m, p, d, *x) for m in ("GDN", "KDA") for p in ("fwd", "fwd+bwd") for d in ("single", "varlen")
                   for x in methods}
    layers = {(r["model"], r["docs"], r["method"], r["W"]) for r in rows if r["level"] == "layers"}
    assert layers == {(m, d, *x) for d in ("single", "varlen") for m, x in
                      [("GDN", ("megatron", "1")), ("GDN", ("noCP", "1")), ("GDN", ("cp2hp", "2")),
                       ("GDN", ("kcp", "2")), ("KDA", ("noCP", "1")), ("KDA", ("cp2hp", "2")), ("KDA", ("kcp", "2")),
                       ("GDN", ("kcp-graph", "2")), ("KDA", ("kcp-graph", "2")), ("GDN", ("kcp-parts32", "2")),
                       ("GDN", ("kcp-parts32-graph", "2"))]}
    for r in rows:
        if r["method"].endswith("-graph"):
            assert r["note"] == "n/a on the CPU: CUDA graphs", r
            continue
        megatron_gdn = r["model"] == "GDN" and r["method"] in ("megatron", "cp2hp")
        if r["level"] == "layers" and r["docs"] == "varlen" and megatron_gdn:
            assert r["note"].startswith("n/a on the CPU"), r      # megatron-core: packed sequences need fla
            continue
        ours = r["level"] == "layers" and (r["method"] == "noCP" or r["method"].startswith("kcp")
                                           or r["model"] == "KDA")
        assert r["note"].startswith("strategy ") if ours else r["note"] == "", r   # our op's pick, or nothing
        assert float(r["ms"]) > 0 and float(r["eff"]) > 0, r
        # every method computes the single-device function (fp32 reference kernels): cp2hp's
        # permutations and KCP's exchange are right, and megatron's GDN matches ours
        assert float(r["err"]) < 1e-5, r
        if r["W"] == "2":
            assert math.isfinite(float(r["exchange_ms"])) and int(r["xchg_calls"]) > 0, r


def test_smoke_bytes_exchanged_match_hand_count(smoke):
    """Rank 0's received bytes, one sequence at W=2. All-gather: one [H | M] slot a rank and direction
    in both layouts (zigzag: rank 1's two chunks are one segment). Relay: rank 0 gets one K x V state
    a direction in zigzag (chunk 3's, then chunk 0's gradient), in contiguous only the backward's."""
    _, rows, _ = smoke
    got = {(r["model"], r["pass"], r["method"], r["layout"]): int(r["xchg_bytes"])
           for r in rows if r["level"] == "ops" and r["docs"] == "single" and r["W"] == "2"}
    slot, state = H * K * (K + K) * 4, H * K * K * 4
    tl = T // W
    for model, g in (("GDN", 1), ("KDA", K)):
        cp2hp_fwd = (W - 1) * tl * H * ((2 * K + K + g + 1) + K) * 4 // W     # [q|k|v|g|beta] out, o back
        for passes, pas in ((1, "fwd"), (2, "fwd+bwd")):
            for layout in ("zigzag", "contiguous", "zigzag_per_doc"):
                assert got[model, pas, "kcp-gather", layout] == passes * (W - 1) * slot
            assert got[model, pas, "kcp-relay", "zigzag"] == passes * state
            assert got[model, pas, "kcp-relay", "contiguous"] == (passes - 1) * state
            assert got[model, pas, "cp2hp", "zigzag"] == passes * cp2hp_fwd


def test_layer_rows_of_megatron_core_compare_on_the_same_kernels():
    """At layer level megatron-core's cp2hp is measured against its own module at CP = 1 on the same
    kernels: fla's Triton (``megatron``) or fla handing the call to flash-qla (``megatron-qla``)."""
    table = Table(types.SimpleNamespace(head_dim=128, dtype="bfloat16"), None, False)
    case = dict(level="layers", model="GDN", tokens=32768, docs="single", heads=16, **{"pass": "fwd+bwd"})
    for method, w, ms in [("megatron", 1, 16.0), ("megatron-qla", 1, 11.0), ("noCP", 1, 14.0),
                          ("cp2hp", 2, 10.0), ("cp2hp-qla", 2, 5.5), ("kcp", 2, 8.0)]:
        table.add(dict(case, method=method, W=w, ms=ms))
    eff = {r["method"]: r["eff"] for r in table.rows}
    assert eff["cp2hp"] == 16.0 / 20 and eff["cp2hp-qla"] == 11.0 / 11 and eff["kcp"] == 14.0 / 16
    assert table.rows[-1]["x_cp2hp"] == 10.0 / 8
    # captured rows (--graph) against the captured rows of their peers, not the eager ones
    for method, w, ms in [("megatron-qla-graph", 1, 9.0), ("cp2hp-qla-graph", 2, 6.0), ("cp2hp-graph", 2, 7.0),
                          ("kcp-graph", 2, 5.0)]:
        table.add(dict(case, method=method, W=w, ms=ms))
    graph = {r["method"]: (r["eff"], r["x_cp2hp"]) for r in table.rows[-4:]}
    assert graph["cp2hp-qla-graph"][0] == 9.0 / 12 and math.isnan(graph["kcp-graph"][0])   # no noCP-graph row
    assert graph["cp2hp-graph"][1] == 1.0 and graph["kcp-graph"][1] == 7.0 / 5


def test_smoke_layer_rows_of_our_mixers_say_what_their_op_ran(smoke):
    """Our mixers' layer rows name the op's pick as the ``KCP active`` line does; megatron-core's none."""
    layers = [r for r in smoke[1] if r["level"] == "layers" and r["pass"] == "fwd+bwd"]
    ours = [r for r in layers if r["method"] == "noCP" or re.fullmatch(r"kcp(-parts\d+)?", r["method"])
            or (r["model"] == "KDA" and r["method"] == "cp2hp")]
    assert ours and all(r["note"].startswith("strategy ") and "core reference (PyTorch)" in r["note"]
                        for r in ours), [(r["model"], r["method"], r["note"]) for r in ours]
    assert all(r["note"].startswith("strategy cp2hp,") for r in ours if r["method"] == "cp2hp")   # KDA's, forced
    assert all(r["note"] == "" or r["note"].startswith("n/a") for r in layers if r not in ours), layers


def test_smoke_profiles_every_rank_of_the_layer_rows_named(smoke):
    """--profile: each rank prints its profile of one step of the --profile-methods layer rows (kcp by
    default), in rank order, after the row is timed; the op rows are not profiled."""
    heads = [line for line in smoke[0].splitlines() if line.startswith("== profile ")]
    assert [h.split(" W=2 rank ")[0] for h in heads] == [f"== profile layers kcp {m} H={H} T={T} {d}"
                                                         for m in ("GDN", "KDA") for d in ("single", "varlen")
                                                         for _ in range(W)], heads
    assert [h.split(" rank ")[1].split(":")[0] for h in heads] == ["0", "1"] * 4, heads
    assert all("kernels" in h and "launches" in h for h in heads), heads


def test_smoke_captures_the_layer_rows_named(smoke):
    """--graph kcp: a ``-graph`` row after each of our kcp layer rows (the default's and ``kcp-partsN``),
    which on the CPU says why it has no time."""
    layers = [(r["model"], r["docs"], r["method"], r["note"]) for r in smoke[1] if r["level"] == "layers"]
    for i, (model, docs, method, _) in enumerate(layers):
        if method in ("kcp", "kcp-parts32"):
            assert layers[i + 1] == (model, docs, f"{method}-graph", "n/a on the CPU: CUDA graphs"), layers
    assert [m for _, _, m, _ in layers if m.endswith("-graph")] == ["kcp-graph", "kcp-parts32-graph"] * 2 + \
        ["kcp-graph"] * 2, layers


def test_smoke_kcp_parts_rows_split_our_op_and_compute_the_same_function(smoke):
    """--kcp-parts 32 (GDN): our mixer with its op's segments split into parts of 32 tokens, the split named
    in ``note``, the output and input gradient those of CP = 1 (the parts chained by the all-gather's fold)."""
    rows = [r for r in smoke[1] if r["level"] == "layers" and r["method"] == "kcp-parts32"]
    assert [(r["model"], r["docs"]) for r in rows] == [("GDN", "single"), ("GDN", "varlen")], rows
    for r in rows:
        assert r["note"].endswith("segments split into parts of 32 tokens") and float(r["err"]) < 1e-5, r


@pytest.mark.slow
def test_profile_prints_the_kernel_tables():
    run = subprocess.run([sys.executable, str(BENCH / "bench_ops.py"), "--smoke", "--what", "profile",
                          "--models", "GDN", "--docs", "single", "--warmup", "1", "--layouts", "zigzag",
                          "--methods", "kcp-relay", "cp2hp"],
                         capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    heads = re.findall(r"^== GDN fwd\+bwd T=128 single H=2: (.*), 5 iterations, (rank \d)", run.stdout, re.M)
    assert heads == [("noCP", "rank 0"), ("kcp-relay zigzag W=2", "rank 0"), ("kcp-relay zigzag W=2", "rank 1"),
                     ("cp2hp zigzag W=2", "rank 0"), ("cp2hp zigzag W=2", "rank 1")], run.stdout[-2000:]
    assert run.stdout.count("Self CPU time total") == 5 and "all rows:" not in run.stdout


def _gpu_checks_memory_args() -> list[str]:
    """The arguments scripts/device_gpu_checks.sh gives bench_ops.py --memory-only."""
    script = (BENCH.parent / "scripts" / "device_gpu_checks.sh").read_text().replace("\\\n", " ")
    line = re.search(r"benchmarks/bench_ops\.py (--memory-only[^>\n]*)", script)
    assert line, "device_gpu_checks.sh no longer runs bench_ops.py --memory-only"
    return shlex.split(line.group(1))


def test_memory_only_parses_the_device_command():
    args = bench_ops.parse(_gpu_checks_memory_args())
    assert args.memory_only and args.cp == [4] and args.tokens == [32768] and args.heads == [16]
    assert args.layouts == ["contiguous", "zigzag"] and args.warmup == 1 and args.docs == ["single"]
    with pytest.raises(SystemExit):                      # one case per report
        bench_ops.parse(["--memory-only", "--tokens", "1024", "2048"])


def test_profile_refuses_what_it_cannot_profile(capsys):
    """--profile profiles layer rows: without --what layers, or naming no layer method, an early error."""
    assert bench_ops.parse(["--what", "layers", "--profile", "5", "--profile-methods", "cp2hp-qla"]).profile == 5
    for argv in (["--profile", "5"], ["--what", "layers", "--profile", "5", "--profile-methods", "kcp-relay"]):
        with pytest.raises(SystemExit):
            bench_ops.parse(argv)
    err = capsys.readouterr().err
    assert "add --what layers" in err and "invalid choice: 'kcp-relay'" in err


def test_kcp_parts_refuses_what_it_cannot_split(capsys):
    """--kcp-parts adds layer rows of positive part lengths: otherwise an early error naming the fix."""
    assert bench_ops.parse(["--what", "layers", "--kcp-parts", "2048", "4096"]).kcp_parts == [2048, 4096]
    for argv in (["--kcp-parts", "2048"], ["--what", "layers", "--kcp-parts", "0"]):
        with pytest.raises(SystemExit):
            bench_ops.parse(argv)
    err = capsys.readouterr().err
    assert "--kcp-parts adds layer rows: add --what layers" in err and "positive token counts" in err


def test_graph_refuses_what_it_cannot_capture(capsys):
    """--graph captures layer rows: without --what layers, or naming no layer method, an early error."""
    assert bench_ops.parse(["--what", "layers", "--graph", "cp2hp-qla", "kcp"]).graph == ["cp2hp-qla", "kcp"]
    for argv in (["--graph", "kcp"], ["--what", "layers", "--graph", "kcp-graph"]):
        with pytest.raises(SystemExit):
            bench_ops.parse(argv)
    err = capsys.readouterr().err
    assert "--graph captures layer rows: add --what layers" in err and "invalid choice: 'kcp-graph'" in err


def test_memory_only_refuses_the_cpu_and_says_why():
    """It reads CUDA's peak-memory counters of fla's kernels: no CPU run, but a clear early exit."""
    run = subprocess.run([sys.executable, str(BENCH / "bench_ops.py"), *_gpu_checks_memory_args(), "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.strip().endswith(memory.NEEDS_GPU), run.stderr[-2000:]
    assert "needs a GPU" in memory.NEEDS_GPU


def test_memory_table():
    out = memory.table({"GDN": 2637.0, "KDA": 4497.0}, [("GDN", 4, "contiguous", 661.2), ("KDA", 4, "zigzag", 1128.0)])
    assert out.splitlines() == [
        "model  W layout           peak MiB/rank  x single",
        "GDN    1 -                         2637     1.000",
        "KDA    1 -                         4497     1.000",
        "GDN    4 contiguous                 661     0.251",
        "KDA    4 zigzag                    1128     0.251"]


def test_simulate_smoke_rows_and_bytes(tmp_path):
    """simulate.py --smoke: a row per model, layout and strategy; the bytes each rank sends, by hand."""
    path = tmp_path / "sim.csv"
    run = subprocess.run([sys.executable, str(BENCH / "simulate.py"), "--smoke", "--docs", "single",
                          "--csv", str(path)],
                         capture_output=True, text=True, timeout=600, cwd=BENCH.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert {(r["model"], r["layout"], r["strategy"]) for r in rows} == {
        (m, lay, s) for m in ("GDN", "KDA") for lay in ("contiguous", "zigzag", "zigzag_per_doc")
        for s in ("relay", "gather")}
    state, slot = H * K * K * 4, H * K * 2 * K * 4      # fp32 [H, K, V] state; [H, K, V + K] gather slot (T=256 smoke)
    for r in rows:
        assert r["note"] == "", r
        assert 0 < float(r["pred_fwd_ms"]) < float(r["pred_ms"]) and float(r["eff"]) > 0, r
        assert float(r["busy_ms"]) + float(r["idle_ms"]) == pytest.approx(float(r["pred_ms"])), r
        # relay: one state forward and one gradient back per rank edge of the sequence; gather: one slot
        # per direction, sent to the W - 1 = 1 other rank
        edges = 1 if r["layout"] == "contiguous" else 2
        want = edges * state if r["strategy"] == "relay" else 2 * slot
        assert r["sent_bytes"] == f"{want}/{want}", r


MS = 1e-3


def test_comm_log_counts_what_an_uneven_all_to_all_brings_from_other_ranks():
    """CommLog.received_bytes: an uneven all-to-all (the layout conversion's) brings its output less the
    rows this rank sent itself; an even one (W - 1) / W of it."""
    import torch

    from benchmarks.timing import CommLog
    out, x = torch.zeros(8, 4), torch.zeros(8, 4)          # 16 bytes a row
    for args, rank, rows in [((out, x, [3, 5], [6, 2]), 0, 5), ((out, x, [3, 5], [6, 2]), 1, 3), ((out, x), 0, 4)]:
        log = CommLog()
        log.calls = [("all_to_all_single", None, args, {}, 2, rank)]
        assert log.received_bytes == rows * 16, (args[2:], rank)


def test_convert_smoke_counts_the_rows_that_leave(tmp_path):
    """convert.py --smoke: one row; the rows kept and the bytes sent match a count of the rows whose
    contiguous owner is another rank."""
    from benchmarks.common import cu_seqlens
    from megatron_kcp.parallel.relayout import positions
    path = tmp_path / "convert.csv"
    run = subprocess.run([sys.executable, str(BENCH / "convert.py"), "--smoke", "--csv", str(path)],
                         capture_output=True, text=True, timeout=600, cwd=BENCH.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(path, newline="") as f:
        (row,) = list(csv.DictReader(f))
    n, cu = 256, cu_seqlens("varlen", 256, pad=4)
    pos = [positions(cu, "zigzag_per_doc", 2, 1, r) for r in range(2)]
    leave = [int((p // (n // 2) != r).sum()) for r, p in enumerate(pos)]
    assert float(row["kept"]) == pytest.approx(min(1 - x / len(p) for x, p in zip(leave, pos)), abs=1e-4)
    assert float(row["sent_mib"]) == pytest.approx(max(leave) * 8 * 4 / 2**20, abs=1e-3)
    assert float(row["fwd_ms"]) > 0 and float(row["ms"]) > 0


def test_simulate_p2p_by_hand():
    """Rank 1 waits for what rank 0 sends after 1 ms of compute: it resumes at 1 ms + alpha."""
    ends, phase = sim.simulate([[("compute", MS), ("send", 1, 4096)], [("wait", 0), ("phase",), ("compute", 2 * MS)]],
                               alpha=0.5 * MS, bw=math.inf)
    assert ends == pytest.approx([MS, 3.5 * MS]) and phase == [None, pytest.approx(1.5 * MS)]
    # messages of a pair arrive in send order, each after alpha + bytes / bw; a late wait does not stall
    ends, _ = sim.simulate([[("compute", MS), ("send", 1, 0), ("compute", MS), ("send", 1, 1000)],
                            [("wait", 0), ("compute", 0.1 * MS), ("wait", 0), ("compute", 5 * MS), ("wait", 2)],
                            [("send", 1, 0)]], alpha=0.5 * MS, bw=1e6)
    assert ends == pytest.approx([2 * MS, (2 + 0.5 + 1 + 5) * MS, 0])


def test_simulate_allgather_by_hand():
    """Every rank leaves the k-th all-gather at the last arrival + (W - 1)(alpha + bytes / bw)."""
    tls = [[("compute", (r + 1) * MS), ("allgather", 1000), ("compute", r * MS), ("allgather", 0)] for r in range(3)]
    ends, _ = sim.simulate(tls, alpha=0.5 * MS, bw=1e6)
    assert ends == pytest.approx([(3 + 2 * 1.5 + 2 + 2 * 0.5) * MS] * 3)


def test_simulate_deadlock_raises():
    with pytest.raises(RuntimeError, match="deadlock.*rank 0 at \\('wait', 1\\)"):
        sim.simulate([[("wait", 1), ("send", 1, 8)], [("wait", 0), ("send", 0, 8)]], alpha=MS, bw=1e9)
    with pytest.raises(RuntimeError, match="deadlock"):         # an all-gather that one rank never joins
        sim.simulate([[("allgather", 8)], [("compute", MS)]], alpha=MS, bw=1e9)


def test_perdoc_smoke_writes_every_method(tmp_path):
    """perdoc.py --smoke: one pack at op and mixer level, every method a row with the predicted label."""
    path = tmp_path / "perdoc.csv"
    run = subprocess.run([sys.executable, str(BENCH / "perdoc.py"), "--smoke", "--shapes", "qwen3-next", "--docs",
                          "varlen", "--levels", "ops", "mixer", "--csv", str(path)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = list(csv.DictReader(path.open()))
    assert all(r["source"] == "predicted" and not r["note"].startswith("error") for r in rows), rows
    methods = {(r["level"], r["method"]) for r in rows}
    assert {("ops", m) for m in ("noCP", "cp2hp", "kcp-noconvert", "kcp-unpipelined", "kcp")} <= methods
    assert ("mixer", "kcp") in methods


def test_perdoc_measured_smoke_runs_every_method_as_the_same_function(tmp_path):
    """perdoc_measured.py --smoke (2 gloo ranks): every method of every level a measured row that computes
    what the one-device run computes; Megatron-LM dev's block moves the hidden states around each of its
    three linear layers, ours once around the run."""
    path = tmp_path / "measured.csv"
    run = subprocess.run([sys.executable, str(BENCH / "perdoc_measured.py"), "--smoke", "--csv", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = list(csv.DictReader(path.open()))
    assert all(r["source"] == "measured" for r in rows), rows
    cpu_na = {(r["level"], r["method"], r["model"]) for r in rows if r["note"].startswith("n/a on the CPU")}
    assert cpu_na == {("mixer", "cp2hp", "GDN"), ("block", "cp2hp", "GDN")}, cpu_na
    timed = [r for r in rows if r["ms"]]
    assert all(float(r["err"]) < 1e-6 for r in timed), [(r["level"], r["method"], r["err"]) for r in timed]
    modules = {(lv, m) for lv in ("mixer", "block") for m in ("noCP", "mlm-chunkwise", "kcp-noconvert", "kcp")}
    for model in ("GDN", "KDA"):
        for docs in ("single", "varlen"):
            got = {(r["level"], r["method"]) for r in timed if r["model"] == model and r["docs"] == docs}
            assert len([m for level, m in got if level == "ops"]) == 7 and modules <= got, got   # flash-qla: GPU
    note = {(r["model"], r["docs"], r["level"], r["method"]): r["note"] for r in timed}
    assert note["GDN", "varlen", "block", "mlm-chunkwise"].endswith("6 hidden-state all-to-alls a forward")
    block = note["GDN", "varlen", "block", "kcp"]
    assert block.startswith("contiguous") and block.endswith("; 2 hidden-state all-to-alls a forward"), block
    assert note["KDA", "varlen", "mixer", "kcp-noconvert"] == "0 hidden-state all-to-alls a forward"


def test_perdoc_measured_times_the_conversion_by_name(tmp_path):
    """--methods kcp-convert: our op converting its inputs where the cost model would not (one document)."""
    path = tmp_path / "measured.csv"
    run = subprocess.run([sys.executable, str(BENCH / "perdoc_measured.py"), "--smoke", "--shapes", "kimi-linear",
                          "--docs", "single", "--levels", "ops", "--methods", "kcp", "kcp-convert", "--csv",
                          str(path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    note = {r["method"]: r["note"] for r in csv.DictReader(path.open()) if r["ms"]}
    assert "contiguous layout" not in note["kcp"] and "in the contiguous layout" in note["kcp-convert"], note


def test_perdoc_measured_feeds_the_contiguous_layout_by_name(tmp_path):
    """--methods kcp-contiguous: the default fed the same documents contiguous, right at every level (its
    err against the one-device rows of that layout), with no all-to-all in (the block's one out remains)."""
    path = tmp_path / "measured.csv"
    run = subprocess.run([sys.executable, str(BENCH / "perdoc_measured.py"), "--smoke", "--shapes", "qwen3-next",
                          "--docs", "varlen", "--methods", "kcp", "kcp-contiguous", "--csv", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {(r["level"], r["method"]): r for r in csv.DictReader(path.open())}
    for level in ("ops", "mixer", "block"):
        row = rows[level, "kcp-contiguous"]
        assert row["layout"] == "contiguous" and float(row["err"]) < 1e-5, row
    assert rows["mixer", "kcp-contiguous"]["note"].endswith("0 hidden-state all-to-alls a forward")
    assert rows["block", "kcp-contiguous"]["note"].endswith("1 hidden-state all-to-alls a forward")


def test_perdoc_measured_profiles_every_rank():
    """--profile: each rank prints its profile of the named method's step, in rank order."""
    run = subprocess.run([sys.executable, str(BENCH / "perdoc_measured.py"), "--smoke", "--shapes", "qwen3-next",
                          "--docs", "single", "--levels", "ops", "--methods", "kcp", "--profile", "3"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    heads = [line for line in run.stdout.splitlines() if line.startswith("== profile ops kcp GDN")]
    assert [h.split(" rank ")[1].split(":")[0] for h in heads] == ["0", "1"], run.stdout[-2000:]
    assert all("kernels" in h and "launches" in h for h in heads), heads


def test_perdoc_measured_marks_a_row_that_misses_the_one_device_run():
    """A measured row over the error bound says so first in its note, with each result's error."""
    import torch
    from benchmarks import perdoc_measured as pm
    rows = []
    c = pm.Case.__new__(pm.Case)
    c.b = types.SimpleNamespace(max_over_ranks=lambda v: v, measure=lambda step: (1.0, 0.0), rank=0, W=2,
                                args=types.SimpleNamespace(profile=0))
    c.write, c.rows, c.base, c.ref_note = rows.append, {}, {}, ""
    y = torch.ones(4)
    c.timed("mixer", "kcp", 2, None, [3 * y, y], [y, y], "contiguous")
    c.timed("mixer", "kcp-noconvert", 2, None, [y, y], [y, y], "zigzag")
    assert rows[0]["note"] == "WRONG: err over 0.05 (y 2.0e+00, dx 0.0e+00); contiguous", rows[0]
    assert rows[1]["note"] == "zigzag" and rows[1]["err"] == 0.0, rows[1]
    c.ref_note = "err against fla's CP call"        # where one GPU cannot hold the pack
    c.timed("ops", "kcp", 2, None, [y], [y], "gather")
    assert rows[2]["note"] == "gather; err against fla's CP call", rows[2]


def _worker_one_gpu_too_small(rank, W, port, args, shapes):
    """perdoc_measured's worker with fla's call refusing the whole pack at all heads, as one GPU does
    with a sequence too long for it (cp2hp's call, on a head shard, still runs)."""
    import torch

    from benchmarks import ops
    from benchmarks import perdoc_measured as pm
    whole, heads = ops.chunk_kernel, {s.H for s in shapes.values()}

    def chunk_kernel(model, device):
        kernel = whole(model, device)

        def refusing(q, *rest):
            if q.shape[1] in args.tokens and q.shape[2] in heads:
                raise torch.OutOfMemoryError("CUDA out of memory (the test's stand-in)")
            return kernel(q, *rest)
        return refusing
    ops.chunk_kernel = chunk_kernel
    pm.worker(rank, W, port, args, shapes)


def test_perdoc_measured_reads_a_pack_one_gpu_cannot_hold_against_fla_cp(tmp_path):
    """Where one GPU cannot run the pack, the pack is held as each layout's rows of a rank, every op row
    reads against fla's CP call, gathered into host memory, and the noCP row records the failure without
    trying the whole pack again."""
    from benchmarks import perdoc_measured as pm
    from benchmarks.common import spawn
    path = tmp_path / "measured.csv"
    args, W, shapes = pm.parse(["--smoke", "--shapes", "qwen3-next", "--docs", "single", "--levels", "ops",
                                "--methods", "noCP", "cp2hp", "fla-cp", "kcp", "--csv", str(path)])
    spawn(_worker_one_gpu_too_small, W, args, shapes)
    rows = {r["method"]: r for r in csv.DictReader(path.open())}
    assert rows["noCP"]["note"].startswith("error: OutOfMemoryError: one GPU cannot hold the pack"), rows["noCP"]
    for m in ("cp2hp", "fla-cp", "kcp"):
        assert float(rows[m]["err"]) < 1e-6, rows[m]
        assert rows[m]["note"].endswith("err against fla's CP call (one GPU: out of memory)"), rows[m]


def test_host_time_smoke_writes_every_rank(tmp_path):
    """host_time.py --smoke: one row per rank with the step and host times (no kernels or graph on the CPU),
    and with --cprofile each rank's costliest host functions in us."""
    path = tmp_path / "host.csv"
    run = subprocess.run([sys.executable, str(BENCH / "host_time.py"), "--smoke", "--shapes", "qwen3-next",
                          "--cp", "2", "--cprofile", "3", "--csv", str(path)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = list(csv.DictReader(path.open()))
    assert [r["rank"] for r in rows] == ["0", "1"], rows
    assert all(float(r["step_ms"]) > 0 and float(r["host_ms"]) > 0 for r in rows), rows
    profiles = [p.split("\n") for p in run.stdout.split("== qwen3-next T=")[1:]]
    assert len(profiles) == 2, run.stdout[-2000:]
    for lines in profiles:
        top = lines[lines.index("-- by time inside") + 2].split()      # the step itself: its own us, then inside
        assert lines[1].endswith("(profiled: the host is slower than unprofiled)") and int(top[2]) > 1000, lines


def test_host_time_peer_refuses_the_cpu_smoke():
    """--peer times fla's kernels: with --smoke it stops at the parse, naming the fix."""
    run = subprocess.run([sys.executable, str(BENCH / "host_time.py"), "--smoke", "--peer"], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 2 and "drop --peer with --smoke" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_device_perdoc_walks_every_stage_on_the_cpu(tmp_path):
    """scripts/device_perdoc.sh with --smoke: every stage runs and writes its CSV."""
    env = {**os.environ, "OUT": str(tmp_path), "KCP_PERDOC_EXTRA": "--smoke",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in (tmp_path / "log.txt").read_text().splitlines() if ": exit " in line]
    assert len(lines) == 27 and all(line.endswith(" s") and ": exit 0 " in line for line in lines), lines
    for name, processes in (("split", 4), ("single", 15), ("single-scale", 3), ("perdoc128k", 2), ("scale", 2),
                            ("kda32k", 1)):
        rows = (tmp_path / f"{name}.csv").read_text().splitlines()
        assert rows[0].startswith(("model,", "level,")) and rows.count(rows[0]) == 1, name    # one header
        assert len(rows) > processes, name
    assert (tmp_path / "tcache.tar.xz").is_file()     # the kernel cache for the next run
    assert len(list(tmp_path.iterdir())) <= 8        # what comes back from a device call's $OUT


def test_device_perdoc_starts_no_case_past_its_deadline(tmp_path):
    """KCP_PERDOC_UNTIL (a device call's end) in the past: every case is named as not started, none runs."""
    env = {**os.environ, "OUT": str(tmp_path), "KCP_PERDOC_STAGES": "x2-kda", "KCP_PERDOC_UNTIL": "1",
           "KCP_PERDOC_DOCS": "varlen varlen100", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "log.txt").read_text().splitlines() == [
        f"perdoc_x2 kimi-linear 32768 {d}: not started (KCP_PERDOC_UNTIL)" for d in ("varlen", "varlen100")]
    assert not (tmp_path / "perdoc_x2.csv").exists()
    (tmp_path / "log.txt").unlink()       # the measured stages at other lengths: a case per length and count
    run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")],
                         env={**env, "KCP_PERDOC_TOKENS": "32768 131072"}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "log.txt").read_text().splitlines() == [
        f"perdoc_x2 kimi-linear {T} {d}: not started (KCP_PERDOC_UNTIL)"
        for T in (32768, 131072) for d in ("varlen", "varlen100")]
    (tmp_path / "log.txt").unlink()
    env["KCP_PERDOC_UNTIL"] = "soon"
    run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "epoch seconds" in run.stderr, run.stderr
    # the predicted stages: a case per shape and document count where KCP_PERDOC_DOCS is set, in stage order
    env.update(KCP_PERDOC_STAGES="perdoc128k scale kda", KCP_PERDOC_UNTIL="1")
    run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "log.txt").read_text().splitlines() == [
        f"{stage} {sh} {d}: not started (KCP_PERDOC_UNTIL)"
        for stage, shapes in (("perdoc128k", ("qwen3-next", "kimi-linear")), ("scale", ("qwen3-next", "kimi-linear")),
                              ("kda32k", ("kimi-linear",)))
        for sh in shapes for d in ("varlen", "varlen100")]
    env.update(KCP_PERDOC_UNTIL="1", KCP_PERDOC_JOBS="two")
    run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "number of jobs" in run.stderr, run.stderr
    for bad, says in ({"KCP_PERDOC_JOBS": "1", "KCP_PERDOC_CP": "4,8"}, "CP sizes separated by spaces"), \
            ({"KCP_PERDOC_CP": "4 8", "KCP_PERDOC_DOCS": "varlen 100"}, "use single, varlen, varlen100"):
        env.update(bad)
        run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and says in run.stderr, run.stderr


@pytest.mark.slow
def test_device_perdoc_walks_the_measured_stages_on_the_cpu(tmp_path):
    """The two-GPU stages of scripts/device_perdoc.sh with --smoke (two gloo ranks): a process per case,
    each writing its measured rows, the cases spread over two jobs side by side (KCP_PERDOC_JOBS)."""
    env = {**os.environ, "OUT": str(tmp_path), "KCP_PERDOC_EXTRA": "--smoke", "KCP_PERDOC_JOBS": "2",
           "KCP_PERDOC_STAGES": "x2-gdn x2-kda x2-single",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(BENCH.parent / "scripts" / "device_perdoc.sh")], env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = [line for line in (tmp_path / "log.txt").read_text().splitlines() if ": exit " in line]
    assert len(lines) == 16 and all(": exit 0 " in line for line in lines), lines
    for name in ("perdoc_x2", "single_x2"):
        rows = list(csv.DictReader((tmp_path / f"{name}.csv").open()))
        assert rows and all(r["source"] == "measured" for r in rows), name
        text = (tmp_path / f"{name}.csv").read_text().splitlines()
        assert text.count(text[0]) == 1, name          # the jobs' rows appended under one header
    assert len(list(tmp_path.iterdir())) <= 8


def test_conv_smoke_writes_a_row_per_layout(tmp_path):
    """conv.py --smoke: the reference conv of each rank's plan, one row per layout, in its columns."""
    path = tmp_path / "conv.csv"
    run = subprocess.run([sys.executable, str(BENCH / "conv.py"), "--smoke", "--csv", str(path)],
                         capture_output=True, text=True, timeout=300, cwd=BENCH.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["layout"], r["backend"]) for r in rows] == [("contiguous", "reference"), ("zigzag_per_doc", "reference")]
    assert all(float(r["ms"]) > 0 and float(r["err"]) == 0 for r in rows)
