"""The short conv alone on one GPU: fla's Triton kernels against its Gluon kernels (with our halo fix),
each CP rank's local conv in turn, its halo given (the exchange is the same for both and left out).

Forward, and forward + backward (input, weight and halo gradients), the median over --iters after
--warmup calls, the slower rank's. ``err``: the largest relative difference of the Gluon run's output
and gradients from the Triton run's on the same inputs. Shapes: the mixers' convs (Qwen3-Next's GDN
conv of q, k and v together, 8192 channels at TP = 1 and 4096 at TP = 2; Kimi-Linear's three convs
of 4096 channels each, counted as three calls).

    python -m benchmarks run conv --tokens 32768 131072 --docs single varlen100 --csv conv.csv
    python -m benchmarks run conv --smoke      # CPU, the reference conv: checks the script
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.catalogue import cu_seqlens
from benchmarks.common import append_csv
from megatron_kcp.kernels import conv_fla, conv_gluon, conv_reference
from megatron_kcp.plan import build_plan

COLUMNS = ("gpu", "W", "layout", "tokens", "docs", "shape", "channels", "calls", "dtype", "backend", "fwd_ms", "ms",
           "err", "note")
SHAPES = {"qwen3-next": (8192, 1), "qwen3-next-tp2": (4096, 1), "kimi-linear": (4096, 3)}    # channels, calls
LOCAL = {"fla": conv_fla.local_conv, "gluon": conv_gluon.local_conv, "reference": conv_reference.local_conv}
KS = 4


def timed(step, warmup: int, iters: int, cuda: bool) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rank_case(args, plan, D, calls, backends):
    """{backend: (fwd ms, fwd+bwd ms, [y, dx, dw, dhalo])} of one rank's plan."""
    dev, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(plan.rank)
    T = plan.num_local_tokens
    # the conv input is a column slice of the in-projection's output, as in the GDN mixer
    wide = torch.randn(1, T, D + 64, device=dev, dtype=dtype, generator=gen)
    w = torch.randn(D, KS, device=dev, dtype=dtype, generator=gen) * 0.5
    rows = torch.randn(plan.num_pieces * plan.halo_len, D, device=dev, dtype=dtype, generator=gen) \
        if plan.world_size > 1 else None
    dy = torch.randn(1, T, D, device=dev, dtype=dtype, generator=gen)
    out = {}
    for name in backends:
        leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (wide, w, rows)]

        def fwd():
            return [LOCAL[name](leaves[0][..., :D], leaves[1], None, "silu", plan, leaves[2]) for _ in range(calls)]

        def step():
            for y in fwd():
                y.backward(dy)
        with torch.no_grad():
            f = timed(fwd, args.warmup, args.iters, dev == "cuda")
        ms = timed(step, args.warmup, args.iters, dev == "cuda")
        for t in leaves:
            if t is not None:
                t.grad = None
        y = LOCAL[name](leaves[0][..., :D], leaves[1], None, "silu", plan, leaves[2])
        y.backward(dy)
        out[name] = (f, ms, [y, *(t.grad for t in leaves if t is not None)])
    return out


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--docs", nargs="+", default=["single", "varlen100"])
    p.add_argument("--cp", type=int, default=2, help="W whose ranks' local convs run in turn")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag_per_doc"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--backends", nargs="+", default=["fla", "gluon"], choices=list(LOCAL))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--note", default="")
    p.add_argument("--csv", default=None, help="append the rows to this CSV")
    p.add_argument("--smoke", action="store_true", help="CPU, the reference conv, tiny")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.docs, args.shapes, args.backends = [256], ["varlen"], ["qwen3-next"], ["reference"]
        args.dtype, args.device, args.warmup, args.iters = "float32", "cpu", 0, 1
    else:
        args.device = "cuda"
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    rows = []
    for T in args.tokens:
        for docs in args.docs:
            cu = cu_seqlens(docs, T, pad=2 * args.cp)
            for layout in args.layouts:
                if layout == "zigzag_per_doc" and docs == "single":
                    continue                       # the same as zigzag
                plans = [build_plan(cu, layout, args.cp, r, KS) for r in range(args.cp)]
                for shape in args.shapes:
                    D, calls = (16, 1) if args.smoke else SHAPES[shape]
                    per_rank = [rank_case(args, plan, D, calls, args.backends) for plan in plans]
                    first = args.backends[0]
                    for name in args.backends:
                        err = max(rel(a, b) for r in per_rank for a, b in zip(r[name][2], r[first][2]))
                        rows.append(dict(gpu=gpu, W=args.cp, layout=layout, tokens=T, docs=docs, shape=shape,
                                         channels=D, calls=calls, dtype=args.dtype, backend=name,
                                         fwd_ms=round(max(r[name][0] for r in per_rank), 4),
                                         ms=round(max(r[name][1] for r in per_rank), 4),
                                         err=f"{err:.2e}", note=args.note))
                        print(", ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    if args.csv:
        append_csv(args.csv, COLUMNS, rows)
