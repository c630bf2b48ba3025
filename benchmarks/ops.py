"""Op level: every method on one (model, tokens T, documents, heads H), fwd and fwd+bwd.

noCP (the whole problem on one GPU, on every rank, fla's Triton kernels: what ours compose; and
``noCP-qla``: flash-qla's fused GDN kernels, for scale), cp2hp (megatron_kcp/parallel/cp2hp.py), ours on every layout
(``kcp-relay`` and ``kcp-gather``: the two exchange strategies; ``kcp``: the cost model's pick;
``kcp-qla``: flash-qla's kernels as the core, GDN),
and fla's own CP (``build_cp_context``, CUDA only) on its two layouts, contiguous and zigzag, and
on the per-document layout as one fla CP call per document (what fla offers for packed batches).
Every method sees the same documents, padded to multiples of 2W as Megatron pads THD batches.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from benchmarks.catalogue import CONV, cu_seqlens
from benchmarks.common import fresh_leaves, problem, rel_err
from megatron_kcp.parallel.cp2hp import CP2HP
from benchmarks.table import Table
from benchmarks.timing import Bench


def chunk_kernel(model: str, device: torch.device):
    """o = run(q, k, v, g, beta, cu, cu_cpu, cp_context=None, use_qk_l2norm=True): fla's chunk kernel on
    CUDA, the pure-torch chunked reference on CPU (no CP context there)."""
    if device.type == "cpu":
        from megatron_kcp.kernels import reference

        def run(q, k, v, g, beta, cu=None, cu_cpu=None, cp_context=None, use_qk_l2norm=True):
            return reference.chunk_gated_delta_rule_fp64(q, k, v, g, beta, use_qk_l2norm=use_qk_l2norm,
                                                         cu_seqlens=cu_cpu)[0]
        return run
    if model == "KDA":
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

    def run(q, k, v, g, beta, cu=None, cu_cpu=None, cp_context=None, use_qk_l2norm=True):
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                  cp_context=cp_context)[0]
    return run


def flash_qla_call(cu_dev):
    """flash-qla's own GDN call, with its intra-GPU split (auto_cp), as a noCP or cp2hp kernel;
    ImportError where flash-qla is not installed."""
    from flash_qla import chunk_gated_delta_rule

    def run(q, k, v, g, beta, cu=cu_dev, cu_cpu=None):
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return run


class KernelCore:
    """A single-device kernel ``o = kernel(q, k, v, g, beta, cu, cu_cpu)`` as the core the cp2hp strategy calls."""

    def __init__(self, kernel):
        self.kernel = kernel

    def single_device(self, q, k, v, g, beta, *, cu_seqlens, cu_seqlens_cpu, **_):
        return self.kernel(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu)


def cp2hp(kernel, plan, group):
    """megatron-core's CP (all-to-all to head shards) around ``kernel``, on this rank's ``plan``."""
    core, strategy = KernelCore(kernel), CP2HP()
    return lambda q, k, v, g, beta: strategy.apply(core, q, k, v, g, beta, plan, group, scale=None,
                                                   initial_state=None, use_qk_l2norm=True)


def op_steps(fn, leaves, do):
    def make(pas):
        if pas == "fwd":
            def step():
                with torch.no_grad():
                    fn(*leaves)
        else:
            def step():
                torch.autograd.grad(fn(*leaves), leaves, do)
        return step
    return make


KCP_METHODS = {"kcp": "auto", "kcp-relay": "relay", "kcp-gather": "gather", "kcp-qla": "auto"}


def kcp_backend(method: str, model: str, cuda: bool) -> str | None:
    """The core a kcp method runs (None: not on this model or device): fla's kernels, or on ``kcp-qla``
    flash-qla's (GDN, GPU only) under the strategy ``dispatch.decide`` picks for it."""
    if method == "kcp-qla":
        return "qla" if cuda and model == "GDN" else None
    return "fla" if cuda else "reference"


