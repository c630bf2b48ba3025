"""scripts/device_train_checks.sh walked through on the CPU with a stand-in trainer: the runs, the
kill of the crash run once step 30 is logged, the restart from the last checkpoint, the time limit
and the packed evidence (the real trainer runs on the device only)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]

FAKE_LAUNCH = '''
import json, os, sys, time
a = sys.argv[1:]
def opt(name, default=None):
    return a[len(a) - 1 - a[::-1].index(name) + 1] if name in a else default
log, iters = opt("--kcp-log"), int(opt("--train-iters"))
save, load, every = opt("--save"), opt("--load"), int(opt("--save-interval", 10**9))
start = int(opt("--ckpt-step") or open(os.path.join(load, "latest")).read()) if load else 0
for step in range(start + 1, iters + 1):
    time.sleep(0.05)          # the script's killer polls every 0.25 s: steps 31-40 must outlast that
    with open(log, "a") as f:
        f.write(json.dumps({"step": step, "loss": 10.0 / step, "convert": os.environ.get("KCP_CONVERT"),
                            "graph": opt("--cuda-graph-impl")}) + "\\n")
    if save and step % every == 0:
        os.makedirs(save, exist_ok=True)
        open(os.path.join(save, "latest"), "w").write(str(step))
'''


def _run(tmp_path, budget, chains=None):
    repo = tmp_path / "repo"
    for d in ("scripts", "configs"):
        shutil.copytree(ROOT / d, repo / d)
    for f, text in (("megatron_kcp/__init__.py", ""), ("megatron_kcp/launch.py", FAKE_LAUNCH),
                    ("megatron_kcp/testing/__init__.py", ""),
                    ("megatron_kcp/testing/fast_autotune.py", "def enable(): pass\n")):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text(text)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "KCP_TRAIN_BUDGET": str(budget),
           "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("KCP_TRAIN_CHAINS", None)
    if chains:
        env["KCP_TRAIN_CHAINS"] = chains
    subprocess.run(["bash", "scripts/device_train_checks.sh"], cwd=repo, env=env, timeout=240,
                   capture_output=True, check=False)
    with tarfile.open(out / "evidence.tar.gz") as t:
        return {pathlib.Path(m.name).name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}


def test_training_checks_flow(tmp_path):
    files = _run(tmp_path, 600)
    summary = files["summary.txt"]
    for model in ("gdn", "kda"):
        for run in ("cp1", "dp1", "cp2", "resume", "restart", "fp32_cp1", "fp32_cp2"):
            assert f"{model} {run}: exit 0" in summary, summary
        assert f"{model} crash: exit 137" in summary, summary          # killed, not finished
        crash = [int(line.split('"step": ')[1].split(",")[0]) for line in files[f"{model}_crash.jsonl"].splitlines()]
        restart = files[f"{model}_restart.jsonl"].splitlines()
        assert 30 <= max(crash) < 40 and '"step": 21,' in restart[0] and '"step": 40,' in restart[-1]
        assert "all runs within tolerance" in files[f"{model}_parity.txt"]
        assert "all runs within tolerance" in files[f"{model}_parity_fp32.txt"]


def test_training_checks_chosen_chains(tmp_path):
    files = _run(tmp_path, 600, chains="kda:cp2,resume gdn:dp1")
    runs = sorted(line.split(":")[0] for line in files["summary.txt"].splitlines())
    assert runs == ["gdn dp1", "kda cp2", "kda resume"], files["summary.txt"]
    assert "kda_resume: steps 51-100" in files["kda_parity.txt"]


def test_training_checks_layout_conversion_runs(tmp_path):
    """The conversion's parity runs: CP = 2 with KCP_CONVERT=0 and =1, bf16 and fp32, each pair compared."""
    files = _run(tmp_path, 600, chains="gdn:keep,convert,fp32_keep,fp32_convert")
    for run, on in (("keep", "0"), ("convert", "1"), ("fp32_keep", "0"), ("fp32_convert", "1")):
        assert f"gdn {run}: exit 0" in files["summary.txt"], files["summary.txt"]
        assert f'"convert": "{on}"' in files[f"gdn_{run}.jsonl"].splitlines()[0]
    assert "gdn_convert: steps 1-100" in files["gdn_parity_convert.txt"]
    assert "gdn_fp32_convert: steps 1-100" in files["gdn_parity_convert_fp32.txt"]


def test_training_checks_cuda_graph_run(tmp_path):
    """The captured run: CP = 2 with Megatron's local CUDA graphs, compared with the eager cp2 run."""
    files = _run(tmp_path, 600, chains="gdn:cp2,graph")
    assert "gdn graph: exit 0" in files["summary.txt"], files["summary.txt"]
    assert '"graph": "local"' in files["gdn_graph.jsonl"].splitlines()[0]
    assert '"graph": null' in files["gdn_cp2.jsonl"].splitlines()[0]
    assert "gdn_graph: steps 1-100" in files["gdn_parity_graph.txt"]


def test_training_checks_time_budget(tmp_path):
    summary = _run(tmp_path, 0)["summary.txt"]
    assert summary.count("not started (time budget)") == 16, summary
