"""Predicted CP step time of KCP on W GPUs from one GPU: each rank's local work timed alone, a modelled link.

    python -m benchmarks predict strategies --models GDN KDA --tokens 32768 --heads 64 --docs single varlen varlen100 \\
        --cp 2 4 --layouts contiguous zigzag zigzag_per_doc --strategies relay gather --backends fla qla --csv sim.csv
    python -m benchmarks predict strategies --smoke          # CPU, reference core, tiny sizes: checks the script

With one GPU, a CP=W step cannot be timed, but each rank's part of it can. For every rank in turn its
KCP forward+backward (``kcp.gated_delta_rule`` on its shard, the --backends cores on CUDA: fla's,
flash-qla's; the reference on CPU) runs with the
exchange stubbed: relay's ``P2P`` and gather's ``all_gather`` move nothing (a receive leaves zeros, an
all-gather returns W copies of the local buffer: the kernels cost the same whatever the states hold)
and mark the rank's timeline in stream order: ('send', peer, bytes), ('wait', peer), ('allgather',
bytes), ('alltoall', bytes) (the layout conversion's; its rows arrive as zeros), and ('phase',)
between forward and backward. fla's own CP all-gathers are stubbed alike. The compute between marks is timed with CUDA
events (CPU: perf_counter), median over --iters after --warmup calls (fla autotunes in the warm-up).

``simulate`` replays all ranks' timelines side by side over a link of latency alpha and bandwidth bw
(defaults: the fit to this project's 2 x H200 NVLink all-gathers, benchmarks/reports/): a send delivers at
t + alpha + bytes/bw and does not stall the sender; a wait stalls until the peer's next message has
arrived; an all-gather (ring) releases every rank at the last arrival + (W-1)(alpha + bytes/bw), an
all-to-all at the last arrival + alpha + (W-1)/W bytes/bw. The
prediction is the slowest rank's clock at the 'phase' mark (fwd) and at the end (fwd+bwd); eff =
t_noCP / (W t_pred), noCP being the same op at W=1 on the same device and core. Busy: a rank's compute; idle:
its time blocked (its end clock minus busy). Sent: bytes a rank puts on the link (ring all-gather:
W-1 times its buffer).

Left out: transfers taking SMs and memory bandwidth from the kernels, contention between pairs of
ranks, and host time that a real wait would hide (while a stream waits its host launches ahead; here
host-bound gaps count as compute).
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import itertools
import os
import statistics
import sys
import time
import types
from collections import defaultdict, deque
from unittest import mock


import torch

from benchmarks.catalogue import CONV, OP_DOCS as DOCS, cu_seqlens
from benchmarks.common import fresh_leaves, problem
from megatron_kcp.calibration import CALIBRATION
from megatron_kcp.parallel import gather, relay
from megatron_kcp.plan import LAYOUTS, build_plan, local_token_index

COLUMNS = ("model", "tokens", "docs", "heads", "W", "layout", "strategy", "backend", "noCP_fwd_ms", "noCP_ms",
           "pred_fwd_ms", "pred_ms", "eff_fwd", "eff", "slow_rank", "busy_ms", "idle_ms", "sent_bytes", "note")
NO_GROUP = object()            # the CP group KCP is given: only the stubs would use it, and they ignore it


class Recorder:
    """One rank's exchange, stubbed: nothing moves, every exchange point is a time stamp in stream order."""

    def __init__(self, W: int, cuda: bool):
        self.W, self.cuda, self.points, self.stamps = W, cuda, [], []

    def mark(self, *point):
        if self.cuda:
            self.stamps.append(torch.cuda.Event(enable_timing=True))
            self.stamps[-1].record()
        else:
            self.stamps.append(time.perf_counter())
        self.points.append(point)

    def seconds(self) -> list[float]:
        """Time between consecutive marks (synchronises on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.stamps, self.stamps[1:])]
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]

    def p2p(self, group):
        """Stands in for ``relay.P2P(group)``."""
        def send(sends):
            for peer, t in sends.items():
                self.mark("send", peer, t.nbytes)

        def recv(recvs):
            def wait():
                for peer, t in recvs.items():
                    self.mark("wait", peer)
                    t.zero_()
            return types.SimpleNamespace(wait=wait)
        return types.SimpleNamespace(send=send, recv=recv, finish=lambda: None)

    def all_gather(self, x, group):
        """Stands in for ``gather.all_gather``: ``[W, *x.shape]``, every rank's part a copy of ``x``."""
        self.mark("allgather", x.nbytes)
        return x.unsqueeze(0).expand(self.W, *x.shape).contiguous()

    def all_to_all_rows(self, x, send_counts, recv_counts, group):
        """Stands in for ``comm.all_to_all_rows``: the rows this rank would receive, as zeros."""
        self.mark("alltoall", x.nbytes)
        return x.new_zeros(sum(recv_counts), *x.shape[1:])

    def all_to_all(self, x, group):
        """Stands in for ``comm.all_to_all`` (the cp2hp strategy's): the blocks this rank would receive, as
        zeros."""
        self.mark("alltoall", x.nbytes)
        return torch.zeros_like(x)

    def fla_all_gather(self, inp, out=None, group=None, async_op=False):
        """Stands in for fla's CP all-gather (``fla.ops.cp.comm.all_gather_into_tensor``)."""
        self.mark("allgather", inp.nbytes)
        return inp.unsqueeze(0).expand(self.W, *inp.shape).contiguous(), None

    def patches(self, rank: int):
        """Every exchange point of KCP, its layout conversions (to the contiguous layout, to head shards) and
        fla's CP, stubbed for this rank."""
        from megatron_kcp.parallel import comm, cp2hp
        ps = [mock.patch.object(relay, "P2P", self.p2p), mock.patch.object(gather, "all_gather", self.all_gather),
              mock.patch.object(comm, "all_to_all_rows", self.all_to_all_rows),
              mock.patch.object(comm, "all_to_all", self.all_to_all),
              mock.patch.object(cp2hp, "all_to_all", self.all_to_all),
              mock.patch("torch.distributed.get_world_size", lambda group=None: self.W),
              mock.patch("torch.distributed.get_rank", lambda group=None: rank)]
        try:
            import fla.ops.cp.chunk_delta_h as fla_cp
            ps.append(mock.patch.object(fla_cp, "all_gather_into_tensor", self.fla_all_gather))
        except ImportError:
            pass
        return ps


