"""The benchmark tool, ``python -m benchmarks``, on the CPU: its refusals name the fix; every bench with a CPU
mode runs ``--smoke`` through it, computing what one device computes; the results schema reads back what it
writes; ``problems`` lists the catalogue; the GPU suites hold every ``gpu``-marked test."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as tool
from benchmarks import gpu_checks, memory, schema
from benchmarks import simulate as sim
from benchmarks.catalogue import PROBLEMS

ROOT = Path(__file__).resolve().parents[1]
H, K = 2, 16                                    # the --smoke sizes of the benches (fp32 on the CPU)


def bench(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("argv,says", [
    (["run", "nosuch"], "run: unknown bench 'nosuch': choose one of matrix, ops"),
    (["run", "--problem", "nosuch"], "--problem: name one of single"),
    (["run", "--problem", "single"], "python -m benchmarks predict --problem single"),
    (["run", "ops", "--problem", "x2-gdn"], "the problem runs bench 'matrix', not 'ops'"),
    (["run", "ops", "--profile", "5"], "add --what layers"),
    (["run", "ops", "--graph", "kcp"], "python -m benchmarks run matrix --methods kcp-graph"),
    (["run", "ops", "--what", "layers", "--kcp-parts", "0"], "positive token counts"),
    (["run", "ops", "--memory-only", "--tokens", "1024", "2048"], "give one --tokens, --heads and --docs value"),
    (["run", "--problem", "memory", "--device", "cpu"], memory.NEEDS_GPU),
    (["predict", "host-time", "--smoke", "--peer"], "drop --peer with --smoke"),
    (["predict", "strategies", "--smoke", "--backends", "qla"], "drop it with --smoke"),
])
def test_refusals_name_the_fix(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        tool.main(argv)
    assert stop.value.code != 0 and says in f"{stop.value.code}{capsys.readouterr().err}"


def test_gpu_checks_refuse_before_anything_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_checks, "gpu_count", lambda: 0)
    for argv, says in ((["ops_w2", "ops_w3"], "unknown suite ops_w3: name suites from: layout_w4_block_gdn"),
                       (["--jobs", "0"], "--jobs 0: give a number of suites at a time"),
                       ([], "found no GPU (nvidia-smi -L): on a CPU run scripts/test.sh --all")):
        assert tool.main(["gpu-checks", *argv]) == 2 and says in capsys.readouterr().err
    assert tool.main(["nosuch"]) == 2 and "python -m benchmarks COMMAND" in capsys.readouterr().out


def test_problems_lists_the_catalogue_and_every_bench_answers_help(capsys):
    assert tool.main(["problems"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in lines] == [[n, p.command, p.bench] for n, p in PROBLEMS.items()]
    assert all(p.bench in tool.BENCHES[p.command] for p in PROBLEMS.values())
    for command, benches in tool.BENCHES.items():
        for name in benches:
            with pytest.raises(SystemExit) as stop:
                tool.main([command, name, "--help"])
            assert stop.value.code == 0 and f"python -m benchmarks {command} {name}" in capsys.readouterr().out


def test_schema_round_trip(tmp_path):
    """Rows written carry the provenance; the reader gives every column, of an old file too (its source from
    its name); it reads every file under benchmarks/results/."""
    path = tmp_path / "perdoc_predicted.csv"
    write = schema.Writer(str(path), "predicted")
    write(dict(level="ops", model="GDN", method="kcp", ms=1.5, extra="x"))
    (row,) = schema.read(path)
    assert row["ms"] == "1.5" and row["source"] == "predicted" and row["versions"].startswith("torch=")
    assert set(schema.COLUMNS + schema.PROVENANCE) <= set(row) and row["commit"] == schema.commit()
    old = tmp_path / "old_predicted.csv"
    old.write_text("level,model,ms\nops,KDA,2\n")
    assert [(r["model"], r["source"], r["gpu"]) for r in schema.read(old)] == [("KDA", "predicted", "")]
    with pytest.raises(ValueError):
        schema.Writer(None, "guessed")
    for f in (ROOT / "benchmarks" / "results").glob("*.csv"):
        assert all(r["source"] in ("measured", "predicted") for r in schema.read(f)), f


def _rows(run, path):
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return schema.read(path)


def test_run_ops_smoke_computes_the_one_device_function(tmp_path):
    """Every op and layer row at W = 2 computes what noCP computes (fp32 reference kernels): cp2hp's
    permutations and KCP's exchange are right; our layer rows name the op's pick."""
    path = tmp_path / "ops.csv"
    rows = _rows(bench("run", "ops", "--smoke", "--what", "ops", "layers", "--models", "GDN", "--docs", "varlen",
                       "--passes", "fwd+bwd", "--warmup", "0", "--iters", "1", "--csv", str(path)), path)
    timed = [r for r in rows if not r["note"].startswith("n/a")]
    assert {r["level"] for r in timed} == {"ops", "layers"} and len(timed) >= 8, rows
    assert all(float(r["err"]) < 1e-5 and float(r["ms"]) > 0 for r in timed), timed
    assert all(r["note"].startswith("strategy ") for r in timed if r["level"] == "layers" and r["method"] == "kcp")


def test_predict_strategies_smoke_sends_the_bytes_by_hand(tmp_path):
    """A row per layout and strategy; relay sends one state a rank edge and direction, gather one slot."""
    path = tmp_path / "sim.csv"
    rows = _rows(bench("predict", "strategies", "--smoke", "--models", "GDN", "--docs", "single", "--csv",
                       str(path)), path)
    assert {(r["layout"], r["strategy"]) for r in rows} == {
        (lay, s) for lay in ("contiguous", "zigzag", "zigzag_per_doc") for s in ("relay", "gather")}
    state, slot = H * K * K * 4, H * K * 2 * K * 4
    for r in rows:
        assert float(r["busy_ms"]) + float(r["idle_ms"]) == pytest.approx(float(r["pred_ms"])), r
        want = (1 if r["layout"] == "contiguous" else 2) * state if r["strategy"] == "relay" else 2 * slot
        assert r["sent_bytes"] == f"{want}/{want}", r


def test_run_matrix_smoke_every_method_is_the_same_function(tmp_path):
    """Measured over 2 gloo ranks: every method of every level within 1e-6 of the one-device run."""
    path = tmp_path / "measured.csv"
    rows = _rows(bench("run", "matrix", "--smoke", "--shapes", "qwen3-next", "--docs", "varlen", "--csv",
                       str(path)), path)
    timed = [r for r in rows if r["ms"]]
    assert timed and all(r["source"] == "measured" for r in rows)
    assert all(float(r["err"]) < 1e-6 for r in timed), [(r["level"], r["method"], r["err"]) for r in timed]
    assert {r["level"] for r in timed} == {"ops", "mixer", "block"}


@pytest.mark.parametrize("args,check", [
    (("predict", "matrix", "--shapes", "qwen3-next", "--docs", "varlen", "--levels", "ops", "mixer", "--methods",
      "noCP", "kcp", "kcp-foldloop", "kcp-ownstart", "kcp-whole"),       # and the ablations asked for by name
     lambda rows: {("ops", "kcp"), ("mixer", "kcp"), ("ops", "kcp-foldloop"), ("ops", "kcp-ownstart"),
                   ("ops", "kcp-whole")} <= {(r["level"], r["method"]) for r in rows}
     and all(r["source"] == "predicted" and not r["note"].startswith("error") for r in rows)),
    (("predict", "host-time", "--shapes", "qwen3-next", "--cp", "2"),
     lambda rows: [r["rank"] for r in rows] == ["0", "1"] and all(float(r["host_ms"]) > 0 for r in rows)),
    (("run", "conv"), lambda rows: [(r["layout"], float(r["err"])) for r in rows] ==
     [("contiguous", 0.0), ("zigzag_per_doc", 0.0)]),
    (("run", "convert"), lambda rows: len(rows) == 1 and 0 < float(rows[0]["kept"]) < 1),
], ids=["predict-matrix", "host-time", "conv", "convert"])
def test_smoke_runs_through_the_tool(args, check, tmp_path):
    path = tmp_path / "out.csv"
    rows = _rows(bench(*args, "--smoke", "--csv", str(path)), path)
    assert rows and check(rows), rows


def test_event_simulation_by_hand():
    """p2p: rank 1 resumes at 1 ms + alpha; all-gather: every rank leaves at the last arrival + (W - 1)
    (alpha + bytes / bw); a wait nobody answers is a deadlock."""
    ms = 1e-3
    ends, phase = sim.simulate([[("compute", ms), ("send", 1, 4096)], [("wait", 0), ("phase",), ("compute", 2 * ms)]],
                               alpha=0.5 * ms, bw=math.inf)
    assert ends == pytest.approx([ms, 3.5 * ms]) and phase == [None, pytest.approx(1.5 * ms)]
    tls = [[("compute", (r + 1) * ms), ("allgather", 1000), ("compute", r * ms), ("allgather", 0)] for r in range(3)]
    assert sim.simulate(tls, alpha=0.5 * ms, bw=1e6)[0] == pytest.approx([(3 + 2 * 1.5 + 2 + 2 * 0.5) * ms] * 3)
    with pytest.raises(RuntimeError, match="deadlock"):
        sim.simulate([[("allgather", 8)], [("compute", ms)]], alpha=ms, bw=1e9)


COVER = '''
import json, os
from _pytest.mark import KeywordMatcher
from _pytest.mark.expression import Expression
from benchmarks.gpu_checks import SUITES


def pytest_collection_modifyitems(config, items):
    """Each gpu-marked test: the suites whose paths and -k select it, as pytest would."""
    out = {}
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        rel, words = item.path.relative_to(config.rootpath).as_posix(), KeywordMatcher.from_item(item)
        out[item.nodeid] = []
        for s in SUITES:
            if s.name == "memory":
                continue
            a = list(s.args)
            k = a[a.index("-k") + 1] if "-k" in a else None
            paths = [x for i, x in enumerate(a) if not x.startswith("-") and (i == 0 or a[i - 1] != "-k")]
            if any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in paths) and (
                    k is None or Expression.compile(k).evaluate(words)):
                out[item.nodeid].append(s.name)
    with open(os.environ["KCP_COVER_OUT"], "w") as f:
        json.dump(out, f)
    items[:] = []
'''


def test_gpu_suites_hold_every_gpu_test(tmp_path):
    """Every test marked gpu is selected by a suite of benchmarks.gpu_checks.SUITES (a GPU test outside them
    would run only when someone remembers it); a suite left out leaves its tests reported."""
    (tmp_path / "kcp_gpu_cover.py").write_text(COVER)
    out = tmp_path / "cover.json"
    env = {**os.environ, "KCP_COVER_OUT": str(out), "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
                          "kcp_gpu_cover", "tests"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), run.stdout[-2000:] + run.stderr[-2000:]
    cover = json.loads(out.read_text())
    assert len(cover) > 50 and not [t for t, s in cover.items() if not s], [t for t, s in cover.items() if not s]
    # the negative control: without the suites that hold test_train_data_cuda.py its tests are uncovered
    alone = {t for t, s in cover.items() if set(s) <= {"documents", "documents_mlm"}}
    assert alone and all(t.startswith("tests/test_train_data_cuda.py") for t in alone), alone
