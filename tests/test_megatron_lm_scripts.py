"""The Megatron-LM scripts on the CPU. scripts/fetch_megatron_lm.sh: what it copies from a git
repository at a ref or from a directory, and its errors. scripts/device_megatron_lm.sh, walked through
with a stand-in torchrun that logs like Megatron: it runs the README's commands as they stand, the same
arguments through megatron_kcp.train, the one-token spec on a patched megatron-core copy, the fp32
recompute and PP runs, and its comparisons pass or fail; the time budget holds."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

from tests.test_megatron_lm import readme_commands

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATH = f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"


# ---- fetch_megatron_lm.sh ----

PRETRAIN = "import os\nfrom helpers import f\nimport model_provider\n"


def _git_repo(path):
    path.mkdir()
    for name, text in (("pretrain_gpt.py", "import os\nfrom helpers import f\n"), ("helpers.py", "def f(): pass\n"),
                       ("LICENSE", "license\n"), ("unused.py", "")):
        (path / name).write_text(text)
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(path)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "r0"], check=True)
    subprocess.run([*git, "branch", "core_r0.19.0"], check=True)
    (path / "pretrain_gpt.py").write_text(PRETRAIN)                  # main moves on: a new module
    (path / "model_provider.py").write_text("import helpers\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "r1"], check=True)
    return path


def _fetch(tmp_path, *args):
    env = {**os.environ, "MLM_DIR": str(tmp_path / "mlm"), "PATH": PATH}
    return subprocess.run(["bash", str(ROOT / "scripts" / "fetch_megatron_lm.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_fetch_copies_pretrain_gpt_and_what_it_imports_at_the_ref(tmp_path):
    repo = _git_repo(tmp_path / "Megatron-LM")
    done = _fetch(tmp_path, str(repo))                                  # default ref: core_r0.19.0
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "mlm").iterdir()) == ["LICENSE", "SOURCE", "helpers.py",
                                                                    "pretrain_gpt.py"]
    assert "core_r0.19.0" in (tmp_path / "mlm" / "SOURCE").read_text()
    assert _fetch(tmp_path, str(repo), "main").returncode == 0          # follows imports of imports
    assert (tmp_path / "mlm" / "pretrain_gpt.py").read_text() == PRETRAIN
    assert sorted(p.name for p in (tmp_path / "mlm").glob("*.py")) == ["helpers.py", "model_provider.py",
                                                                       "pretrain_gpt.py"]


def test_fetch_takes_the_release_tag_where_the_branch_is_missing(tmp_path):
    """A mirror of tags (no core_r0.19.0 branch): the default REF falls back to the tag core_v0.19.0; a REF
    given is taken as it is."""
    repo = _git_repo(tmp_path / "Megatron-LM")
    git = ["git", "-C", str(repo)]
    subprocess.run([*git, "tag", "core_v0.19.0", "core_r0.19.0"], check=True)
    subprocess.run([*git, "branch", "-q", "-D", "core_r0.19.0"], check=True)
    done = _fetch(tmp_path, str(repo))
    assert done.returncode == 0, done.stderr
    assert "core_v0.19.0" in (tmp_path / "mlm" / "SOURCE").read_text()
    assert not (tmp_path / "mlm" / "model_provider.py").exists()         # the tag's tree, not main's
    refused = _fetch(tmp_path, str(repo), "core_r0.19.0")
    assert refused.returncode == 1 and "core_r0.19.0 is not in" in refused.stderr


def test_fetch_from_a_directory_and_errors(tmp_path):
    src = tmp_path / "copy"
    src.mkdir()
    (src / "pretrain_gpt.py").write_text("import helpers\n")
    (src / "helpers.py").write_text("")
    assert _fetch(tmp_path, str(src)).returncode == 0
    assert "not a git checkout" in (tmp_path / "mlm" / "SOURCE").read_text()
    repo = _git_repo(tmp_path / "Megatron-LM")
    done = _fetch(tmp_path, str(repo), "core_r9.9.9")
    assert done.returncode == 1 and "core_r9.9.9 is not in" in done.stderr and "fetch origin" in done.stderr
    (src / "helpers.py").write_text("raise ImportError('needs megatron.post_training')\n")
    done = _fetch(tmp_path, str(src))
    assert done.returncode == 1 and "does not import here" in done.stderr and "post_training" in done.stderr
    done = _fetch(tmp_path, str(tmp_path / "nowhere"))
    assert done.returncode == 1 and "neither a git checkout" in done.stderr


# ---- device_megatron_lm.sh ----

STAND_IN = r'''#!PYTHON
"""torchrun stand-in: records the call and prints what pretrain_gpt.py / megatron_kcp.train would."""
import json, os, sys
argv = sys.argv[1:]
with open(os.environ["STAND_IN_CALLS"], "a") as f:
    f.write(json.dumps({"argv": argv, "pythonpath": os.environ.get("PYTHONPATH", "")}) + "\n")
def last(flag, default=None):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1] if flag in argv else default
i = len(argv) - 1 - argv[::-1].index("--spec")
spec = []
for a in argv[i + 1:]:
    if a.startswith("--"):
        break
    spec.append(a)
patched = any(os.path.isfile(os.path.join(p, "megatron/core/transformer/spec_utils.py"))
              and "default_spec" in open(os.path.join(p, "megatron/core/transformer/spec_utils.py")).read()
              for p in os.environ.get("PYTHONPATH", "").split(":") if p)
if spec == ["megatron_kcp_missing"]:
    sys.exit("ImportError: spec default_spec of megatron_kcp_missing: cannot import megatron_kcp_missing" if patched
             else "megatron_kcp_missing: logged, then the default GPT")
if len(spec) == 1 and not patched:
    sys.exit("ValueError: not enough values to unpack (expected 2, got 1)")
print("[megatron_kcp] KCP active: " + ("KCPKimiDeltaAttention (layer 1, " + spec[1].split(":")[1] + ")"
                                        if "kda" in spec[-1] else "KCPGatedDeltaNet (layer 1)"))
start = int(last("--ckpt-step", 0)) if "--load" in argv else 0
drift = 1.01 if os.environ.get("STAND_IN_DRIFT", "-") == last("--recompute-granularity") else 1.0
for step in range(start + 1, int(last("--train-iters")) + 1):
    loss = (10.0 / step if "--bf16" in argv else 9.0 / step) * drift
    print(f" [2026-11-23 10:00:00.000000] iteration {step:8d}/      20 | lm loss: {loss:.6E} | loss scale: 1.0 |")
'''


def _device_run(tmp_path, budget=500, drift=None, chains=None):
    repo = tmp_path / "repo"
    for d in ("scripts", "patches"):
        shutil.copytree(ROOT / d, repo / d)
    shutil.copy(ROOT / "README.md", repo)
    (repo / "tests").mkdir()
    (repo / "tests" / "fast_autotune.py").write_text("def enable(): pass\n")
    mlm = repo / ".mlm"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("")
    (mlm / "SOURCE").write_text("Megatron-LM core_r0.19.0 (stand-in)\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text(STAND_IN.replace("PYTHON", sys.executable, 1))
    (bin_dir / "torchrun").chmod(0o755)
    out, calls = tmp_path / "out", tmp_path / "calls.jsonl"
    env = {**os.environ, "OUT": str(out), "KCP_MLM_BUDGET": str(budget), "STAND_IN_CALLS": str(calls),
           "PATH": f"{bin_dir}:{PATH}"}
    for k in ("MEGATRON_LM", "KCP_MLM_CHAINS", "STAND_IN_DRIFT"):
        env.pop(k, None)
    if drift:
        env["STAND_IN_DRIFT"] = drift
    if chains:
        env["KCP_MLM_CHAINS"] = chains
    done = subprocess.run(["bash", "scripts/device_megatron_lm.sh"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)
    with tarfile.open(out / "evidence.tar.gz") as t:
        files = {pathlib.Path(m.name).name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}
    runs = [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []
    return done, files, runs, mlm


def test_device_script_runs_the_readme_and_compares(tmp_path):
    done, files, runs, mlm = _device_run(tmp_path)
    summary = files["summary.txt"]
    for name in ("gdn_mlm", "kda_mlm", "gdn_train", "kda_train", "gdn_patched", "gdn_ref", "kda_ref", "gdn_full",
                 "kda_full", "gdn_selective", "kda_selective", "gdn_pp2", "kda_pp2"):
        assert f"{name}: exit 0 after" in summary and f"{name}: exit 0" in summary, (name, summary)
    assert summary.count("KCP-active lines: 1") == 13 and "bad_spec: exit 1" in summary
    assert "bad_spec: stopped with its ImportError (patched): PASS" in summary
    assert "KCP active: KCPKimiDeltaAttention (layer 1, kda_gate_rank=32,kda_norm_eps=1e-6)" in summary
    for m in ("gdn", "kda"):
        assert "all runs within tolerance" in files[f"{m}_parity_mlm.txt"], files[f"{m}_parity_mlm.txt"]
        assert "all runs within tolerance" in files[f"{m}_parity_exact.txt"], files[f"{m}_parity_exact.txt"]
    assert "gdn_patched: steps 1-20" in files["gdn_parity_mlm.txt"]
    assert "gdn_pp2: steps 11-20" in files["gdn_parity_exact.txt"]
    # the README's commands as they stand, and the same arguments through megatron_kcp.train
    readme = [[a.replace("/opt/Megatron-LM", str(mlm)) for a in cmd] for cmd in readme_commands()]
    argvs = [r["argv"] for r in runs]
    assert readme[0] in argvs and readme[1] in argvs
    for cmd in readme[:2]:
        i = cmd.index(f"{mlm}/pretrain_gpt.py")
        assert cmd[:i] + ["-m", "megatron_kcp.train"] + cmd[i + 1:] in argvs
    patched = [r for r in runs if r["argv"][:len(readme[2])] == readme[2]]
    assert len(patched) == 2 and all(r["pythonpath"].startswith("/tmp/kcp-mcore-patched:") for r in patched)
    exact = [r["argv"] for r in runs if "--bf16" not in r["argv"]]
    assert len(exact) == 8 and sum("--recompute-granularity" in a for a in exact) == 4
    assert sum(a[a.index("--pipeline-model-parallel-size") + 1] == "2" for a in exact
               if "--pipeline-model-parallel-size" in a) == 2


def test_device_script_comparisons_can_fail(tmp_path):
    _, files, _, _ = _device_run(tmp_path, drift="selective", chains="gdn:ref,full,selective")
    assert "gdn_selective: steps 1-20 (20), max rel diff 1.00e-02" in files["gdn_parity_exact.txt"]
    assert "FAILED" in files["gdn_parity_exact.txt"] and "gdn_full" in files["gdn_parity_exact.txt"]


def test_device_script_time_budget(tmp_path):
    _, files, runs, _ = _device_run(tmp_path, budget=0)
    assert files["summary.txt"].count("not started (time budget)") == 14 and not runs
