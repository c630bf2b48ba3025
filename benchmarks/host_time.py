"""Host time against kernel time of one rank's CP step on one GPU, and the step captured in a CUDA graph.

    python -m benchmarks predict host-time --shapes qwen3-next-tp2 qwen3-next h64-gdn kimi-linear --tokens 32768 131072
    python -m benchmarks predict host-time --smoke         # CPU, reference core, tiny sizes: checks the script

Every rank of W in turn runs its fwd+bwd of ``kcp.gated_delta_rule`` on its shard of one sequence (or
``--docs``) with its exchange stubbed as in ``simulate.py`` (nothing moves). Per rank (CSV columns):

* ``step_ms``: CUDA events around the step, median over ``--iters`` after ``--warmup``;
* ``host_ms``: the host's time to issue the step, from a synchronised start until the backward
  returns, nothing synchronised inside: where it reaches ``step_ms`` the GPU waits for the host;
* ``kernel_ms``, ``launches``: the GPU kernels of one step (torch.profiler), their summed time and count;
* ``graph_ms``: the same step captured once in a CUDA graph and replayed (the kernels without the
  host), or, where capture fails, empty and the reason in ``note``. The exchange is stubbed, so this is
  what a graph of the local work would give, not a captured collective.

``--peer`` adds, after each rank's row, a row for fla's own single-device call on the same tokens, the
rank's segments as its sequences (no exchange): what the library's call costs the host for the same work.

``--cprofile N`` also prints each rank's N costliest host functions (cProfile, one step); ``--gaps N`` its
N longest spans of GPU idle inside the step, each with the kernel that ends it (torch.profiler);
``--trace`` every kernel of the step in order, with its launch's host time.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import csv
import os
import pstats
import statistics
import time
from pathlib import Path


import torch

from benchmarks import simulate
from benchmarks.catalogue import cu_seqlens
from benchmarks.common import fresh_leaves
from benchmarks.perdoc import DOCS, SHAPES, TINY, inputs
from benchmarks.timing import kernel_time
from megatron_kcp.plan import LAYOUTS, build_plan, local_token_index

COLUMNS = ("model", "tokens", "docs", "heads", "W", "rank", "layout", "pipeline", "step_ms", "host_ms", "kernel_ms",
           "launches", "graph_ms", "note")


def rank_step(plan, xs, do, backend: str, max_segment: int | None = None):
    """``step()``: one rank's fwd+bwd with its exchange stubbed, returning the input gradients."""
    from megatron_kcp.ops import kcp
    idx = local_token_index(plan).to(do.device)
    leaves, dl = fresh_leaves(x[:, idx] for x in xs), do[:, idx].contiguous()
    stubs = simulate.Recorder(plan.world_size, cuda=False)       # host stamps only: nothing on the stream

    def step():
        with contextlib.ExitStack() as stack:
            for p in stubs.patches(plan.rank):
                stack.enter_context(p)
            stubs.points.clear(), stubs.stamps.clear()
            o = kcp.gated_delta_rule(*leaves, plan, simulate.NO_GROUP, use_qk_l2norm=True, backend=backend,
                                     max_segment=max_segment)
            return torch.autograd.grad(o, leaves, dl)
    return step


def peer_step(plan, xs, do):
    """``step()``: fla's single-device call on this rank's tokens, one sequence a local segment."""
    from megatron_kcp.kernels.core_fla import fla_chunk
    idx = local_token_index(plan).to(do.device)
    leaves, dl = fresh_leaves(x[:, idx] for x in xs), do[:, idx].contiguous()
    cpu = torch.tensor(plan.cu_seqlens, dtype=torch.long)
    cu = cpu.to(do.device)

    def step():
        o = fla_chunk(*leaves, initial_state=None, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cpu)
        return torch.autograd.grad(o, leaves, dl)
    return step


def measure(step, args, cuda: bool) -> dict:
    """step_ms, host_ms (see the module docstring), medians."""
    steps, hosts = [], []
    for i in range(args.warmup + args.iters):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        step()
        host = time.perf_counter() - t0
        if cuda:
            b.record()
            torch.cuda.synchronize()
            total = a.elapsed_time(b) / 1e3
        else:
            total = host
        if i >= args.warmup:
            steps.append(total), hosts.append(host)
    return dict(step_ms=1e3 * statistics.median(steps), host_ms=1e3 * statistics.median(hosts))


