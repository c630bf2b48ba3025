"""The entry scripts walked through dry: scripts/train_multi_node.sbatch under stand-in `srun` and
`scontrol` (no slurm needed), scripts/train_single_node.sh and scripts/run.sh. Each node's torchrun
command comes from the launcher's --dry-run. scripts/device.sh under a stand-in `python`: its arguments to
gpu-checks, its caches, a TERM passed on; benchmarks.gpu_checks' evidence archive, whole or cut short; and
scripts/device_cache.sh's save."""
from __future__ import annotations

import json
import os
import pathlib
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

SRUN = r'''#!/usr/bin/env bash
# stand-in srun: one task per node (SLURM_NNODES of them, in parallel), each with its SLURM_NODEID
echo "$*" > "$STANDIN_LOG/srun_args"
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done      # srun's own options
pids=()
for ((n = 0; n < SLURM_NNODES; n++)); do
  SLURM_NODEID=$n SLURM_PROCID=$n "$@" > "$STANDIN_LOG/node$n.out" 2> "$STANDIN_LOG/node$n.err" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
'''

SCONTROL = r'''#!/usr/bin/env bash
# stand-in scontrol: `scontrol show hostnames LIST` for the list node[01-02]
[ "$1 $2" = "show hostnames" ] || { echo "stand-in scontrol: only 'show hostnames'" >&2; exit 1; }
echo "$3" > "$STANDIN_LOG/nodelist"
printf 'node01\nnode02\n'
'''

STUB_LAUNCH = '''import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "node": os.environ.get("SLURM_NODEID")}))
'''


def _executable(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _venv(tmp_path, python=None) -> pathlib.Path:
    """A stand-in for the checkout's .venv (KCP_VENV): env.sh finds bin/python and sources bin/activate,
    which puts a `python` running this test's interpreter (or ``python``, a script) first on PATH."""
    venv = tmp_path / "venv"
    _executable(venv / "bin" / "python", python or f'#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} "$@"\n')
    (venv / "bin" / "activate").write_text(f'export PATH={shlex.quote(str(venv / "bin"))}:"$PATH"\n')
    return venv


def _env(tmp_path, venv, **extra) -> dict:
    log = tmp_path / "log"
    log.mkdir(exist_ok=True)
    slurm = tmp_path / "slurm"
    _executable(slurm / "srun", SRUN)
    _executable(slurm / "scontrol", SCONTROL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "KCP_", "MASTER_"))
           and k not in ("MEGATRON_LM", "NPROC_PER_NODE")}
    env.update(PATH=f"{slurm}:{os.environ['PATH']}", KCP_VENV=str(venv), STANDIN_LOG=str(log),
               PYTHONWARNINGS="ignore", SLURM_NNODES="2", SLURM_JOB_NODELIST="node[01-02]")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _node_commands(log: pathlib.Path, nodes: int = 2) -> list[list[str]]:
    out = []
    for n in range(nodes):
        lines = (log / f"node{n}.out").read_text().strip().splitlines()
        assert lines, (log / f"node{n}.err").read_text()[-3000:]
        out.append(shlex.split(lines[-1]))
    return out


