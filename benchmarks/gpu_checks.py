"""The GPU test suites in one run (``python -m benchmarks gpu-checks [SUITE ...]``; ``scripts/device.sh`` seeds
and saves the compile caches around it).

Every ``gpu``-marked test is in one suite (``tests/test_benchmarks.py`` checks it). The suites run side by side
(``--jobs``, default three a GPU: more run one GPU out of memory), longest first, each under ``--timeout``
seconds, with the tests' cheap autotuning (``KCP_FAST_AUTOTUNE=1``); the ranks of a CP test get a GPU each over
NCCL where there are enough, else share GPUs over gloo, and the 2-GPU suites (train_*, nccl) skip on one GPU.
The tests read a part of a suite from the environment, which a suite passes on: ``KCP_GPU_MODELS`` (gdn,kda),
``KCP_GPU_DTYPES`` (bfloat16,float32), ``KCP_GPU_LAYOUTS`` cut the op suites, ``KCP_GPU_DOCS`` the layout ones.
Logs, the versions and ``summary.txt`` (a line a suite: its exit status and seconds) travel as one archive,
``$OUT/evidence.tar.gz`` (OUT: default /tmp/out), packed again as each suite ends; cut short (TERM or INT),
the run packs what the suites wrote and names the ones it cut. Exit status: 0 when every suite exited 0, 1
when one did not, 124 when cut short, 2 when the input is refused before anything runs.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

LAYOUT, OPS, LAYERS = "tests/layers/test_layout.py", "tests/ops/test_kcp_cuda.py", "tests/layers/test_layers_cuda.py"
QLA = {"KCP_GPU_BACKEND": "qla", "KCP_GPU_MODELS": "gdn"}        # flash-qla's core (Hopper on, bf16)
# the W = 4 layout tests in two parts that run side by side: a case of 300 documents takes minutes
DOCS, CONTROL = {"KCP_GPU_DOCS": "1,300"}, {"KCP_GPU_DOCS": "control"}


@dataclass(frozen=True)
class Suite:
    name: str
    args: tuple[str, ...]                       # pytest's (the memory report: the tool's own command)
    env: dict = field(default_factory=dict)

    def command(self) -> list[str]:
        if self.name == "memory":               # peak memory is per process: sharing the GPU does not change it
            return [sys.executable, "-m", "benchmarks", *self.args]
        return [sys.executable, "-m", "pytest", "-q", "-s", "-rA", "-p", "no:cacheprovider", *self.args]


SUITES = (   # longest first: the W = 4 layout tests, then the training steps
    Suite("layout_w4_block_gdn", (LAYOUT, "-k", "at_4_ranks_on_gpu and block-gdn"), DOCS),
    Suite("layout_w4_block_gdn_control", (LAYOUT, "-k", "at_4_ranks_on_gpu and block-gdn"), CONTROL),
    Suite("layout_w4_block_kda", (LAYOUT, "-k", "at_4_ranks_on_gpu and block-kda"), DOCS),
    Suite("layout_w4_block_kda_control", (LAYOUT, "-k", "at_4_ranks_on_gpu and block-kda"), CONTROL),
    Suite("layout_w4_mixers", (LAYOUT, "-k", "at_4_ranks_on_gpu and mixer"), DOCS),
    Suite("layout_w4_mixers_control", (LAYOUT, "-k", "at_4_ranks_on_gpu and mixer"), CONTROL),
    Suite("train_gdn", ("tests/test_train_cuda.py", "-k", "gdn")),       # 2 GPUs: the training step over NCCL
    Suite("train_kda", ("tests/test_train_cuda.py", "-k", "kda")),
    Suite("ops_w2", (OPS, "-k", "single_gpu and 2]")),
    Suite("ops_w4", (OPS, "-k", "single_gpu and 4]")),
    Suite("layout_mixers", (LAYOUT, "-k", "equals_cp1_on_gpu and mixer")),
    Suite("layout_block_gdn", (LAYOUT, "-k", "equals_cp1_on_gpu and block-gdn")),
    Suite("layout_block_kda", (LAYOUT, "-k", "equals_cp1_on_gpu and block-kda")),
    Suite("ops_poison", (OPS, "-k", "cp_reads_no_unzeroed and 2]")),
    Suite("ops_poison_qla", (OPS, "-k", "cp_reads_no_unzeroed and 2]"), QLA),
    Suite("ops_poison_w4", (OPS, "-k", "cp_reads_no_unzeroed and 4]")),
    Suite("ops_poison_w4_qla", (OPS, "-k", "cp_reads_no_unzeroed and 4]"), QLA),
    Suite("ops_pieces", (OPS, "-k", "qla_matches or single_device_call or split_segments or maps_match or "
                                    "head_groups or middle_rank_split")),
    Suite("ops_conv", (OPS, "-k", "conv_equal")),   # the conv's halo on every layout and both kernels
    Suite("ops_conv_long", (OPS, "-k", "conv_long")),   # pieces of thousands of tokens: long
    Suite("layers_w4", (LAYERS, "-k", "4-1-False or 4-2-True")),
    Suite("layers_w2", (LAYERS, "-k", "2-1-False or 2-2-True or fused_gate")),
    Suite("layers_slow", ("tests/layers/test_attention.py", LAYERS, "-k", "varlen or long_pieces")),
    Suite("nccl", (OPS, "-k", "no_host_sync or over_nccl")),              # 2 GPUs (skips on one)
    Suite("graph", (OPS, "-k", "replays")),
    Suite("ops_w1", (OPS, "tests/parallel/test_gather.py", "-k", "fla_matches or scattered or fold_on_the_gpu")),
    Suite("whole_stream", (LAYOUT, "-k", "whole_stream_layout_on_gpu")),   # --dataloader-inter-document-masking
    # the tiny presets trained on documents, a suite a trainer (a case ~90 s: side by side, not one after another)
    Suite("documents", ("tests/test_train_data_cuda.py", "-k", "not pretrain_gpt")),   # megatron_kcp.train
    Suite("documents_mlm", ("tests/test_train_data_cuda.py", "-k", "pretrain_gpt")),   # Megatron-LM's pretrain_gpt.py
    Suite("models_convert", ("tests/convert/test_convert_cuda.py",)),   # converted HF models against transformers
    Suite("memory", ("run", "--problem", "memory")),
)
BY_NAME = {s.name: s for s in SUITES}
VERSIONS = ("import sys, torch, triton, fla, megatron.core as m; print('python', sys.version.split()[0], 'torch', "
            "torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__, 'megatron-core', m.__version__)")


def gpu_count() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 where there is none)."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU") for line in out.splitlines())


def refuse(names, jobs) -> str | None:
    """Why the input is refused, or None."""
    for n in names:
        if n not in BY_NAME:
            return f"gpu-checks: unknown suite {n}: name suites from: {' '.join(BY_NAME)}"
    if jobs is not None and jobs < 1:
        return f"gpu-checks: --jobs {jobs}: give a number of suites at a time, e.g. 3"
    return None


class Run:
    """The suites of one run, side by side, their evidence packed into ``out``/evidence.tar.gz."""

    def __init__(self, suites, out: str, jobs: int, timeout: float):
        self.suites, self.out, self.jobs, self.timeout = suites, out, jobs, timeout
        self.dir = tempfile.mkdtemp()
        self.lock, self.running = threading.Lock(), {}      # name: (Popen, start)
        os.makedirs(out, exist_ok=True)

    def note(self, line: str) -> None:
        with self.lock:
            with open(os.path.join(self.dir, "summary.txt"), "a") as f:
                f.write(line + "\n")
            self.pack()

    def pack(self) -> None:
        part = os.path.join(self.out, "evidence.tmp.tar.gz")
        with tarfile.open(part, "w:gz") as t:
            t.add(self.dir, arcname=".")
        os.replace(part, os.path.join(self.out, "evidence.tar.gz"))

    def one(self, s: Suite) -> int:
        env = {**os.environ, **s.env, "KCP_EVIDENCE_DIR": self.dir, "KCP_FAST_AUTOTUNE": "1",
               "PYTHONWARNINGS": "ignore"}
        t0 = time.time()
        with open(os.path.join(self.dir, f"{s.name}.{'txt' if s.name == 'memory' else 'log'}"), "w") as log:
            p = subprocess.Popen(s.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.running[s.name] = (p, t0)
            try:
                rc = p.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 124
        if self.running.pop(s.name, None) is not None:
            self.note(f"{s.name}: exit {rc} after {round(time.time() - t0)} s")
        return rc

    def cut_short(self, *_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)      # once: a time limit's TERM may come twice (group, wrapper)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for name, (p, t0) in list(self.running.items()):
            self.running.pop(name, None)
            os.killpg(p.pid, signal.SIGKILL)
            self.note(f"{name}: cut short after {round(time.time() - t0)} s")
        self.pack()
        print(f"cut short: the evidence so far is in {self.out}/evidence.tar.gz", file=sys.stderr, flush=True)
        os._exit(124)

    def __call__(self) -> int:
        signal.signal(signal.SIGTERM, self.cut_short)
        signal.signal(signal.SIGINT, self.cut_short)
        versions = [time.strftime("%a %b %d %H:%M:%S UTC %Y", time.gmtime())]
        for cmd in (["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                    [sys.executable, "-c", VERSIONS],
                    [sys.executable, "-c", "import tilelang; print('tilelang', tilelang.__version__)"]):
            r = subprocess.run(cmd, capture_output=True, text=True) if shutil.which(cmd[0]) else None
            versions.append((r.stdout or r.stderr).strip().splitlines()[-1:][0] if r and (r.stdout or r.stderr)
                            else "")
        print("\n".join(versions), flush=True)
        with open(os.path.join(self.dir, "versions.txt"), "w") as f:
            f.write("\n".join(versions) + "\n")
        self.pack()        # a run killed before its first suite ends still leaves the versions
        with ThreadPoolExecutor(self.jobs) as pool:
            codes = list(pool.map(self.one, self.suites))
        self.pack()
        with open(os.path.join(self.dir, "summary.txt")) as f:
            print(f.read(), end="")
        shutil.rmtree(self.dir, ignore_errors=True)
        return 0 if all(c == 0 for c in codes) else 1


def main(names, jobs=None, timeout=900.0, out=None, skip_memory=False) -> int:
    """Runs the suites ``names`` (every one where empty); the exit status (module docstring)."""
    why = refuse(names, jobs)
    if why:
        print(why, file=sys.stderr)
        return 2
    gpus = gpu_count()
    if gpus == 0:
        print("gpu-checks runs the GPU suites and found no GPU (nvidia-smi -L): on a CPU run scripts/test.sh --all",
              file=sys.stderr)
        return 2
    suites = [s for s in SUITES if (s.name in names if names else not (skip_memory and s.name == "memory"))]
    return Run(suites, out or os.environ.get("OUT", "/tmp/out"), jobs or 3 * gpus, timeout)()