def kernels(step) -> tuple[float, int]:
    """(summed kernel seconds, kernel count) of one step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return kernel_time(prof)


def graphed(step, args) -> tuple[float | None, str]:
    """(median replay seconds, '') of the step captured in a CUDA graph, or (None, why not)."""
    from megatron_kcp.testing.graphs import capture
    try:
        g, _ = capture(step)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        torch.cuda.synchronize()
        return None, f"capture fails: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    times = []
    for i in range(args.warmup + args.iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(a.elapsed_time(b) / 1e3)
    del g
    return statistics.median(times), ""


def _kernel_trace(step):
    """(every kernel, memcpy and memset of one step in GPU order, {correlation id: its launch's host
    time}), in us, from torch.profiler's trace."""
    import json
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            events = json.load(fh)["traceEvents"]
    launch = {e["args"]["correlation"]: e["ts"] for e in events
              if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ks = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    return ks, launch


def gaps(step, rows: int) -> str:
    """Where the GPU waits for the host within one step: the ``rows`` longest idle spans between kernels
    (torch.profiler's trace), each with the kernel that ends it and how long after its launch it
    started. A kernel that starts within a few us of its launch after a gap waited for the host."""
    ks, launch = _kernel_trace(step)
    if not ks:
        return "no kernels"
    t0 = end = ks[0]["ts"]
    spans = []
    for e in ks:
        lag = e["ts"] - launch.get(e["args"].get("correlation"), e["ts"])
        spans.append((e["ts"] - end, e["ts"] - t0, lag, e["name"][:70]))
        end = max(end, e["ts"] + e["dur"])
    idle = sum(max(s[0], 0) for s in spans)
    lines = [f"GPU span {end - t0:.0f} us, busy {end - t0 - idle:.0f} us, idle {idle:.0f} us "
             "(profiled: the host is slower than unprofiled)",
             f"{'idle us':>8} {'at us':>8} {'lag us':>8}  next kernel"]
    for g, at, lag, name in sorted(spans, reverse=True)[:rows]:
        lines.append(f"{g:8.0f} {at:8.0f} {lag:8.0f}  {name}")
    return "\n".join(lines)


def trace(step) -> str:
    """Every kernel of one step in GPU order: when the host launched it and how long after the previous
    launch (us from the first launch), when it ran and for how long: which launches a step could do
    without, and where the host spends its time between them (profiled: the host is slower)."""
    ks, launch = _kernel_trace(step)
    if not ks:
        return "no kernels"
    hosts = [launch.get(e["args"].get("correlation"), e["ts"]) for e in ks]
    h0, g0 = min(hosts), ks[0]["ts"]
    lines = [f"{'#':>3} {'launch':>8} {'+host':>7} {'start':>8} {'dur':>7}  kernel (us)"]
    prev = h0
    for i, (e, h) in enumerate(zip(ks, hosts)):
        lines.append(f"{i:3d} {h - h0:8.0f} {h - prev:7.0f} {e['ts'] - g0:8.0f} {e['dur']:7.0f}  {e['name'][:80]}")
        prev = h
    return "\n".join(lines)


def host_profile(step, rows: int) -> str:
    """The ``rows`` costliest host functions of one step (cProfile), by own time and by time inside, in us
    (pstats prints seconds to three places, which rounds a launch's share to nothing)."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    stats = pstats.Stats(prof).stats        # (file, line, name): (primitive calls, calls, own s, inside s, callers)
    total = sum(v[2] for v in stats.values())
    lines = [f"{len(stats)} functions, {1e6 * total:.0f} us in all (profiled: the host is slower than unprofiled)"]
    for key, col in (("own", 2), ("inside", 3)):
        lines += [f"-- by time {key}", f"{'calls':>6} {'own us':>8} {'inside us':>9}  function"]
        for (file, line, name), v in sorted(stats.items(), key=lambda kv: -kv[1][col])[:rows]:
            where = name if file == "~" else f"{'/'.join(Path(file).parts[-3:])}:{line}({name})"
            lines.append(f"{v[1]:6d} {1e6 * v[2]:8.0f} {1e6 * v[3]:9.0f}  {where}")
    return "\n".join(lines)


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["qwen3-next-tp2", "qwen3-next", "h64-gdn"])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--docs", nargs="+", choices=list(DOCS), default=["single"])
    p.add_argument("--cp", type=int, nargs="+", default=[2])
    p.add_argument("--layout", choices=list(LAYOUTS), default="zigzag_per_doc",
                   help="the CP layout (default: Megatron's per-document zigzag)")
    p.add_argument("--backend", choices=["auto", "fla", "qla"], default="auto")
    p.add_argument("--max-segment", type=int, default=None,
                   help="split segments into parts of at most this many tokens (0: never; default: the kernels' pick)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph capture")
    p.add_argument("--peer", action="store_true",
                   help="also time fla's single-device call on each rank's segments (GPU)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print each rank's N costliest host functions")
    p.add_argument("--gaps", type=int, default=0, metavar="N", help="print each rank's N longest GPU idle spans")
    p.add_argument("--trace", action="store_true", help="print each rank's kernels in order, with their launch times")
    p.add_argument("--csv", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, reference core, tiny sizes: checks the script")
    args = p.parse_args(argv)
    if args.peer and args.smoke:
        p.error("--peer times fla's kernels, which need a GPU: drop --peer with --smoke")
    if args.smoke:
        args.tokens, args.warmup, args.iters, args.graph = [512], 0, 1, False
        shapes = {n: TINY[n] for n in args.shapes if n in TINY} or {"qwen3-next": TINY["qwen3-next"]}
    else:
        shapes = {n: SHAPES[n] for n in args.shapes}
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke for the CPU check")
    cuda = not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = args.backend if cuda else "reference"
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()
    from megatron_kcp.ops import dispatch
    from megatron_kcp.parallel.cost_model import pipeline_depth
    for name, s in shapes.items():
        for T in args.tokens:
            for docs in args.docs:
                xs, do = inputs(s, T, dtype, dev, seed=T)
                for W in args.cp:
                    cu = cu_seqlens(docs, T, pad=2 * W)
                    for r in range(W):
                        plan = build_plan(cu, args.layout, W, r)
                        d = dispatch.decide(plan, xs[0], xs[2], xs[3], backend, max_segment=args.max_segment)
                        groups = dispatch.build_core(d.core, xs[0], xs[2], xs[3]).min_group_heads
                        row = dict(model=s.model, tokens=T, docs=docs, heads=s.HV, W=W, rank=r, layout=args.layout,
                                   pipeline=pipeline_depth(plan, s.HV, s.H, s.K, groups)
                                   if d.strategy == "relay" else 1, note=d.describe())
                        what = f"{name} T={T} {docs} W={W} rank {r}"
                        report(row, lambda: rank_step(plan, xs, do, backend, args.max_segment), what, args, cuda)
                        if args.peer:
                            report(dict(row, pipeline="", note="peer: fla's single-device call on this rank's "
                                        "segments, no exchange"), lambda: peer_step(plan, xs, do), f"{what} peer",
                                   args, cuda)


def report(row: dict, make, what: str, args, cuda: bool) -> None:
    """Times the step ``make()`` builds into ``row`` (with its profiles, where asked), prints the row and
    appends it to the CSV."""
    try:
        step = make()
        row.update(measure(step, args, cuda))
        if cuda:
            k, n = kernels(step)
            row.update(kernel_ms=1e3 * k, launches=n)
            if args.graph:
                g, why = graphed(step, args)
                row.update(graph_ms="" if g is None else 1e3 * g)
                row["note"] += f"; {why}" if why else ""
        if cuda and args.gaps:
            print(f"== gaps {what}\n{gaps(step, args.gaps)}")
        if cuda and args.trace:
            print(f"== trace {what}\n{trace(step)}")
        if args.cprofile:
            print(f"== {what}\n{host_profile(step, args.cprofile)}")
    except torch.OutOfMemoryError:
        row["note"] += "; out of memory"
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.csv:
        with open(args.csv, "a", newline="") as f:
            csv.DictWriter(f, COLUMNS).writerow(row)
    if cuda:
        torch.cuda.empty_cache()
