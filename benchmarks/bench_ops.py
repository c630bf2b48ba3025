"""CP benchmark, op and layer level: KCP beside no CP, fla's own CP and megatron-core's cp2hp.

    python -m benchmarks run ops --cp 2 --tokens 32768 131072 262144 --heads 16 --csv ops.csv
    python -m benchmarks run ops --what layers --cp 2 --tokens 32768 --csv layers.csv
    python -m benchmarks run ops --smoke --what ops layers --csv /tmp/smoke.csv   # CPU, seconds
    python -m benchmarks run ops --memory-only --cp 4 --tokens 32768 --heads 16 --layouts contiguous zigzag

Op level (``--what ops``): per model (GDN, KDA), total tokens T, documents (``single``: one
sequence; ``varlen``: the 10-document cu_seqlens of VARLEN_32K, boundaries scaled by T / 32768;
``varlen100``: 100 documents; every document padded to a multiple of 2W, as Megatron pads THD
batches), heads H (K = V = --head-dim) and pass (fwd, fwd+bwd), one row per method and layout:

* ``noCP``   the whole problem on one GPU (every rank runs it; the slowest rank counts);
* ``cp2hp``  megatron-core GatedDeltaNet's scheme: one all-to-all of [q|k|v|g|beta] from sequence
             shards (zigzag) to head shards (each rank: the whole sequence, H/W heads), fla's chunk
             kernel, one all-to-all of o back; backward runs the same two in reverse;
* ``cp2hp-qla`` the same with flash-qla's own call (its intra-GPU split) as the kernel: what
             megatron-core's GatedDeltaNet runs where flash-qla is installed (fla hands it GDN; GDN,
             Hopper/Blackwell, K = V = 128);
* ``kcp-relay``, ``kcp-gather``  ``megatron_kcp.ops.kcp.gated_delta_rule`` (backend fla) with either
             exchange strategy (``kcp``: the cost model's pick), on every --layouts: contiguous,
             zigzag and Megatron's per-document zigzag of packed batches (zigzag_per_doc);
* ``kcp-qla`` the same op on flash-qla's fused GDN kernels (backend qla: the relay, or the
             all-gather where no transition map is needed; GDN on Hopper/Blackwell);
* ``fla-cp`` fla's own CP called directly, as fla's CP tests do: ``build_cp_context`` and
             ``chunk_gated_delta_rule`` / ``chunk_kda`` with ``cp_context`` (contiguous, zigzag; on
             zigzag_per_doc one call per document, fla's way for packed documents).

Layer level (``--what layers``, one sequence of T tokens, hidden size --hidden, H q/k and v heads):
KCPGatedDeltaNet and megatron-core 0.19's GatedDeltaNet with the same config and weights (CP=1
rows ``noCP`` / ``megatron``, CP=W rows ``kcp`` / ``cp2hp``), and the KDA mixer at CP=1 and CP=W
(``kcp``, and ``cp2hp``: the same mixer with the all-to-all around its kernel); fwd+bwd; Megatron's
local layers (no TransformerEngine), bf16 weights. Where flash-qla runs the problem (GDN, Hopper on,
K = V = 128), megatron-core's module again with fla handing its call to flash-qla, as it runs where
flash-qla is installed (``megatron-qla``, ``cp2hp-qla``); its other rows run fla's Triton kernels, as
every fla row here does unless ``FLA_FLASH_QLA`` is set.

Every time is the median over --iters iterations of the slowest rank, after --warmup untimed calls
of the same shape (fla autotunes on its first call per shape; --prewarm first tunes the single-GPU
shapes split over the ranks), with a barrier before each iteration. Columns:

* eff = t_noCP / (W t) (layers: against the same module at CP=1); x_cp2hp = t_cp2hp / t;
* peak MiB: the rank's inputs plus the peak the pass allocates beyond them (layers: without the
  parameters);
* xchg MiB: bytes one rank receives per layer in that pass, counted from the collectives the pass
  issues (all-gather: the other ranks' parts; all-to-all: (W-1)/W of the buffer; all-reduce: twice
  that); xchg ms: those collectives alone, replayed on buffers of the same sizes;
* err: the largest relative error of the output and the input gradients against noCP (layers:
  output and dx against the first CP=1 module): every row must compute the same function.

Rows are printed and appended to --csv as they finish, and --budget skips the cases left once it
is spent, so a stopped stage still reports. ``--smoke`` runs tiny sizes on the CPU over gloo
(reference kernels, no fla-cp): a check that the script works, not a measurement.

``--profile ROWS`` (layer level): after timing each of ``--profile-methods`` (default: kcp), every rank's
profile of one step: wall time, kernel time and launches, and the ROWS costliest operators.
``--graph METHODS`` (layer level): after each of those rows, ``METHOD-graph``: the same fwd+bwd step,
collectives included, captured once in a CUDA graph and replayed: the step without its host time, as
Megatron's per-layer CUDA graphs run it; its eff and x_cp2hp are against the captured rows of its peers.
``--kcp-parts N`` (layer level, GDN): rows ``kcp-partsN``, our mixer with its op's segments split into parts
of N tokens on flash-qla's core instead of the kernels' pick (``--graph kcp`` captures them too).

``--what profile`` (kernel_profile.py) times nothing: torch.profiler's kernel table of one fwd+bwd, noCP
beside each kcp method on each --layouts (every rank), per model at the first --tokens, --docs and --heads.

``--memory-only`` (memory.py) times nothing: per model and layout it prints the peak memory per rank
of KCP fwd+bwd at each CP size, beside one GPU (one case: --tokens, --heads, --docs (default single),
--head-dim, --dtype, --models, --layouts, --warmup). It runs with fewer GPUs than ranks (gloo, ranks
sharing GPUs) and with the tests' cheap autotuning, neither of which changes what is allocated.

The code: common.py (problems, ranks), timing.py (Bench), table.py (rows, CSV), ops.py (op level;
cp2hp is megatron_kcp/parallel/cp2hp.py), layers.py (layer level), memory.py, kernel_profile.py;
this file holds the command line.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time


import torch
import torch.distributed as dist

from benchmarks.catalogue import OP_DOCS as DOCS
from benchmarks.common import init_rank, spawn
from benchmarks.layers import run_layers
from benchmarks.memory import NEEDS_GPU, report
from benchmarks.ops import run_ops
from benchmarks.kernel_profile import run_profile
from benchmarks.table import COLUMNS, Table, describe
from benchmarks.timing import Bench


LAYER_METHODS = ("megatron", "megatron-qla", "noCP", "cp2hp", "cp2hp-qla", "kcp")


def worker(rank, W, port, args):
    b = Bench(args, init_rank(rank, W, port, args.device), W, rank)
    table = Table(args, args.csv if rank == 0 else None, show=rank == 0)
    if rank == 0:
        print(f"\n{describe(args, W)}\n{table.header()}", flush=True)
    try:
        if "ops" in args.what:
            run_ops(b, table)
        if "layers" in args.what:
            run_layers(b, table)
        if "profile" in args.what:
            run_profile(b)
        if rank == 0 and {"ops", "layers"} & set(args.what):
            table.print_all(describe(args, W))
    finally:
        dist.destroy_process_group()


def parse(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--what", nargs="+", choices=["ops", "layers", "profile"], default=["ops"])
    p.add_argument("--cp", type=int, nargs="+", default=None, help="CP sizes W (default: the number of GPUs)")
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="layer level: hidden size")
    p.add_argument("--models", nargs="+", choices=["GDN", "KDA"], default=["GDN", "KDA"])
    p.add_argument("--docs", nargs="+", choices=list(DOCS), default=list(DOCS))
    p.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    p.add_argument("--layouts", nargs="+", choices=["contiguous", "zigzag", "zigzag_per_doc"],
                   default=["contiguous", "zigzag", "zigzag_per_doc"], help="layouts of the kcp and fla-cp rows")
    p.add_argument("--methods", nargs="+",
                   default=["noCP", "noCP-qla", "cp2hp", "cp2hp-qla", "kcp-relay", "kcp-gather", "kcp-qla",
                            "fla-cp"],
                   help="also: kcp (the cost model's pick of relay or gather)")
    p.add_argument("--fla-cp-max-docs", type=int, default=1000,
                   help="fla-cp on zigzag_per_doc makes one fla CP call per document (1.2 s a step at 100 "
                        "documents on 2 x H200): skip it above this many documents")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="do not tune the single-GPU shapes first, split over the ranks")
    p.add_argument("--budget", type=float, default=None, help="seconds; cases left after it are skipped")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="layer level: after timing --profile-methods, print each rank's profile of one step")
    p.add_argument("--profile-methods", nargs="+", default=["kcp"],
                   choices=LAYER_METHODS)
    p.add_argument("--graph", nargs="+", default=[], metavar="METHOD", choices=LAYER_METHODS,
                   help="layer level: after each of these rows, METHOD-graph: its step captured in a CUDA graph "
                        "and replayed (without host time)")
    p.add_argument("--kcp-parts", type=int, nargs="+", default=[], metavar="N",
                   help="layer level, GDN: also rows kcp-partsN, our op's segments split into parts of N tokens")
    p.add_argument("--csv", default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes: checks the script, measures nothing")
    p.add_argument("--memory-only", action="store_true",
                   help="peak memory per rank of KCP fwd+bwd beside one GPU, no timings; ranks may share GPUs")
    args = p.parse_args(argv)
    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
    if args.smoke:
        tiny = {"--tokens": [128], "--heads": [2], "--head-dim": 16, "--hidden": 32, "--dtype": "float32",
                "--warmup": 1, "--iters": 2, "--cp": [2], "--docs": ["single", "varlen"]}
        for flag, value in tiny.items():
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
        args.device = "cpu"
    if args.memory_only:
        if "--docs" not in given:
            args.docs = ["single"]
        if max(len(args.tokens), len(args.heads), len(args.docs)) > 1:
            p.error("--memory-only reports one case: give one --tokens, --heads and --docs value")
    if args.profile and "layers" not in args.what:
        p.error("--profile profiles layer rows: add --what layers (the op kernels' tables: --what profile)")
    if args.graph and "layers" not in args.what:
        p.error("--graph captures layer rows: add --what layers (the op's captured step: python -m "
                "benchmarks run matrix --methods kcp-graph)")
    if args.kcp_parts and "layers" not in args.what:
        p.error("--kcp-parts adds layer rows: add --what layers (the op's part length: python -m "
                "benchmarks predict host-time --max-segment)")
    if any(n <= 0 for n in args.kcp_parts):
        p.error(f"--kcp-parts {args.kcp_parts}: part lengths are positive token counts")
    if "noCP" not in args.methods:
        args.methods.append("noCP")                # every other row is measured against it
    args.deadline = time.time() + (args.budget if args.budget is not None else 1e9)
    return args


def main(argv=None, prog=None):
    args = parse(argv, prog)
    # fla sends GDN to flash-qla when that is installed; every fla row (noCP, cp2hp, fla-cp) runs fla's
    # Triton kernels like ours, and flash-qla has a row of its own (noCP-qla)
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    if args.memory_only and (args.device == "cpu" or not torch.cuda.is_available()):
        raise SystemExit(NEEDS_GPU)
    if args.device == "cpu":
        os.environ["TORCHDYNAMO_DISABLE"] = "1"    # megatron's torch.compile fusions: CPU compile time, no use here
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke (or --device cpu) for the CPU check")
    ngpu = torch.cuda.device_count() if args.device == "cuda" else 0
    cps = args.cp or [ngpu]
    for W in cps:
        if W < 2:
            raise SystemExit(f"--cp {W}: CP needs at least 2 ranks (found {ngpu} GPUs); pass --cp 2 or more")
        if args.device == "cuda" and W > ngpu and not args.memory_only:
            raise SystemExit(f"CP={W} needs {W} GPUs for timings (one per rank), found {ngpu}: use --cp {ngpu} "
                             "or a machine with more GPUs (--memory-only runs on fewer)")
    if args.memory_only:
        return report(args, cps)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()
    for W in cps:
        spawn(worker, W, args)