def rank_timeline(plan, xs, do, strategy: str, backend: str, args, max_segment=None, fn=None) -> list[tuple]:
    """One rank's KCP fwd+bwd as a timeline: ('compute', seconds) between its exchange points.
    ``fn(*leaves)`` (default: ``kcp.gated_delta_rule`` with ``strategy``, ``backend``) is the step timed."""
    from megatron_kcp.ops import kcp
    idx = local_token_index(plan).to(do.device)
    leaves, dl = fresh_leaves(x[:, idx] for x in xs), do[:, idx].contiguous()
    backend = backend if do.is_cuda else "reference"
    if fn is None:
        def fn(*x):
            return kcp.gated_delta_rule(*x, plan, NO_GROUP, use_qk_l2norm=True, backend=backend, strategy=strategy,
                                        max_segment=max_segment)
    runs = []

    def step():
        rec = Recorder(plan.world_size, do.is_cuda)
        with contextlib.ExitStack() as stack:
            for p in rec.patches(plan.rank):
                stack.enter_context(p)
            rec.mark("start")
            o = fn(*leaves)
            rec.mark("phase")
            torch.autograd.grad(o, leaves, dl)
            rec.mark("end")
        return rec.points, rec.seconds()
    for i in range(args.warmup + args.iters):
        runs.append(step())
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if do.is_cuda else [])) as prof:
            step()
        print(f"\n== rank {plan.rank} of W={plan.world_size}, {plan.layout}, {strategy}, {backend}: one fwd+bwd",
              flush=True)
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if do.is_cuda else "self_cpu_time_total",
                                        row_limit=args.profile, max_name_column_width=70), flush=True)
    points, runs = runs[-1][0], runs[args.warmup:]
    if any(p != points for p, _ in runs):
        raise RuntimeError("the exchange points changed between iterations: the step is not deterministic")
    timeline = []
    for j, p in enumerate(points[1:]):
        timeline += [("compute", statistics.median(s[j] for _, s in runs))] + ([p] if p != ("end",) else [])
    return timeline