def _sbatch(tmp_path, env, *args, cwd=ROOT, script=None):
    """Runs the sbatch script as slurm does: a copy in a spool directory, started in the submit directory."""
    spool = tmp_path / "spool" / "job42"
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copy(script or ROOT / "scripts" / "train_multi_node.sbatch", spool / "slurm_script")
    return subprocess.run(["bash", str(spool / "slurm_script"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_multi_node_sbatch_dry(tmp_path):
    """Under sbatch the script's own path is slurm's spool copy: it finds the checkout as the submit
    directory, reads 'h100:4' GPUs per node, and every node runs the launcher, whose --dry-run shows the
    torchrun it would start: its node rank, the rendezvous on the first node, the sizes."""
    env = _env(tmp_path, _venv(tmp_path), SLURM_SUBMIT_DIR=ROOT, SLURM_GPUS_PER_NODE="h100:4", KCP_DRY_RUN=1)
    done = _sbatch(tmp_path, env, "configs/tiny-gdn.json", "--cp", "4", "--", "--train-iters", "7")
    assert done.returncode == 0, done.stderr[-3000:]
    log = tmp_path / "log"
    assert (log / "nodelist").read_text().strip() == "node[01-02]"
    assert "--kill-on-bad-exit=1" in (log / "srun_args").read_text()
    for node, cmd in enumerate(_node_commands(log)):
        assert cmd[:6] == ["torchrun", "--nnodes=2", "--nproc-per-node=4", f"--node-rank={node}",
                           "--rdzv-backend=c10d", "--rdzv-endpoint=node01:29500"], cmd
        assert cmd[6:8] == ["-m", "megatron_kcp.train"]
        assert cmd[cmd.index("--context-parallel-size") + 1] == "4"
        assert cmd[cmd.index("--global-batch-size") + 1] == "2"          # 8 GPUs / CP 4
        assert cmd[cmd.index("--train-iters") + 1] == "7"


def test_multi_node_sbatch_arguments(tmp_path):
    """With a stand-in launcher (a checkout named by KCP_ROOT, submitted from elsewhere): the preset
    path is made absolute, GPUs per node come from SLURM_GPUS_ON_NODE, MASTER_ADDR/PORT are kept, the
    user's options follow the script's (so they win) and the trainer's arguments stay last."""
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "scripts", checkout / "scripts")
    (checkout / "megatron_kcp").mkdir()
    (checkout / "megatron_kcp" / "__init__.py").write_text("")
    (checkout / "megatron_kcp" / "launch.py").write_text(STUB_LAUNCH)
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / "my.json").write_text("{}")
    env = _env(tmp_path, _venv(tmp_path), KCP_ROOT=checkout, SLURM_SUBMIT_DIR=submit, SLURM_GPUS_ON_NODE=2,
               SLURM_GPUS_PER_NODE="h100:8", MASTER_ADDR="head", MASTER_PORT=29600)
    done = _sbatch(tmp_path, env, "my.json", "--cp", "2", "--nproc-per-node", "1", "--", "--lr", "1e-4", cwd=submit)
    assert done.returncode == 0, done.stderr[-3000:]
    for node in range(2):
        got = json.loads((tmp_path / "log" / f"node{node}.out").read_text())
        assert got["node"] == str(node) and got["cwd"] == str(checkout.resolve())
        assert got["argv"] == [str(submit.resolve() / "my.json"), "--node-rank", str(node), "--nnodes", "2",
                               "--nproc-per-node", "2", "--master-addr", "head", "--master-port", "29600",
                               "--cp", "2", "--nproc-per-node", "1", "--", "--lr", "1e-4"]


@pytest.mark.parametrize("args,env,match", [
    ((), {}, "usage: sbatch --nodes N scripts/train_multi_node.sbatch PRESET.json"),
    (("configs/tiny-gdn.json",), {"SLURM_SUBMIT_DIR": "/"}, "cannot find the megatron_kcp checkout: sbatch from the "
                                                            "checkout, or set KCP_ROOT"),
    (("configs/tiny-gdn.json",), {"KCP_ROOT": "/"}, "KCP_ROOT=/ is not a megatron_kcp checkout"),
    (("configs/tiny-gdn.json",), {"SLURM_SUBMIT_DIR": ROOT, "SLURM_GPUS_PER_NODE": "h100:x"},
     "cannot read the GPUs per node from 'x': set NPROC_PER_NODE"),
    (("configs/tiny-gdn.json",), {"SLURM_SUBMIT_DIR": ROOT, "SLURM_NNODES": ""}, "SLURM_NNODES is not set: submit"),
])
def test_multi_node_sbatch_errors(args, env, match, tmp_path):
    """Mistakes stop before any node starts, in one line (exit 2)."""
    done = _sbatch(tmp_path, _env(tmp_path, _venv(tmp_path), **env), *args, cwd=tmp_path)
    assert done.returncode == 2 and match in done.stderr, done.stderr
    assert not (tmp_path / "log" / "srun_args").exists()


def test_single_node_usage_without_preset():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "train_single_node.sh")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("usage: scripts/train_single_node.sh PRESET.json")
    assert "tiny-gdn.json" in done.stderr and "unbound variable" not in done.stderr


