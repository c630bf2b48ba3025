"""What every bench shares: the inputs, the error measure, the ranks, and the CSVs (the problems: catalogue.py)."""
from __future__ import annotations

import contextlib
import csv
import math
import os
import warnings
from unittest import mock

import torch
import torch.multiprocessing as mp

from megatron_kcp.testing.distributed import free_port  # noqa: F401 - the benches' rendezvous port


@contextlib.contextmanager
def env(**values):
    """Environment variables for one method's build and run (``None``: unset)."""
    with mock.patch.dict(os.environ):
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield


@contextlib.contextmanager
def split_parts(tokens: int | None):
    """Our op's segments split into parts of ``tokens`` (0: left whole) where its caller leaves the split
    to the kernels' pick (``max_segment=None``); None: the kernels' pick."""
    if tokens is None:
        yield
        return
    from megatron_kcp.ops import dispatch
    decide = dispatch.decide

    def forced(plan, q, v, g, backend="auto", strategy="auto", max_segment=None, initial_state=None):
        return decide(plan, q, v, g, backend, strategy, tokens if max_segment is None else max_segment, initial_state)
    with mock.patch.object(dispatch, "decide", forced):
        yield


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp64, in slices (a 256k-token output in fp64 would be gigabytes)."""
    num = den = 0.0
    for x, y in zip(a.reshape(-1).split(1 << 24), b.reshape(-1).split(1 << 24)):
        x, y = x.double(), y.double()
        num += (x - y).square().sum().item()
        den += y.square().sum().item()
    return math.sqrt(num / max(den, 1e-60))


def problem(model, T, H, K, dtype, device, seed, gate_dtype=torch.float32):
    """q, k, v, g, beta [1, T, H(, K)] and do, as the mixers feed the kernel: g (log decay) in fp32
    (``gate_dtype``: the memory report keeps the bf16 gate it has always measured with). The decay
    is slow (about 1e-3 per token), so the state that crosses a rank edge shows in the err column."""
    gen = torch.Generator(device=device).manual_seed(seed)
    like = dict(device=device, dtype=dtype, generator=gen)
    xs = [torch.randn(1, T, H, K, **like) for _ in range(3)]
    g = torch.rand(1, T, H, *((K,) if model == "KDA" else ()), device=device, dtype=gate_dtype, generator=gen)
    xs += [-1e-3 * (0.5 + g), torch.rand(1, T, H, **like)]
    return xs, torch.randn(1, T, H, K, **like)


def fresh_leaves(xs):
    """Copies of ``xs`` that are leaves of the autograd graph, requiring their gradients."""
    return [x.detach().clone().requires_grad_() for x in xs]


def spawn(fn, W, *args):
    """fn(rank, W, port, *args) on W processes, with a free port for their rendezvous."""
    mp.start_processes(fn, args=(W, free_port(), *args), nprocs=W, start_method="spawn")


def init_rank(rank, W, port, device_type) -> torch.device:
    """The process group of one rank (megatron_kcp.testing.distributed.init_process: with fewer GPUs than ranks they
    share them over gloo, which only the memory report allows: peak memory is per process; timings
    refuse it in bench_ops.main)."""
    from megatron_kcp.testing.distributed import init_process
    warnings.simplefilter("ignore")              # library deprecation chatter would bury the table
    return init_process(rank, W, port, device_type)


def measured_world(cp: int | None, hint: str = "") -> int:
    """W for a measured run, a rank a GPU: ``cp``, or every GPU; the reason (and ``hint``) where it cannot."""
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke for the CPU check")
    W = cp or torch.cuda.device_count()
    if W < 2 or W > torch.cuda.device_count():
        raise SystemExit(f"--cp {W}: a measured run needs 2 or more GPUs, one a rank (found "
                         f"{torch.cuda.device_count()}){hint}")
    return W


def append_csv(path: str, columns, rows, source: str = "measured") -> None:
    """``rows`` (dicts) appended to the CSV at ``path`` with the provenance of ``source`` (the results schema,
    ``benchmarks/schema.py``), its header first where the file is new or empty (an older file keeps its own)."""
    from benchmarks.schema import PROVENANCE, provenance
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as f:
            columns = next(csv.reader(f))
    else:
        columns = [*columns, *(c for c in PROVENANCE if c not in columns)]
    meta = provenance(source)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, columns, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows({**meta, **r} for r in rows)