def simulate(timelines, alpha: float, bw: float):
    """(each rank's clock at its end, at its 'phase' mark or None) with the ranks running side by side.
    Raises if every unfinished rank is blocked: such timelines cannot come from one step."""
    W = len(timelines)
    clock, pos, phase, ngather = [0.0] * W, [0] * W, [None] * W, [0] * W
    inbox = defaultdict(deque)                   # (src, dst) -> arrival times, in send order
    gathers = defaultdict(dict)                  # k-th all-gather -> {rank: (arrival, bytes)}
    while any(p < len(tl) for p, tl in zip(pos, timelines)):
        moved = False
        for r, tl in enumerate(timelines):
            while pos[r] < len(tl):
                kind, *a = tl[pos[r]]
                if kind == "compute":
                    clock[r] += a[0]
                elif kind == "send":
                    inbox[r, a[0]].append(clock[r] + alpha + a[1] / bw)
                elif kind == "wait":
                    if not inbox[a[0], r]:
                        break
                    clock[r] = max(clock[r], inbox[a[0], r].popleft())
                elif kind in ("allgather", "alltoall"):
                    # collectives in issue order; a ring all-gather moves W - 1 buffers a rank, an all-to-all
                    # (W - 1) / W of one (each rank keeps its own share)
                    g = gathers[ngather[r]]
                    g[r] = (clock[r], a[0])
                    if len(g) < W:
                        break
                    n = max(n for _, n in g.values())
                    cost = (W - 1) * (alpha + n / bw) if kind == "allgather" else alpha + n * (W - 1) / W / bw
                    clock[r] = max(t for t, _ in g.values()) + cost
                    ngather[r] += 1
                elif kind == "phase":
                    phase[r] = clock[r]
                else:
                    raise ValueError(f"unknown timeline point {kind!r}")
                pos[r] += 1
                moved = True
        if not moved:
            states = "; ".join(f"rank {r} at {tl[pos[r]] if pos[r] < len(tl) else 'its end'}, "
                               f"t={clock[r] * 1e3:.3f} ms" for r, tl in enumerate(timelines))
            raise RuntimeError(f"deadlock: every unfinished rank is blocked ({states})")
    return clock, phase


def case(cu, W, layout, strategy, backend, xs, do, nocp, args) -> dict:
    """One row's numbers: every rank's timeline, simulated together; ``nocp`` = (fwd, fwd+bwd) seconds at W=1."""
    alpha, bw = args.alpha_us * 1e-6, args.bw_gbs * 1e9
    tls = [rank_timeline(build_plan(cu, layout, W, r, CONV), xs, do, strategy, backend, args, args.max_segment)
           for r in range(W)]
    ends, fwd = simulate(tls, alpha, bw)
    slow = max(range(W), key=ends.__getitem__)
    busy = sum(x[1] for x in tls[slow] if x[0] == "compute")
    sent = [sum(x[2] for x in tl if x[0] == "send") + (W - 1) * sum(x[1] for x in tl if x[0] == "allgather")
            for tl in tls]
    return dict(noCP_fwd_ms=nocp[0] * 1e3, noCP_ms=nocp[1] * 1e3, pred_fwd_ms=max(fwd) * 1e3,
                pred_ms=ends[slow] * 1e3, eff_fwd=nocp[0] / (W * max(fwd)), eff=nocp[1] / (W * ends[slow]),
                slow_rank=slow, busy_ms=busy * 1e3, idle_ms=(ends[slow] - busy) * 1e3,
                sent_bytes="/".join(map(str, sent)))


def show(r) -> str:
    """One printed row (the header's columns); a failed case shows its note."""
    head = (f"{r['model']:5s} {r['tokens']:7d} {r['docs']:9s} {r['heads']:4d} {r['W']:3d} {r['layout']:14s} "
            f"{r['strategy']:8s} {r['backend']:7s}")
    if r.get("note"):
        return f"{head} {r['note']}"
    mib = "/".join(f"{int(b) / 2**20:.2f}" for b in r["sent_bytes"].split("/"))
    ms = " ".join(f"{r[c]:9.3f}" for c in ("noCP_fwd_ms", "noCP_ms", "pred_fwd_ms", "pred_ms"))
    return f"{head} {ms} {r['eff_fwd']:7.3f} {r['eff']:6.3f} {r['busy_ms']:9.3f}/{r['idle_ms']:<9.3f} {mib}"


