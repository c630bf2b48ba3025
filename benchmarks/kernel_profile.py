"""Where the time goes (``--what profile``): torch.profiler's kernel table of one fwd+bwd, noCP
(the whole problem on one GPU, rank 0) beside each kcp method (--methods: kcp-relay, kcp-gather, kcp)
and the peers among --methods (fla-cp; cp2hp on zigzag) on each --layouts (every rank: the rank
waiting in the exchange shows which one is late), per
(model, T, H), after the same untimed warm-up as the timings. The sums per kernel say which part of
the CP algorithm (state pass, transition pass, exchange, fold) costs what the single GPU does not pay."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.catalogue import CONV, cu_seqlens
from benchmarks.common import fresh_leaves, problem
from benchmarks.ops import chunk_kernel, fla_cp, op_steps
from benchmarks.timing import Bench

ROWS = 14                                          # kernels per table: the tail is launches of microseconds
ITERS = 5


def profile_case(b: Bench, model, T, docs, H):
    from megatron_kcp.ops import kcp
    from megatron_kcp.plan import build_plan, local_token_index
    args, W, rank, dev = b.args, b.W, b.rank, b.device
    from benchmarks.ops import KCP_METHODS, cp2hp, kcp_backend
    cu = cu_seqlens(docs, T, pad=2 * W)
    cu_dev, cu_cpu = torch.tensor(cu, device=dev), torch.tensor(cu)
    xs, do = problem(model, T, H, args.head_dim, b.dtype, dev, seed=0)
    kernel = chunk_kernel(model, dev)
    cases = [("noCP", lambda *x: kernel(*x, cu_dev, cu_cpu), None)]
    for layout in args.layouts:
        plan = build_plan(cu, layout, W, rank, CONV)
        idx = local_token_index(plan).to(dev)
        for method in (m for m in args.methods if m in KCP_METHODS and kcp_backend(m, model, b.cuda)):
            cases.append((f"{method} {layout} W={W}", lambda *x, plan=plan, s=KCP_METHODS[method],
                          be=kcp_backend(method, model, b.cuda): kcp.gated_delta_rule(
                              *x, plan, dist.group.WORLD, use_qk_l2norm=True, backend=be, strategy=s), idx))
        # the peers, where the question is why they are fast: fla's own CP, and cp2hp (on zigzag)
        few = layout != "zigzag_per_doc" or len(cu) - 1 <= args.fla_cp_max_docs
        if "fla-cp" in args.methods and b.cuda and few:
            cases.append((f"fla-cp {layout} W={W}", fla_cp(kernel, plan, cu, dist.group.WORLD, dev), idx))
        if "cp2hp" in args.methods and layout == "zigzag" and H % W == 0:
            cases.append((f"cp2hp zigzag W={W}", cp2hp(kernel, plan, dist.group.WORLD), idx))
    for name, fn, idx in cases:
        pick = (lambda t: t) if idx is None else (lambda t: t[:, idx])
        step = op_steps(fn, fresh_leaves(pick(x) for x in xs), pick(do).contiguous())("fwd+bwd")
        for _ in range(args.warmup):
            step()
        b.sync()
        dist.barrier()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(ITERS):
                step()
            b.sync()
        # every rank's table for kcp (a rank waiting in the exchange shows which one is late), one for noCP
        for r in range(W if idx is not None else 1):
            if rank == r:
                print(f"\n== {model} fwd+bwd T={T} {docs} H={H}: {name}, {ITERS} iterations, rank {r}", flush=True)
                sort = "self_device_time_total" if b.cuda else "self_cpu_time_total"
                print(prof.key_averages().table(sort_by=sort, row_limit=ROWS, max_name_column_width=60), flush=True)
            dist.barrier()
        step = None
        if b.cuda:
            torch.cuda.empty_cache()


def run_profile(b: Bench):
    """One table pair per (model, first --tokens, first --docs, first --heads)."""
    args = b.args
    for model in args.models:
        if b.out_of_time():
            return
        profile_case(b, model, args.tokens[0], args.docs[0], args.heads[0])