def fla_cp(kernel, plan, cu, group, dev):
    """fla's own CP: one ``build_cp_context`` call over the stream (contiguous, zigzag), or one per
    document on the per-document layout (each document is fla's zigzag of a one-sequence stream)."""
    from fla.ops.cp import build_cp_context
    if plan.layout != "zigzag_per_doc":
        ctx = build_cp_context(torch.tensor(cu, device=dev), group=group, cu_seqlens_cpu=torch.tensor(cu),
                               layout=plan.layout)
        return lambda *x: kernel(*x, cp_context=ctx)
    parts, off = [], 0
    for (s0, e0), (s1, e1) in zip(plan.pieces[0::2], plan.pieces[1::2]):
        n = (e0 - s0) * 2 * plan.world_size
        one = torch.tensor([0, n])
        parts.append((off, off + (e0 - s0) + (e1 - s1),
                      build_cp_context(one.to(dev), group=group, cu_seqlens_cpu=one, layout="zigzag")))
        off = parts[-1][1]

    def run(*x):
        return torch.cat([kernel(*(t[:, a:b] for t in x), cp_context=c) for a, b, c in parts], 1)
    return run


def ops_case(b: Bench, model, T, docs, H, table):
    """Every method of one (model, T, docs, H); rows go to ``table`` (rank 0) as they finish."""
    from megatron_kcp.ops import kcp
    from megatron_kcp.plan import build_plan, local_token_index
    args, W, rank, dev = b.args, b.W, b.rank, b.device
    cu = cu_seqlens(docs, T, pad=2 * W)
    cu_dev, cu_cpu = torch.tensor(cu, device=dev), torch.tensor(cu)
    xs, do = problem(model, T, H, args.head_dim, b.dtype, dev, seed=T + H + (model == "KDA"))
    kernel = chunk_kernel(model, dev)
    layouts = [lay for lay in ("contiguous", "zigzag", "zigzag_per_doc") if lay in args.layouts or lay == "zigzag"]
    plans = {lay: [build_plan(cu, lay, W, r, CONV) for r in range(W)] for lay in layouts}
    meta0 = dict(level="ops", model=model, tokens=T, docs=docs, heads=H)

    def run(method, layout, fn, idx, width):
        meta = dict(meta0, method=method, layout=layout, W=width)
        if method not in args.methods:
            return
        pick = (lambda t: t) if idx is None else (lambda t: t[:, idx])
        try:
            leaves = fresh_leaves(pick(x) for x in xs)
            dl = pick(do).contiguous()
            nbytes = sum(x.nbytes for x in leaves)
            # first call (fla tunes here): output and input gradients against noCP's
            o = fn(*leaves)
            errs = [rel_err(o.detach(), pick(o_ref))]
            if grads_ref:
                errs += [rel_err(d, pick(r)) for d, r in zip(torch.autograd.grad(o, leaves, dl), grads_ref)]
            del o
            err = b.max_over_ranks([max(errs)])[0]
            rows = b.rows(meta, op_steps(fn, leaves, dl), {"fwd": nbytes, "fwd+bwd": nbytes + dl.nbytes}, err,
                          args.passes)
        except Exception as e:  # noqa: BLE001 - one method failing must not lose the others
            rows = b.failed(meta, args.passes, e)
        for r in rows:
            table.add(r)
        if b.cuda:
            torch.cuda.empty_cache()

    leaves = fresh_leaves(xs)
    o_ref = kernel(*leaves, cu_dev, cu_cpu)
    grads_ref = torch.autograd.grad(o_ref, leaves, do) if "fwd+bwd" in args.passes else ()
    o_ref, leaves = o_ref.detach(), None
    run("noCP", "-", lambda *x: kernel(*x, cu_dev, cu_cpu), None, 1)
    qla, qla_methods = None, {"noCP-qla": ("-", 1), "cp2hp-qla": ("zigzag", W)}
    if model == "GDN" and b.cuda and qla_methods.keys() & set(args.methods):
        try:
            qla = flash_qla_call(cu_dev)
        except ImportError as e:
            for m in qla_methods.keys() & set(args.methods):
                table.add(dict(meta0, method=m, layout=qla_methods[m][0], W=qla_methods[m][1],
                               **{"pass": "fwd+bwd"}, note=f"n/a: {e}"))
        else:
            run("noCP-qla", "-", lambda *x: qla(*x)[0], None, 1)
    index = {lay: local_token_index(plans[lay][rank]).to(dev) for lay in layouts}
    if H % W:
        for p in args.passes:
            table.add(dict(meta0, method="cp2hp", layout="zigzag", W=W, **{"pass": p},
                           note=f"n/a: H={H} heads cannot be split over W={W} ranks"))
    else:
        run("cp2hp", "zigzag", cp2hp(kernel, plans["zigzag"][rank], dist.group.WORLD), index["zigzag"], W)
        if qla is not None:     # megatron-core's GDN where flash-qla is installed: fla hands it the kernel
            run("cp2hp-qla", "zigzag", cp2hp(lambda *x: qla(*x)[0], plans["zigzag"][rank], dist.group.WORLD),
                index["zigzag"], W)
    for layout in layouts:
        if layout not in args.layouts:
            continue
        plan = plans[layout][rank]
        for method, strategy in KCP_METHODS.items():
            backend = kcp_backend(method, model, b.cuda)
            if backend:
                run(method, layout, lambda *x, plan=plan, s=strategy, be=backend: kcp.gated_delta_rule(
                    *x, plan, dist.group.WORLD, use_qk_l2norm=True, backend=be, strategy=s), index[layout], W)
        if b.cuda and layout == "zigzag_per_doc" and len(cu) - 1 > args.fla_cp_max_docs:
            for p in args.passes:
                table.add(dict(meta0, method="fla-cp", layout=layout, W=W, **{"pass": p},
                               note=f"skipped: one fla CP call per document, {len(cu) - 1} > --fla-cp-max-docs"))
        elif b.cuda:
            run("fla-cp", layout, fla_cp(kernel, plan, cu, dist.group.WORLD, dev), index[layout], W)