HEADER = (f"{'model':5s} {'tokens':>7s} {'docs':9s} {'H':>4s} {'W':>3s} {'layout':14s} {'strategy':8s} {'backend':7s} "
          f"{'noCP_fwd':>9s} {'noCP':>9s} {'pred_fwd':>9s} {'pred':>9s} {'eff_fwd':>7s} {'eff':>6s} "
          "busy/idle(slowest)  MiB sent per rank")


def add_link_args(p):
    """The link a replay runs over: --alpha-us and --bw-gbs, megatron_kcp.calibration's link by default."""
    p.add_argument("--alpha-us", type=float, default=CALIBRATION.link.latency * 1e6,
                   help="link latency per message (us; default: megatron_kcp.calibration's)")
    p.add_argument("--bw-gbs", type=float, default=CALIBRATION.link.bandwidth / 1e9,
                   help="link bandwidth (GB/s, 1e9 bytes; default: megatron_kcp.calibration's)")


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", nargs="+", choices=["GDN", "KDA"], default=["GDN", "KDA"])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, nargs="+", default=[64])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--docs", nargs="+", choices=list(DOCS), default=list(DOCS))
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="CP sizes W to predict (any, on one device)")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--strategies", nargs="+", choices=["relay", "gather"], default=["relay", "gather"])
    p.add_argument("--backends", nargs="+", choices=["fla", "qla"], default=["fla"],
                   help="local cores (qla: flash-qla's fused GDN kernels, maps from its state passes); on CPU "
                        "the reference stands in for fla")
    p.add_argument("--max-segment", type=int, default=None,
                   help="cut every segment into parts of at most this many tokens (gather only; 0: never; "
                        "default: the kernels' pick, dispatch.qla_max_segment); noCP is never cut")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    add_link_args(p)
    p.add_argument("--csv", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also print each rank's kernel table (torch.profiler, one step), ROWS kernels")
    p.add_argument("--smoke", action="store_true", help="CPU, reference core, tiny sizes: checks the script")
    args = p.parse_args(argv)
    if args.smoke and "qla" in args.backends:
        p.error("--backends qla needs a Hopper or Blackwell GPU (flash-qla has no CPU kernels): drop it with --smoke")
    if args.smoke:                                    # tiny sizes where not given; 100 documents need more tokens
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        tiny = {"--tokens": [256], "--heads": [2], "--head-dim": 16, "--dtype": "float32", "--cp": [2],
                "--warmup": 0, "--iters": 1, "--docs": ["single", "varlen"]}
        for flag, value in tiny.items():
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    os.environ.setdefault("FLA_FLASH_QLA", "0")       # fla would send GDN to flash-qla; our core runs fla's Triton
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke for the CPU check")
    dev = torch.device("cpu" if args.smoke else "cuda")
    print(f"{'CPU smoke (reference core)' if args.smoke else torch.cuda.get_device_name()}; link alpha="
          f"{args.alpha_us:g} us, bw={args.bw_gbs:g} GB/s; ms, medians of {args.iters} after {args.warmup} warm-up"
          f"\n{HEADER}", flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()
    return run(args, dev)


def run(args, dev) -> list[dict]:
    """Every case of the command line, in its order; rows are printed and appended to --csv as they finish."""
    rows = []
    for model, T, H in itertools.product(args.models, args.tokens, args.heads):
        xs, do = problem(model, T, H, args.head_dim, getattr(torch, args.dtype), dev, seed=T + H)
        nocp = {}                                      # (fwd, fwd+bwd) seconds at W=1, per cu_seqlens and core
        cases = itertools.product(args.docs, args.cp, args.layouts, args.backends, args.strategies)
        for docs, W, layout, backend, strategy in cases:
            row = dict(model=model, tokens=T, docs=docs, heads=H, W=W, layout=layout, strategy=strategy,
                       backend=backend)
            try:
                cu = cu_seqlens(docs, T, pad=2 * W)
                if (cu, backend) not in nocp:
                    tl = rank_timeline(build_plan(cu, "contiguous", 1, 0, CONV), xs, do, "relay", backend, args, 0)
                    (end,), (fwd,) = simulate([tl], 0.0, 1.0)
                    nocp[cu, backend] = fwd, end
                row.update(case(cu, W, layout, strategy, backend, xs, do, nocp[cu, backend], args))
            except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
                row["note"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            print(show(row), flush=True)
            rows.append(row)
            if args.csv:
                with open(args.csv, "a", newline="") as f:
                    csv.DictWriter(f, COLUMNS).writerow(row)
        del xs, do
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows
