"""CP benchmark, op and layer level: KCP beside no CP, fla's own CP and megatron-core's cp2hp.

    python benchmarks/bench_ops.py --cp 2 --tokens 32768 131072 262144 --heads 16 --csv ops.csv
    python benchmarks/bench_ops.py --what layers --cp 2 --tokens 32768 --csv layers.csv
    python benchmarks/bench_ops.py --smoke --what ops layers --csv /tmp/smoke.csv   # CPU, seconds

Op level (``--what ops``): per model (GDN, KDA), total tokens T, documents (``single``: one
sequence; ``varlen``: the 10-document cu_seqlens of VARLEN_32K, boundaries scaled by T / 32768),
heads H (K = V = --head-dim) and pass (fwd, fwd+bwd), one row per method:

* ``noCP``   the whole problem on one GPU (every rank runs it; the slowest rank counts);
* ``cp2hp``  megatron-core GatedDeltaNet's scheme: one all-to-all of [q|k|v|g|beta] from sequence
             shards (zigzag) to head shards (each rank: the whole sequence, H/W heads), fla's chunk
             kernel, one all-to-all of o back; backward runs the same two in reverse;
* ``kcp``    ``megatron_kcp.ops.kcp.gated_delta_rule`` (backend fla) on Megatron's zigzag layout
             and on the contiguous one;
* ``fla-cp`` fla's own CP called directly, as fla's CP tests do: ``build_cp_context`` (contiguous
             split) and ``chunk_gated_delta_rule`` / ``chunk_kda`` with ``cp_context``.

Layer level (``--what layers``, one sequence of T tokens, hidden size --hidden, H q/k and v heads):
KCPGatedDeltaNet and megatron-core 0.19's GatedDeltaNet with the same config and weights (CP=1
rows ``noCP`` / ``megatron``, CP=W rows ``kcp`` / ``cp2hp``), and the KDA mixer at CP=1 and CP=W;
fwd+bwd; Megatron's local layers (no TransformerEngine), bf16 weights.

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
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import socket
import statistics
import sys
import time
import traceback
import warnings
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]        # megatron_kcp and tests (repo root), plot.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

VARLEN_32K = (0, 2960, 5212, 9513, 13567, 17443, 20634, 23521, 26281, 31785, 32768)
COLUMNS = ("level", "model", "pass", "tokens", "docs", "heads", "W", "method", "layout", "ms", "eff", "x_cp2hp",
           "peak_mib", "xchg_bytes", "xchg_calls", "exchange_ms", "err", "note", "head_dim", "dtype")
CONV = 4                                           # conv kernel size the plans carry (halo of 3 tokens)


def cu_seqlens(docs: str, T: int) -> tuple[int, ...]:
    if docs == "single":
        return (0, T)
    cu = tuple(round(c * T / VARLEN_32K[-1]) for c in VARLEN_32K)
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"T={T} is too short for the 10-document varlen set: use --tokens >= 512")
    return cu


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp64, in slices (a 256k-token output in fp64 would be gigabytes)."""
    num = den = 0.0
    for x, y in zip(a.reshape(-1).split(1 << 24), b.reshape(-1).split(1 << 24)):
        x, y = x.double(), y.double()
        num += (x - y).square().sum().item()
        den += y.square().sum().item()
    return math.sqrt(num / max(den, 1e-60))