def test_single_node_dry(tmp_path):
    """The pip-only trainer unless MEGATRON_LM is set, as its header says; the preset may be relative to the
    caller's directory."""
    (tmp_path / "here.json").write_text((ROOT / "configs" / "tiny-kda.json").read_text())
    env = _env(tmp_path, _venv(tmp_path), NPROC_PER_NODE=2)      # SLURM_NNODES=2 too: ignored by this script
    done = subprocess.run(["bash", str(ROOT / "scripts" / "train_single_node.sh"), "here.json", "--cp", "2",
                           "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    cmd = shlex.split(done.stdout.strip().splitlines()[-1])
    assert cmd[:6] == ["torchrun", "--nnodes=1", "--nproc-per-node=2", "--master-port=29500", "-m",
                       "megatron_kcp.train"], cmd
    assert cmd[cmd.index("--spec") + 2] == "kda_hybrid_layer_spec"


def test_run_sh_passes_steps_to_the_cpu_demo(tmp_path):
    """Without GPUs, STEPS=N reaches the demo as --steps N (after it, the user's arguments, which win)."""
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "scripts", checkout / "scripts")
    log = tmp_path / "calls"
    python = ('#!/usr/bin/env bash\n'          # no GPUs; record every other call
              'if [ "$1" = -c ]; then echo 0; else echo "$*" >> ' + shlex.quote(str(log)) + '; fi\n')
    env = _env(tmp_path, _venv(tmp_path, python), STEPS=3)
    done = subprocess.run(["bash", "scripts/run.sh", "--cp", "4"], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["-m megatron_kcp.demo --model gdn --steps 3 --cp 4",
                                            "-m megatron_kcp.demo --model kda --steps 3 --cp 4"]
    del env["STEPS"]
    log.unlink()
    subprocess.run(["bash", "scripts/run.sh"], cwd=checkout, env=env, check=True, timeout=60)
    assert log.read_text().splitlines()[0] == "-m megatron_kcp.demo --model gdn --steps 5"


DEVICE = ROOT / "scripts" / "device.sh"
STANDIN_PYTHON = r"""#!/usr/bin/env bash
# stand-in python: records its arguments; waits for TERM where $STANDIN/hold exists, else exits 3
echo "$*" > "$STANDIN/args"
[ -e "$STANDIN/hold" ] || exit 3
trap 'echo cut > "$STANDIN/cut"; exit 124' TERM
touch "$STANDIN/started"
sleep 60 & wait
"""


def _device(tmp_path):
    """A checkout with scripts/, a stand-in python first on PATH, the caches under tmp_path: (repo, env, OUT)."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    shutil.copytree(ROOT / "scripts", repo / "scripts", ignore=shutil.ignore_patterns("tuning"))
    _executable(bin_dir / "python", STANDIN_PYTHON)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCP_")}
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), STANDIN=str(tmp_path),
               KCP_CACHE_ROOT=str(tmp_path / "cache"))     # not the machine's caches in /tmp
    return repo, env, tmp_path / "out"


def test_device_sh_runs_gpu_checks_between_the_caches(tmp_path):
    """scripts/device.sh passes its arguments to python -m benchmarks gpu-checks, exits with its status and
    saves both caches into $OUT."""
    repo, env, out = _device(tmp_path)
    done = subprocess.run(["bash", "scripts/device.sh", "ops_w1", "--jobs", "2"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert (tmp_path / "args").read_text().split() == ["-m", "benchmarks", "gpu-checks", "ops_w1", "--jobs", "2"]
    assert sorted(p.name for p in out.iterdir()) == ["tcache-fast.tar.xz", "tcache.tar.xz"]


def test_device_sh_cut_short_passes_the_term_on_and_saves_the_caches(tmp_path):
    import time
    repo, env, out = _device(tmp_path)
    (tmp_path / "hold").touch()
    run = subprocess.Popen(["bash", "scripts/device.sh"], cwd=repo, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.1)
    run.terminate()
    assert run.wait(timeout=60) == 124, run.stderr.read()
    assert (tmp_path / "cut").exists() and (out / "tcache.tar.xz").exists()


DRIVER = r"""
import sys, types
from benchmarks import gpu_checks
out, stand = sys.argv[1:]
def suite(name, script):
    return types.SimpleNamespace(name=name, env={}, command=lambda: ["bash", "-c", script])
sys.exit(gpu_checks.Run([
    suite("ops_w1", f'echo case >> "$KCP_EVIDENCE_DIR/cases.txt"; echo ran; [ ! -e {stand}/fail ]'),
    suite("graph", f"for _ in $(seq 600); do [ -e {stand}/release ] && exit 0; sleep 0.1; done")], out, 2, 120)())
"""


def _gpu_checks(tmp_path):
    """benchmarks.gpu_checks.Run over two stand-in suites (ops_w1 fails where $STANDIN/fail exists, graph waits
    for $STANDIN/release): the Popen and $OUT."""
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(out), str(tmp_path)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True), out


def _evidence(out) -> dict[str, str]:
    import tarfile
    with tarfile.open(out / "evidence.tar.gz") as t:
        return {pathlib.Path(m.name).name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}


@pytest.mark.parametrize("fail,status", [(False, 0), (True, 1)])
def test_gpu_checks_pack_their_evidence_and_exit_with_the_suites_status(fail, status, tmp_path):
    """The logs, versions, summary and the tests' own evidence leave as one archive, $OUT's only file; the exit
    status is 1 when one suite failed though the other passed."""
    (tmp_path / "release").touch()
    if fail:
        (tmp_path / "fail").touch()
    run, out = _gpu_checks(tmp_path)
    assert run.wait(timeout=120) == status, run.stderr.read()
    files = _evidence(out)
    assert {"ops_w1.log", "graph.log", "summary.txt", "versions.txt", "cases.txt"} <= set(files), sorted(files)
    assert f"ops_w1: exit {int(fail)}" in files["summary.txt"] and "graph: exit 0" in files["summary.txt"]
    assert [p.name for p in out.iterdir()] == ["evidence.tar.gz"]


def test_gpu_checks_cut_short_keep_what_ran(tmp_path):
    """Stopped by a time limit's TERM (twice, as from its group and a wrapper) while a suite runs: exit 124,
    the archive holds every log so far and the summary names the suite cut."""
    import signal
    import time
    run, out = _gpu_checks(tmp_path)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:      # ops_w1 done, graph waiting
            if (out / "evidence.tar.gz").exists() and "ops_w1: exit 0" in _evidence(out).get("summary.txt", ""):
                break
            time.sleep(0.2)
        run.send_signal(signal.SIGTERM)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=30) == 124, run.stderr.read()
    finally:
        (tmp_path / "release").touch()     # the stand-in graph suite ends
        run.kill()
    files = _evidence(out)
    assert "ops_w1: exit 0" in files["summary.txt"] and "graph: cut short after" in files["summary.txt"], files
    assert {"graph.log", "ops_w1.log"} <= set(files) and [p.name for p in out.iterdir()] == ["evidence.tar.gz"]


def test_device_cache_saves_the_seed_where_a_run_added_nothing(tmp_path):
    """scripts/device_cache.sh's save_cache: the seed archive itself where the run added no file (no
    second xz pass over tilelang's kernels), a fresh archive with the new file where it added one."""
    import tarfile
    seed_dir, repo = tmp_path / "seed", tmp_path / "repo"
    for f in ("triton/ab/k.autotune.json", "triton/ab/k.cubin", "tilelang/k1/kernel.so"):
        (seed_dir / f).parent.mkdir(parents=True, exist_ok=True)
        (seed_dir / f).write_text(f)
    (repo / ".tcache").mkdir(parents=True)
    subprocess.run(["tar", "-cJf", str(repo / ".tcache" / "tcache.tar.xz"), "triton/ab/k.autotune.json", "tilelang"],
                   cwd=seed_dir, check=True, env={**os.environ, "XZ_OPT": "-0"})   # not save_cache's xz's bytes
    shutil.copy(ROOT / "scripts" / "device_cache.sh", repo / "device_cache.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KCP_")}
    env.update(KCP_CACHE_ROOT=str(tmp_path / "cache"))

    def run(out, add=""):
        subprocess.run(["bash", "-c", f"source device_cache.sh && {add} save_cache"], cwd=repo, check=True,
                       env={**env, "OUT": str(out)}, timeout=60)
        with tarfile.open(out / "tcache.tar.xz") as t:
            return sorted(m.name for m in t.getmembers() if m.isfile())
    assert run(tmp_path / "out1") == ["tilelang/k1/kernel.so", "triton/ab/k.autotune.json"]
    assert os.listdir(tmp_path / "out1") == ["tcache.tar.xz"]          # published whole: no part left
    assert (tmp_path / "out1" / "tcache.tar.xz").read_bytes() == (repo / ".tcache" / "tcache.tar.xz").read_bytes()
    new = 'mkdir -p "$TILELANG_CACHE_DIR/k2" && echo k2 > "$TILELANG_CACHE_DIR/k2/kernel.so" &&'
    assert run(tmp_path / "out2", new) == ["tilelang/k1/kernel.so", "tilelang/k2/kernel.so",
                                           "triton/ab/k.autotune.json"]
    # a pack that fails (a run cut short, a full disk) publishes nothing: no truncated archive to seed from
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "tar").write_text('#!/bin/bash\n[[ " $* " == *" -cJf "* ]] && { echo partial > "$2"; exit 1; }\n'
                              f'exec {shutil.which("tar")} "$@"\n')
    (shim / "tar").chmod(0o755)
    out3 = tmp_path / "out3"
    subprocess.run(["bash", "-c", f"source device_cache.sh && {new} save_cache"], cwd=repo,
                   env={**env, "OUT": str(out3), "PATH": f"{shim}:{os.environ['PATH']}"}, timeout=60)
    assert os.listdir(out3) == []
