"""What each step of the local KCP core costs on one GPU: the numbers the strategy cost model uses.

    python -m benchmarks predict kernel-costs --tokens 16384 32768 --heads 64 --csv costs.csv

Per model, tokens T, documents and heads: our fla core's steps over the whole stream (prepare: l2norm,
gate cumsum and WY form; state pass; output; transition maps, fla's CP pre-process; backward state
pass, split into what needs no incoming state gradient and the state-gradient pass itself; backward
rest), fla's own chunk call (fwd, fwd+bwd) for scale, and, where flash-qla imports,
its GDN chunk call. Medians of --iters after --warmup calls (fla autotunes in the warm-up).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics


import torch

from benchmarks.catalogue import cu_seqlens
from benchmarks.common import fresh_leaves, problem


def timed(fn, warmup, iters) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def case(model, T, docs, H, args, rows):
    from megatron_kcp.kernels import core_fla
    from megatron_kcp.plan import build_plan
    cu = cu_seqlens(docs, T)
    plan = build_plan(cu, "contiguous", 1, 0, 4)
    xs, do = problem(model, T, H, 128, torch.bfloat16, torch.device("cuda"), seed=0)
    core = core_fla.core(kda=model == "KDA", device=xs[0].device)
    n = plan.num_segments
    h0 = xs[0].new_zeros(n, H, 128, 128, dtype=torch.float32)
    scale = 128 ** -0.5
    P = core.prepare(*xs, plan, scale, True)
    segs = range(n)
    st = core.states(P, h0)
    core.state(P, st, segs, h0)
    B = core.backward_prepare(P, 0, n, h0, do)
    core.backward_state(P, B, segs, h0)
    steps = {
        "prepare": lambda: core.prepare(*xs, plan, scale, True),
        "state": lambda: core.state(P, st, segs, h0),
        "output": lambda: core.output(P, st, 0, n),
        "maps": lambda: core.maps(P, segs),
        "backward_prepare": lambda: core.backward_prepare(P, 0, n, h0, do),
        "backward_state": lambda: core.backward_state(P, B, segs, h0),
        "backward_rest": lambda: core.backward_rest(P, B),
        "copy_T_H_K": lambda: xs[0].index_select(1, torch.arange(T, device="cuda")),
    }
    cu_dev, cu_cpu = torch.tensor(cu, device="cuda"), torch.tensor(cu)
    if model == "KDA":
        from fla.ops.kda import chunk_kda as fla_fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    leaves = fresh_leaves(xs)

    def fla_fwd():
        with torch.no_grad():
            fla_fn(*leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu)

    def fla_fwd_bwd():
        o = fla_fn(*leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu)[0]
        torch.autograd.grad(o, leaves, do)
    steps["fla_fwd"], steps["fla_fwd_bwd"] = fla_fwd, fla_fwd_bwd
    if model == "GDN":
        try:
            from flash_qla import chunk_gated_delta_rule as qla_fn
        except Exception as e:  # noqa: BLE001 - optional peer
            print(f"flash-qla not available: {type(e).__name__}: {e}", flush=True)
        else:
            for auto in (False, True):
                def qla(auto=auto):
                    o = qla_fn(*leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev, auto_cp=auto)[0]
                    torch.autograd.grad(o, leaves, do)

                def qla_fwd(auto=auto):
                    with torch.no_grad():
                        qla_fn(*leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev, auto_cp=auto)
                steps[f"qla{'_autocp' if auto else ''}_fwd"], steps[f"qla{'_autocp' if auto else ''}_fwd_bwd"] = \
                    qla_fwd, qla
    for name, fn in steps.items():
        try:
            ms = timed(fn, args.warmup, args.iters)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{model} T={T} {docs} H={H} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        row = dict(gpu=torch.cuda.get_device_name(), model=model, tokens=T, docs=docs, heads=H, step=name,
                   ms=round(ms, 4))
        rows.append(row)
        print(f"{model} T={T:6d} {docs:9s} H={H:3d} {name:18s} {ms:8.3f} ms", flush=True)
    torch.cuda.empty_cache()


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument("--docs", nargs="+", default=["single", "varlen", "varlen100"])
    p.add_argument("--models", nargs="+", default=["GDN", "KDA"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("FLA_FLASH_QLA", "0")       # fla's rows: its Triton kernels (flash-qla: the qla rows)
    if not torch.cuda.is_available():
        raise SystemExit("python -m benchmarks predict kernel-costs times CUDA kernels: run it on a GPU")
    rows = []
    for model in args.models:
        for H in args.heads:
            for T in args.tokens:
                for docs in args.docs:
                    case(model, T, docs, H, args, rows)
    if args.csv and rows:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, list(rows[0]))
            w.writeheader()
            w.writerows(rows)