def prewarm(b: Bench):
    """Autotune the single-GPU kernel shapes once, split over the ranks (each on its own GPU) so
    they compile side by side: fla keeps the winners on disk (TRITON_CACHE_DIR), where the other
    ranks find them instead of tuning again. The CP kernels tune in each method's own warm-up."""
    args, W = b.args, b.W
    shapes = sorted({(m, h) for m in args.models for H in args.heads for h in (H, H // W) if h == H or H % W == 0})
    T = args.tokens[0]
    cu = cu_seqlens("varlen", T)                   # every call passes cu_seqlens, so one kernel variant
    for model, h in shapes[b.rank::W]:
        t0 = time.time()
        xs, do = problem(model, T, h, args.head_dim, b.dtype, b.device, seed=0)
        leaves = fresh_leaves(xs)
        o = chunk_kernel(model, b.device)(*leaves, torch.tensor(cu, device=b.device), torch.tensor(cu))
        torch.autograd.grad(o, leaves, do)
        b.sync()
        print(f"[rank {b.rank}] tuned {model} H={h} T={T} in {time.time() - t0:.0f} s", flush=True)
    dist.barrier()


def run_ops(b: Bench, table: Table):
    """Every op-level case of the command line, in its order; --budget skips those left."""
    args = b.args
    if b.cuda and args.prewarm:
        prewarm(b)
    for T in args.tokens:
        for H in args.heads:
            for model in args.models:
                for docs in args.docs:
                    if b.out_of_time():
                        table.skipped(level="ops", model=model, tokens=T, docs=docs, heads=H, W=b.W)
                        continue
                    ops_case(b, model, T, docs, H, table)