def problem(model, T, H, K, dtype, device, seed):
    """q, k, v, g, beta [1, T, H(, K)] and do, as the mixers feed the kernel: g (log decay) in fp32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    like = dict(device=device, dtype=dtype, generator=gen)
    xs = [torch.randn(1, T, H, K, **like) for _ in range(3)]
    g = torch.randn(1, T, H, *((K,) if model == "KDA" else ()), device=device, generator=gen)
    xs += [torch.nn.functional.logsigmoid(g), torch.rand(1, T, H, **like)]
    return xs, torch.randn(1, T, H, K, **like)


# ---------------------------------------------------------------- the methods (op level)

def chunk_kernel(model: str, device: torch.device):
    """o = run(q, k, v, g, beta, cu, cu_cpu, cp_context=None): fla's chunk kernel on CUDA, the
    pure-torch chunked reference on CPU (no CP context there)."""
    if device.type == "cpu":
        from megatron_kcp.ops import reference

        def run(q, k, v, g, beta, cu=None, cu_cpu=None, cp_context=None):
            return reference.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, cu_seqlens=cu_cpu)[0]
        return run
    if model == "KDA":
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

    def run(q, k, v, g, beta, cu=None, cu_cpu=None, cp_context=None):
        return fn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                  cp_context=cp_context)[0]
    return run


def _all_to_all(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Equal blocks along dim 0, block j to rank j. The exchange is its own adjoint, so backward
    sends the gradient through the same all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_to_all(dy, ctx.group), None


class CP2HP:
    """megatron-core GatedDeltaNet's CP on the op: sequence shards -> head shards -> kernel -> back.

    ``plans`` are every rank's zigzag plans: the all-to-all delivers the W shards in rank order,
    ``inv`` puts their tokens back in stream order for the kernel (Megatron's undo of the attention
    load balancing), ``pos`` the other way."""

    def __init__(self, kernel, plans, cu, group, device):
        from megatron_kcp.parallel.plan import local_token_index
        pos = torch.cat([local_token_index(p) for p in plans])     # gathered row -> stream position
        self.pos, self.inv = pos.to(device), torch.argsort(pos).to(device)
        self.cu, self.cu_cpu = torch.tensor(cu, device=device), torch.tensor(cu)
        self.kernel, self.group, self.W = kernel, group, len(plans)

    def __call__(self, q, k, v, g, beta):
        W, (_, Tl, H, _), gdn = self.W, q.shape, g.dim() == 3
        q, k, v, g, beta = SeqToHeads.apply(self, q, k, v, g[..., None] if gdn else g, beta[..., None])
        o = self.kernel(q, k, v, g[..., 0] if gdn else g, beta[..., 0], self.cu, self.cu_cpu)[0]   # [T, H/W, V]
        o = o.index_select(0, self.pos).view(W, Tl, H // W, -1)
        return AllToAll.apply(o, self.group).transpose(0, 1).reshape(1, Tl, H, -1)

    def to_heads(self, xs):
        """[1, T/W, H, d_i] (this rank's tokens, all heads) -> [1, T, H/W, d_i] (all tokens, my heads)."""
        W, (_, Tl, H, _), wire = self.W, xs[0].shape, xs[0].dtype
        bits = [x[0] if x.dtype == wire else x[0].view(wire) for x in xs]
        y = torch.cat([x.reshape(Tl, W, H // W, -1) for x in bits], -1).transpose(0, 1)       # [W, T/W, H/W, D]
        y = _all_to_all(y, self.group).flatten(0, 1).index_select(0, self.inv)
        return [t.contiguous().view(x.dtype)[None] for t, x in zip(y.split([b.shape[-1] for b in bits], -1), xs)]

    def to_seq(self, grads, meta):
        """The way back, for the gradients: [1, T, H/W, d_i] -> [1, T/W, H, d_i]; ``meta`` holds the
        inputs' (shape, dtype), the first one's dtype being the wire's."""
        W, (_, Tl, H, _), wire = self.W, meta[0][0], meta[0][1]
        bits = [(d if d is not None else torch.zeros(1, Tl * W, H // W, s[-1], dtype=t, device=self.pos.device))[0]
                for d, (s, t) in zip(grads, meta)]
        bits = [d if d.dtype == wire else d.view(wire) for d in bits]
        y = torch.cat(bits, -1).index_select(0, self.pos).view(W, Tl, H // W, -1)
        y = _all_to_all(y, self.group).transpose(0, 1)                                          # [T/W, W, H/W, D]
        return [t.reshape(Tl, H, -1).contiguous().view(dt)[None]
                for t, (_, dt) in zip(y.split([b.shape[-1] for b in bits], -1), meta)]


class SeqToHeads(torch.autograd.Function):
    """CP2HP.to_heads with its exact adjoint as backward: one fused all-to-all each way, as Megatron
    sends its fused in_proj output. Inputs of another dtype than q (the fp32 gate) travel as pairs of
    q's dtype: every step is a copy, so their bits arrive unchanged both ways."""

    @staticmethod
    def forward(ctx, cp, *xs):
        ctx.cp, ctx.meta = cp, [(tuple(x.shape), x.dtype) for x in xs]
        return tuple(cp.to_heads(xs))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.cp.to_seq(grads, ctx.meta))


# ---------------------------------------------------------------- timing, memory, collectives

class CommLog:
    """The collectives one call issues: bytes this rank receives, and a replay of them alone."""
    NAMES = ("all_gather_into_tensor", "all_to_all_single", "all_reduce")

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.orig = {n: getattr(dist, n) for n in self.NAMES}
        for n, fn in self.orig.items():
            setattr(dist, n, self._spy(n, fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self.orig.items():
            setattr(dist, n, fn)

    def _spy(self, name, fn):
        def call(*args, **kw):
            group = kw.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if dist.get_world_size(group) > 1:
                self.calls.append((name, fn, args, kw, dist.get_world_size(group)))
            return fn(*args, **kw)
        return call

    @property
    def received_bytes(self) -> int:
        total = 0
        for name, _, args, kw, W in self.calls:
            t = [a for a in list(args) + list(kw.values()) if isinstance(a, torch.Tensor)]
            if name == "all_gather_into_tensor":
                total += t[0].nbytes - t[1].nbytes
            elif name == "all_to_all_single":
                total += t[0].nbytes * (W - 1) // W
            else:                                      # ring all-reduce: reduce-scatter + all-gather
                total += 2 * t[0].nbytes * (W - 1) // W
        return total

    def replay(self):
        """A step issuing the same collectives on fresh buffers of the same shapes."""
        def fresh(a):
            return torch.zeros_like(a) if isinstance(a, torch.Tensor) else a
        calls = [(fn, [fresh(a) for a in args], {k: fresh(v) for k, v in kw.items() if k != "async_op"})
                 for _, fn, args, kw, _ in self.calls]

        def step():
            for fn, args, kw in calls:
                fn(*args, **kw)
        return step


class Bench:
    """One rank's measuring kit: device, clock, reductions over ranks, the time budget."""

    def __init__(self, args, device, W, rank):
        self.args, self.device, self.W, self.rank = args, device, W, rank
        self.cuda = device.type == "cuda"
        self.dtype = getattr(torch, args.dtype)
        self.deadline = args.deadline

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def max_over_ranks(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def out_of_time(self) -> bool:
        """Rank 0's clock decides, so every rank skips the same cases."""
        flag = torch.tensor([float(time.time() > self.deadline)], device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def _once(self, step) -> float:
        self.sync()
        dist.barrier()
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            step()
            return (time.perf_counter() - t0) * 1e3
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def measure(self, step, input_bytes=0):
        """(median ms of the slowest rank, peak MiB); warm-up first keeps autotuning out."""
        for _ in range(self.args.warmup):
            step()
        self.sync()
        if self.cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times = [self._once(step) for _ in range(self.args.iters)]
        peak = (torch.cuda.max_memory_allocated() - base + input_bytes) / 2**20 if self.cuda else 0.0
        t = self.max_over_ranks(times + [peak])
        return statistics.median(t[:-1]), (t[-1] if self.cuda else math.nan)

    def exchange(self, step):
        """(received bytes, calls, ms of the collectives alone) of one call of ``step``."""
        with CommLog() as log:
            step()
        self.sync()
        if not log.calls:
            return 0, 0, math.nan
        return log.received_bytes, len(log.calls), self.measure(log.replay())[0]

    def rows(self, meta, make_step, input_bytes, err, passes):
        """One row per pass; make_step(pass) -> a callable doing one forward (+ backward)."""
        out = []
        for pas in passes:
            step = make_step(pas)
            ms, peak = self.measure(step, input_bytes[pas])
            xb, xc, xms = self.exchange(step) if meta["W"] > 1 else (0, 0, math.nan)
            out.append(dict(meta, **{"pass": pas}, ms=ms, peak_mib=peak, xchg_bytes=xb, xchg_calls=xc,
                            exchange_ms=xms, err=err))
        return out

    def failed(self, meta, passes, e):
        traceback.print_exc()
        note = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        return [dict(meta, **{"pass": p}, note=note) for p in passes]


def _leaves(xs):
    return [x.detach().clone().requires_grad_() for x in xs]


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


def ops_case(b: Bench, model, T, docs, H, table):
    """Every method of one (model, T, docs, H); rows go to ``table`` (rank 0) as they finish."""
    from megatron_kcp.ops import kcp
    from megatron_kcp.parallel.plan import build_plan, local_token_index
    args, W, rank, dev = b.args, b.W, b.rank, b.device
    cu = cu_seqlens(docs, T)
    cu_dev, cu_cpu = torch.tensor(cu, device=dev), torch.tensor(cu)
    xs, do = problem(model, T, H, args.head_dim, b.dtype, dev, seed=T + H + (model == "KDA"))
    kernel = chunk_kernel(model, dev)
    plans = {lay: [build_plan(cu, lay, W, r, CONV) for r in range(W)] for lay in ("zigzag", "contiguous")}
    meta0 = dict(level="ops", model=model, tokens=T, docs=docs, heads=H)

    def run(method, layout, fn, idx, width):
        meta = dict(meta0, method=method, layout=layout, W=width)
        if method not in args.methods:
            return
        pick = (lambda t: t) if idx is None else (lambda t: t[:, idx])
        try:
            leaves = _leaves(pick(x) for x in xs)
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

    leaves = _leaves(xs)
    o_ref = kernel(*leaves, cu_dev, cu_cpu)
    grads_ref = torch.autograd.grad(o_ref, leaves, do) if "fwd+bwd" in args.passes else ()
    o_ref, leaves = o_ref.detach(), None
    run("noCP", "-", lambda *x: kernel(*x, cu_dev, cu_cpu), None, 1)
    zz = local_token_index(plans["zigzag"][rank]).to(dev)
    ct = local_token_index(plans["contiguous"][rank]).to(dev)
    if H % W:
        for p in args.passes:
            table.add(dict(meta0, method="cp2hp", layout="zigzag", W=W, **{"pass": p},
                           note=f"n/a: H={H} heads cannot be split over W={W} ranks"))
    else:
        run("cp2hp", "zigzag", CP2HP(kernel, plans["zigzag"], cu, dist.group.WORLD, dev), zz, W)
    backend = "fla" if b.cuda else "reference"
    for layout, idx in (("zigzag", zz), ("contiguous", ct)):
        if layout in args.layouts:
            plan = plans[layout][rank]
            run("kcp", layout, lambda *x, plan=plan: kcp.gated_delta_rule(*x, plan, dist.group.WORLD,
                                                                          use_qk_l2norm=True, backend=backend),
                idx, W)
    if b.cuda:
        from fla.ops.cp import build_cp_context
        ctx = build_cp_context(cu_dev, group=dist.group.WORLD, cu_seqlens_cpu=cu_cpu)
        run("fla-cp", "contiguous", lambda *x: kernel(*x, cp_context=ctx), ct, W)


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
        leaves = _leaves(xs)
        o = chunk_kernel(model, b.device)(*leaves, torch.tensor(cu, device=b.device), torch.tensor(cu))
        torch.autograd.grad(o, leaves, do)
        b.sync()
        print(f"[rank {b.rank}] tuned {model} H={h} T={T} in {time.time() - t0:.0f} s", flush=True)
    dist.barrier()


# ---------------------------------------------------------------- layer level

def layers_case(b: Bench, model, T, H, table, solo):
    """The mixers at CP=1 and CP=W with the same weights, fwd+bwd."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    from tests.layers.harness import Shape, build, config, zigzag_rows
    args, W, rank, dev = b.args, b.W, b.rank, b.device
    shape = Shape(hidden=args.hidden, heads=(H, H), head_dim=args.head_dim, seq=T, batch=1, device=dev.type)
    kw = dict(bf16=True, params_dtype=torch.bfloat16) if b.dtype == torch.bfloat16 else {}
    if not b.cuda:
        kw["deterministic_mode"] = True          # megatron's pure-torch GDN path (fla's kernels need CUDA)
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    gen = torch.Generator(device=dev).manual_seed(T + H)
    x, dy = (torch.randn(T, 1, args.hidden, generator=gen, device=dev, dtype=b.dtype) for _ in range(2))
    m = model.lower()
    variants = [("noCP", 1, None), ("kcp", W, None)]
    if model == "GDN":
        variants = [("megatron", 1, GatedDeltaNet), ("noCP", 1, KCPGatedDeltaNet),
                    ("cp2hp", W, GatedDeltaNet), ("kcp", W, KCPGatedDeltaNet)]
    state, y_ref, dx_ref = None, None, None
    for method, cp, cls in variants:
        meta = dict(level="layers", model=model, tokens=T, docs="single", heads=H, method=method,
                    layout="zigzag" if cp > 1 else "-", W=cp)
        try:
            mod = build(m, config(m, shape, cp, **kw), solo if cp == 1 else mpu, dev.type, cls=cls).to(b.dtype)
            if state is None:
                state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mod.state_dict().items()}
            mod.load_state_dict(state)
            local = (lambda t: t) if cp == 1 else (lambda t: zigzag_rows(t, W, rank))
            leaf, dyl = local(x).clone().requires_grad_(), local(dy).contiguous()

            def step():
                for p in [leaf, *mod.parameters()]:
                    p.grad = None
                y, _ = mod(leaf, None)
                y.backward(dyl)
                return y
            y = step().detach()                  # first call: output and input gradient against CP=1's
            if y_ref is None:
                y_ref, dx_ref = y, leaf.grad.clone()
            err = b.max_over_ranks([max(rel_err(y, local(y_ref)), rel_err(leaf.grad, local(dx_ref)))])[0]
            rows = b.rows(meta, lambda pas: step, {"fwd+bwd": leaf.nbytes + dyl.nbytes}, err, ["fwd+bwd"])
        except Exception as e:  # noqa: BLE001 - e.g. megatron's module refusing a config: say why
            rows = b.failed(meta, ["fwd+bwd"], e)
        for r in rows:
            table.add(r)
        mod = step = None                        # free this variant before building the next
        if b.cuda:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- table and ranks

class Table:
    """Rank 0's rows: fills eff and x_cp2hp, prints each row, appends it to the CSV."""
    FMT = "{model:5} {pass:7} {tokens:>7} {docs:6} {heads:>3} {W:>2} {method:8} {layout:10} {ms:>9} {eff:>5} " \
          "{x_cp2hp:>7} {peak_mib:>9} {xchg:>8} {exchange_ms:>8} {err:>8}  {note}"

    def __init__(self, args, path, show):
        self.args, self.path, self.show, self.rows = args, path, show, []

    def header(self):
        return self.FMT.format(**{c: c for c in COLUMNS}, xchg="xchg_MiB")

    def add(self, row):
        row = {c: row.get(c, math.nan if c not in ("note", "layout") else "") for c in COLUMNS}
        row.update(head_dim=self.args.head_dim, dtype=self.args.dtype)
        case = ("level", "model", "pass", "tokens", "docs", "heads")
        same = [r for r in self.rows if all(r[c] == row[c] for c in case)]
        base_method = "megatron" if row["method"] == "cp2hp" and row["level"] == "layers" else "noCP"
        base = next((r["ms"] for r in same if r["method"] == base_method), math.nan)
        cp2hp = next((r["ms"] for r in same if r["method"] == "cp2hp" and r["W"] == row["W"]), math.nan)
        if row["method"] == "cp2hp":
            cp2hp = row["ms"]
        if row["W"] == 1:
            base = row["ms"]                      # CP=1 rows are their own reference
        ok = row["ms"] > 0                        # False for nan: a failed or skipped row
        row["eff"] = base / (row["W"] * row["ms"]) if ok else math.nan
        row["x_cp2hp"] = cp2hp / row["ms"] if ok and row["W"] > 1 else math.nan
        self.rows.append(row)
        if self.show:
            print(self.line(row), flush=True)
        if self.path:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, COLUMNS).writerow({c: _fmt(row[c], 6) for c in COLUMNS})

    def line(self, r):
        def f(x, d):
            if not isinstance(x, float):
                return x
            return f"{x:.{d}f}" if math.isfinite(x) else "-"
        return self.FMT.format(**{**r, "ms": f(r["ms"], 3), "eff": f(r["eff"], 2), "x_cp2hp": f(r["x_cp2hp"], 2),
                                  "peak_mib": f(r["peak_mib"], 0), "exchange_ms": f(r["exchange_ms"], 3),
                                  "err": f"{r['err']:.1e}" if math.isfinite(r["err"]) else "-",
                                  "xchg": f(r["xchg_bytes"] / 2**20, 2) if math.isfinite(r["xchg_bytes"]) else "-"})

    def print_all(self, title):
        print(f"\nall rows:\n{title}\n{self.header()}")
        for r in self.rows:
            print(self.line(r))
        print(flush=True)


def _fmt(x, digits):
    return f"{x:.{digits}g}" if isinstance(x, float) and math.isfinite(x) else ("" if isinstance(x, float) else x)


def describe(args, W) -> str:
    def v(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "-"
    if args.device == "cuda":
        nccl = torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        dev = f"{torch.cuda.get_device_name()} x {torch.cuda.device_count()}, CUDA {torch.version.cuda}, NCCL {nccl}"
    else:
        dev = "CPU (smoke run: reference kernels over gloo, not a measurement)"
    return (f"{dev}; torch {torch.__version__}, triton {v('triton')}, fla-core {v('fla-core')}, megatron-core "
            f"{v('megatron-core')}\nW={W}, {args.dtype}, K=V={args.head_dim}, median of {args.iters} after "
            f"{args.warmup} warm-up per shape, slowest rank; varlen = VARLEN_32K scaled by T/32768")


def worker(rank, W, port, args):
    warnings.simplefilter("ignore")              # library deprecation chatter would bury the table
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(W),
                      LOCAL_RANK=str(rank))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=W, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=W)
    b = Bench(args, device, W, rank)
    table = Table(args, args.csv if rank == 0 else None, show=rank == 0)
    if rank == 0:
        print(f"\n{describe(args, W)}\n{table.header()}", flush=True)
    try:
        if "ops" in args.what:
            if b.cuda and args.prewarm:
                prewarm(b)
            for T in args.tokens:
                for H in args.heads:
                    for model in args.models:
                        for docs in args.docs:
                            if b.out_of_time():
                                table.add(dict(level="ops", model=model, tokens=T, docs=docs, heads=H, W=W,
                                               method="-", note="skipped: --budget spent", **{"pass": "-"}))
                                continue
                            ops_case(b, model, T, docs, H, table)
        if "layers" in args.what:
            from megatron.core import parallel_state as ps

            from tests.layers.harness import solo_pg
            if not b.cuda:
                import megatron.core.ssm.gated_delta_net.common as common

                from megatron_kcp.ops.reference import l2norm
                common.l2norm = l2norm           # fla's l2norm is a Triton kernel; megatron's CPU path needs this one
            ps.initialize_model_parallel(context_parallel_size=W)
            solo = solo_pg()
            for T in args.tokens:
                for model in args.models:
                    if b.out_of_time():
                        table.add(dict(level="layers", model=model, tokens=T, docs="single", heads=args.heads[0],
                                       W=W, method="-", note="skipped: --budget spent", **{"pass": "-"}))
                        continue
                    layers_case(b, model, T, args.heads[0], table, solo)
        if rank == 0:
            table.print_all(describe(args, W))
    finally:
        dist.destroy_process_group()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--what", nargs="+", choices=["ops", "layers"], default=["ops"])
    p.add_argument("--cp", type=int, nargs="+", default=None, help="CP sizes W (default: the number of GPUs)")
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="layer level: hidden size")
    p.add_argument("--models", nargs="+", choices=["GDN", "KDA"], default=["GDN", "KDA"])
    p.add_argument("--docs", nargs="+", choices=["single", "varlen"], default=["single", "varlen"])
    p.add_argument("--passes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"])
    p.add_argument("--layouts", nargs="+", choices=["zigzag", "contiguous"], default=["zigzag", "contiguous"],
                   help="layouts of the kcp rows")
    p.add_argument("--methods", nargs="+", default=["noCP", "cp2hp", "kcp", "fla-cp"])
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="do not tune the single-GPU shapes first, split over the ranks")
    p.add_argument("--budget", type=float, default=None, help="seconds; cases left after it are skipped")
    p.add_argument("--csv", default=None)
    p.add_argument("--png", default=None, help="default: next to --csv (needs matplotlib)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes: checks the script, measures nothing")
    args = p.parse_args(argv)
    if args.smoke:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        tiny = {"--tokens": [128], "--heads": [2], "--head-dim": 16, "--hidden": 32, "--dtype": "float32",
                "--warmup": 1, "--iters": 2, "--cp": [2]}
        for flag, value in tiny.items():
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
        args.device = "cpu"
    if "noCP" not in args.methods:
        args.methods.append("noCP")                # every other row is measured against it
    args.deadline = time.time() + (args.budget if args.budget is not None else 1e9)
    return args


def main(argv=None):
    args = parse(argv)
    if args.device == "cpu":
        os.environ["TORCHDYNAMO_DISABLE"] = "1"    # megatron's torch.compile fusions: CPU compile time, no use here
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke (or --device cpu) for the CPU check")
    ngpu = torch.cuda.device_count() if args.device == "cuda" else 0
    cps = args.cp or [ngpu]
    for W in cps:
        if W < 2:
            raise SystemExit(f"--cp {W}: CP needs at least 2 ranks (found {ngpu} GPUs); pass --cp 2 or more")
        if args.device == "cuda" and W > ngpu:
            raise SystemExit(f"CP={W} needs {W} GPUs for timings (one per rank), found {ngpu}: use --cp {ngpu} "
                             "or a machine with more GPUs")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            csv.DictWriter(f, COLUMNS).writeheader()
    for W in cps:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(worker, args=(W, port, args), nprocs=W, start_method="spawn")
    if args.csv and "ops" in args.what:
        from plot import plot, read_rows
        print(plot(read_rows(args.csv), args.png or str(Path(args.csv).with_suffix(".png"))))


if __name__ == "__main__":
    main()
