"""The layout conversion alone on W GPUs, measured: a layer's input hidden states ``[T / W, d_model]`` moved
from Megatron's per-document zigzag to the contiguous layout (``relayout.relayout``), forward, and
forward + backward (the gradient moved back), the median over --iters of the slowest rank after
--warmup calls. A mixer runs two such conversions a step (in and out).

    CUDA_VISIBLE_DEVICES=0,1 python -m benchmarks run convert --tokens 32768 --width 2048 \\
        --docs varlen varlen100 varlen300 --csv convert.csv
    python -m benchmarks run convert --smoke      # CPU, 2 gloo ranks, tiny: checks the script

``kept``: the share of a rank's rows that stay on it (the rank keeping the fewest); ``sent_mib``: what the
rank sending the most puts on the link a move. ``--note`` tags the rows (e.g. the code that ran).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.catalogue import cu_seqlens
from benchmarks.common import append_csv, init_rank, measured_world, spawn
from benchmarks.timing import Bench
from megatron_kcp.parallel.relayout import positions, relayout

COLUMNS = ("gpu", "W", "tokens", "width", "dtype", "docs", "kept", "sent_mib", "fwd_ms", "ms", "note")


def case(bench: Bench, docs: str, T: int) -> dict:
    W, rank, a = bench.W, bench.rank, bench.args
    cu = cu_seqlens(docs, T, pad=2 * W)
    pos = positions(cu, "zigzag_per_doc", W, 1, rank)
    n = len(pos)
    x = torch.randn(n, a.width, dtype=bench.dtype, device=bench.device, requires_grad=True)
    dy = torch.randn(T // W, a.width, dtype=bench.dtype, device=bench.device)

    def fwd():
        return relayout([x], cu, "zigzag_per_doc", "contiguous", dist.group.WORLD)[0]

    leave = int((pos // (T // W) != rank).sum())        # rows the contiguous layout puts on another rank
    kept, sent = bench.max_over_ranks([leave / n - 1, leave * a.width * x.element_size()])

    def step():
        fwd().backward(dy)

    with torch.no_grad():
        fwd_ms = bench.measure(fwd)[0]
    ms = bench.measure(step)[0]
    return dict(gpu=torch.cuda.get_device_name() if bench.cuda else "cpu", W=W, tokens=T, width=a.width,
                dtype=a.dtype, docs=docs, kept=round(-kept, 4), sent_mib=round(sent / 2**20, 3),
                fwd_ms=round(fwd_ms, 4), ms=round(ms, 4), note=a.note)


def worker(rank, W, port, args):
    device = init_rank(rank, W, port, args.device)
    bench = Bench(args, device, W, rank)
    rows = [case(bench, d, T) for T in args.tokens for d in args.docs]
    if rank == 0:
        for r in rows:
            print(", ".join(f"{k}={v}" for k, v in r.items()), flush=True)
        if args.csv:
            append_csv(args.csv, COLUMNS, rows)
    dist.destroy_process_group()


def parse(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--width", type=int, default=2048, help="d_model (Qwen3-Next: 2048, Kimi-Linear: 2304)")
    p.add_argument("--docs", nargs="+", default=["varlen", "varlen100", "varlen300"])
    p.add_argument("--cp", type=int, default=None, help="W (default: every GPU)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--note", default="")
    p.add_argument("--csv", default=None, help="append the rows to this CSV")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo ranks, tiny")
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.width, args.docs, args.warmup, args.iters = [256], 8, ["varlen"], 0, 1
        args.dtype, args.device, W = "float32", "cpu", args.cp or 2
    else:
        args.device, W = "cuda", measured_world(args.cp)
    args.deadline = time.time() + 1e9
    return args, W


def main(argv=None, prog=None):
    args, W = parse(argv, prog)
    spawn(worker, W, args)
