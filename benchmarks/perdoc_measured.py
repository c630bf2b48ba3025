"""Packed documents and one long sequence on W GPUs, measured: op, mixer and hybrid-block level.

    python -m benchmarks run matrix --shapes qwen3-next kimi-linear --tokens 32768 \\
        --csv benchmarks/results/perdoc_h200x2.csv                 # W = every GPU, one rank each (NCCL)
    python -m benchmarks run matrix --docs single --levels ops --shapes qwen3-next qwen3-next-tp2 h64-gdn \\
        kimi-linear --tokens 32768 131072 --methods noCP noCP-qla cp2hp cp2hp-qla fla-cp kcp-unpipelined kcp \\
        --csv benchmarks/results/single_h200x2.csv
    python -m benchmarks run matrix --smoke                    # CPU, 2 gloo ranks, tiny: checks the script

The cases and methods of ``perdoc.py`` (which predicts them from one GPU), run for real: every rank on
its own GPU, the collectives over NCCL, Megatron's per-document zigzag of a THD pack (``--docs``: one
sequence, 10, 100 or 300 documents, each a multiple of 2W tokens), fwd+bwd, the median over
``--iters`` of the slowest rank after ``--warmup`` untimed calls (``source`` = measured). Every
method computes the same function: ``err`` is its largest relative error (output, input gradients)
against the one-device run's rows; where one GPU cannot run the whole pack (out of memory: 1M tokens on an
H100), against fla's CP call (contiguous, gathered), and ``note`` says so.

* ops: the gated delta rule on this rank's rows of q, k, v, g, beta. ``noCP`` / ``noCP-qla``: fla's /
  flash-qla's call on the whole pack (every rank); ``cp2hp`` / ``cp2hp-qla``: megatron-core's
  all-to-all to head shards around either call (``megatron_kcp/parallel/cp2hp.py``); ``mlm-chunkwise``:
  Megatron-LM dev's scheme, an all-to-all of the op's inputs to the contiguous layout, fla's CP call
  (``build_cp_context``) and back; ``fla-cp``: fla's CP call on the same documents fed contiguous;
  ``kcp-noconvert``, ``kcp-unpipelined``, ``kcp``: ours (``KCP_CONVERT=0``; ``KCP_RELAY_GROUPS=1``; the
  default, its pick in ``note``); ``kcp-gather`` (by name, every level): the default with
  ``KCP_STRATEGY=gather``, our all-gather step where the default picks another (fla's CP call for KDA
  on the contiguous layout); ``kcp-contiguous`` (by name, every level): the default fed the same
  documents in the contiguous layout, no conversion (the peer of "per-document zigzag within 1.1x of
  contiguous"; the block still moves its run's output back for the softmax layer); ``kcp-convert`` (by
  name): ours converting the op's inputs (``KCP_CONVERT=1``), to time the pick the cost model did not
  make; ``kcp-graph`` (by name): the default's step with its exchange captured once in a CUDA graph
  and replayed (the plan's documents fixed, as capture needs);
  ``kcp-foldloop`` and ``kcp-ownstart`` (by name): the default with one part changed, as in perdoc.py
  (``perdoc.peer``); ``kcp-ownstart-graph``: the second captured, the peer of ``kcp-graph``.
* mixer: ``KCPGatedDeltaNet`` / ``KCPKimiDeltaAttention`` on this rank's rows of the hidden states.
  ``noCP`` (``-qla``): the mixer at CP = 1 on the whole pack (fla's call; flash-qla's, handed it by fla);
  ``cp2hp`` (``-qla``): megatron-core's ``GatedDeltaNet`` (KDA: our mixer with ``strategy="cp2hp"``);
  ``mlm-chunkwise``: our mixer moving its hidden states to the contiguous layout and back (two
  all-to-alls a pass), with fla's CP call as its core; ``kcp-noconvert``, ``kcp``, ``kcp-gather``: ours.
* block: Megatron's ``TransformerBlock`` of the hybrid spec (layers 1-3 linear, layer 4 softmax
  attention); ``cp2hp`` (``-qla``) on ``cp2hp_*_hybrid_layer_spec``; ``mlm-chunkwise`` moves the hidden
  states around every linear layer (Megatron-LM dev's per-layer conversion) with fla's CP call as the
  core; ``kcp`` moves them once per run of linear layers where the cost model says so.

The mixer and block rows share the one-device rows' weights. ``--smoke`` (CPU, reference core): fla's
CP call is stood in by ours on the contiguous plan, and flash-qla's rows are left out; it checks the
script, not a measurement. ``--budget`` skips the cases left once it is spent. ``--profile ROWS`` prints,
after timing each of ``--profile-methods`` (default: kcp), every rank's profile of one step: wall time,
kernel time and launches, and the costliest operators.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import time
from unittest import mock


import torch
import torch.distributed as dist

from benchmarks import perdoc
from benchmarks.catalogue import CONV, cu_seqlens
from benchmarks.common import env, fresh_leaves, init_rank, measured_world, rel_err, spawn
from benchmarks.methods import METHODS as METHODS_DECLARED
from benchmarks.timing import Bench
from megatron_kcp.plan import build_plan, local_token_index

LEVELS = ("ops", "mixer", "block")
# ops only: kcp-graph, the default's step captured in a CUDA graph; kcp-ownstart-graph, the peer
# kcp-ownstart captured; kcp-convert, our op converting its inputs whatever the cost model says
# (KCP_CONVERT=1: the pick it did not make, to check it); the peers perdoc.BY_NAME
ONLY_OPS = ("kcp-graph", "kcp-ownstart-graph", "kcp-convert", *perdoc.BY_NAME)
# every level, by name: kcp-gather, the default with KCP_STRATEGY=gather (our all-gather step where the
# default runs fla's CP call or another step); kcp-contiguous, the default fed the same documents in the
# contiguous layout (no conversion in; the block still converts out for its attention layer), the peer
# of issue #27's "within 1.1x of contiguous"
METHODS = (*perdoc.METHODS, *ONLY_OPS, "kcp-gather", "kcp-contiguous")
QLA = ("noCP-qla", "cp2hp-qla")
NAMES = {"ops": ("o", "dq", "dk", "dv", "dg", "dbeta"), "mixer": ("y", "dx"), "block": ("y", "dx")}
# a right method's bf16 row sits near 1e-2 or below against the one-device bf16 run; a wrong exchange,
# halo or layout misses by O(1)
ERR_BOUND = 5e-2


def method_env(method: str, cuda: bool) -> dict:
    """What a method sets: flash-qla handed GDN by fla (``-qla`` rows) or not, our overrides, and the
    peers' short conv on a GPU: fla's Triton kernels, as megatron-core's GatedDeltaNet runs it (fla's
    dispatch keeps its Gluon kernels out of distributed runs); ours: the default's pick, or ``KCP_CONV``
    where set."""
    peer_conv = {"KCP_CONV": "fla"} if cuda and not method.startswith("kcp") else {}
    return {**peer_conv, "FLA_FLASH_QLA": "0", "KCP_CONVERT": None, "KCP_RELAY_GROUPS": None, "KCP_STRATEGY": None,
            **METHODS_DECLARED[method].env}


def fla_cp_rule(model: str, device, smoke: bool):
    """``gated_delta_rule(q, k, v, g, beta, plan, group, **kw)`` as fla's CP call on a contiguous plan (the
    core of Megatron-LM dev's scheme), with the library's ``build_cp_context`` of the plan
    (:func:`megatron_kcp.parallel.fla_cp.context`, built once per plan); on the CPU (``smoke``) our op on
    that plan stands in."""
    from megatron_kcp.ops import kcp
    if smoke:
        ours = kcp.gated_delta_rule         # taken before the mixers' calls are patched to this rule

        def rule(q, k, v, g, beta, plan, group=None, use_qk_l2norm=False, **kw):
            assert plan.layout == "contiguous", plan.layout
            return ours(q, k, v, g, beta, plan, group, use_qk_l2norm=use_qk_l2norm, backend="reference")
        return rule
    from benchmarks.ops import chunk_kernel
    from megatron_kcp.parallel.fla_cp import context
    kernel = chunk_kernel(model, device)

    def rule(q, k, v, g, beta, plan, group=None, use_qk_l2norm=False, **kw):
        if plan.layout != "contiguous":
            raise ValueError(f"fla's CP call runs the contiguous layout, got {plan.layout}")
        return kernel(q, k, v, g, beta, cp_context=context(plan, group, torch.device(device)),
                      use_qk_l2norm=use_qk_l2norm)
    return rule


class Case:
    """One (shape, tokens, documents) on this rank: the global inputs (the same on every rank), this
    rank's rows, and the rows written so far (eff and x_cp2hp are read from them)."""

    def __init__(self, b: Bench, s: perdoc.Shape, T: int, docs: str, write):
        self.b, self.s, self.T, self.docs, self.write = b, s, T, docs, write
        W, dev = b.W, b.device
        self.cu = cu_seqlens(docs, T, pad=2 * W)
        self.plans = {lay: build_plan(self.cu, lay, W, b.rank, CONV) for lay in ("zigzag_per_doc", "contiguous")}
        self.index = {lay: local_token_index(p).to(dev) for lay, p in self.plans.items()}
        self.base = dict(model=s.model, tokens=T, docs=docs, heads=s.HV, head_dim=s.K,
                         dtype=str(b.dtype).split(".")[-1], source="measured", **{"pass": "fwd+bwd"})
        self.rows = {}
        self.ref_note = ""      # where the rows' err reads against another run than the one-device one

    def emit(self, level, method, width, ms, err, note="", layout=None):
        """Rank 0 writes the row; eff and x_cp2hp against this level's noCP and cp2hp rows."""
        self.rows[level, method] = ms
        nocp, cp2hp = self.rows.get((level, "noCP")), self.rows.get((level, "cp2hp"))
        row = dict(self.base, level=level, method=method, W=width, ms=ms, err=err, note=note,
                   layout=layout or ("-" if width == 1 else "zigzag_per_doc"),
                   eff=nocp / (width * ms) if nocp and width > 1 else 1.0 if width == 1 else "",
                   x_cp2hp=cp2hp / ms if cp2hp and width > 1 else "")
        if self.b.rank == 0:
            self.write(row)

    def skip(self, level, method, why):
        if self.b.rank == 0:
            self.write(dict(self.base, level=level, method=method, W=self.b.W, note=why))

    def timed(self, level, method, width, step, out, ref, note="", layout=None):
        """Time ``step`` (one fwd+bwd returning its results), after checking ``out`` (its first results,
        or a call returning them) against ``ref`` (the one-device run's, in this rank's rows; each may be a
        call returning it, to bring it to the GPU only while compared); a row over ``ERR_BOUND`` says so in
        its note, with each result's error. Neither is held while ``step`` is timed."""
        out = out() if callable(out) else out
        errs = self.b.max_over_ranks([rel_err(a, r() if callable(r) else r) for a, r in zip(out, ref)])
        del out, ref
        err = max(errs)
        note = "; ".join(n for n in (note, self.ref_note) if n)
        if err > ERR_BOUND:
            names = NAMES[level] if len(errs) == len(NAMES[level]) else [f"#{i}" for i in range(len(errs))]
            each = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errs))
            note = f"WRONG: err over {ERR_BOUND:g} ({each}); {note}"
        ms, _ = self.b.measure(step)
        self.emit(level, method, width, ms, err, note, layout)
        if self.b.args.profile and method in self.b.args.profile_methods:
            self.b.profile(step, f"{level} {method} {self.s.model} H={self.s.HV} T={self.T} {self.docs}",
                           self.b.args.profile)


def run_method(c: Case, level: str, method: str, fn):
    """``fn()`` builds and times one method; a method that fails (out of memory, a peer refusing the
    shape) writes its error and leaves the others."""
    if method in QLA and importlib.util.find_spec("flash_qla") is None:
        c.skip(level, method, "n/a: flash-qla is not installed (pip install flash-qla==0.1.3)")
        return
    try:
        with env(**method_env(method, c.b.cuda)):
            fn()
    except Exception as e:  # noqa: BLE001 - one method failing must not lose the others
        first = str(e).splitlines()[0][:160] if str(e) else ""
        c.skip(level, method, f"error: {type(e).__name__}: {first}")
    finally:
        if c.b.cuda:
            torch.cuda.empty_cache()


def ops_level(c: Case, args):
    """The op's methods on this rank's rows (``fla-cp``: the contiguous layout's rows)."""
    from benchmarks.ops import chunk_kernel, cp2hp, flash_qla_call
    from megatron_kcp.ops import dispatch, kcp
    b, s, cu = c.b, c.s, c.cu
    xs, do = perdoc.inputs(s, c.T, b.dtype, b.device, seed=c.T + b.W)
    cu_dev, cu_cpu = torch.tensor(cu, device=b.device), torch.tensor(cu)
    kernel = chunk_kernel(s.model, b.device)
    ref = None
    try:
        with env(FLA_FLASH_QLA="0"):
            leaves = fresh_leaves(xs)
            o = kernel(*leaves, cu_dev, cu_cpu)
            ref = [o.detach(), *torch.autograd.grad(o, leaves, do)]
    except torch.OutOfMemoryError:       # a sequence one GPU cannot hold: fla's CP call is the reference
        pass
    leaves = o = None

    def rows(layout):
        """This rank's rows of a global tensor (or of a :class:`Sliced` one), on the device."""
        def pick(t):
            return (t.rows_of(layout) if isinstance(t, Sliced) else t if layout is None
                    else take(t, c.index[layout])).to(b.device)
        return pick
    if ref is None:
        if b.cuda:
            torch.cuda.empty_cache()
        for i in range(len(xs)):         # one at a time: a global input is freed as its rows are taken
            xs[i] = Sliced(xs[i], c.index, b.device)
        do = Sliced(do, c.index, b.device)
        ref = gathered_reference(c, fla_cp_rule(s.model, b.device, args.smoke), rows("contiguous"), xs, do)
        c.ref_note = "err against fla's CP call (one GPU: out of memory)"

    def fwd_bwd(fn, layout):
        """(one fwd+bwd of ``fn`` on this rank's rows, returning the output and the input gradients; the
        rows' picker)."""
        pick = rows(layout)
        leaves, dl = fresh_leaves(pick(x) for x in xs), pick(do).contiguous()

        def step():
            out = fn(*leaves)
            out = out[0] if isinstance(out, tuple) else out
            return [out.detach(), *torch.autograd.grad(out, leaves, dl)]
        return step, pick

    def run(method, fn, layout, width, note=""):
        step, pick = fwd_bwd(fn, layout)
        note = note(c.plans[layout or "zigzag_per_doc"]) if callable(note) else note
        c.timed("ops", method, width, step, step, [functools.partial(pick, r) for r in ref], note,
                "contiguous" if layout == "contiguous" else None)

    def graphed(method, fn, layout, note):
        """``fn`` on this rank's rows captured once in a CUDA graph (fwd+bwd), the replay timed."""
        from megatron_kcp.testing.graphs import capture
        if not b.cuda:
            return c.skip("ops", method, "n/a on the CPU: CUDA graphs")
        step, pick = fwd_bwd(fn, layout)
        graph, outs = capture(step, warmup=max(1, args.warmup))
        graph.replay()
        c.timed("ops", method, b.W, graph.replay, outs, [pick(r) for r in ref], note(c.plans[layout]))

    def ours(p, *x, **options):
        return kcp.gated_delta_rule(*x, p, dist.group.WORLD, use_qk_l2norm=True, backend=args.backend, **options)

    # what the dispatch reads of q, v and g: device, dtype, heads and head dims
    probe = [(x.rows_of("zigzag_per_doc") if isinstance(x, Sliced) else x)[:, :1] for x in (xs[0], xs[2], xs[3])]

    def pick_note(p, **options):
        return dispatch.decide(p, *probe, args.backend, **options).describe()
    zpd = c.plans["zigzag_per_doc"]
    qla = s.model == "GDN" and b.cuda
    methods = {
        "noCP": lambda: run("noCP", lambda *x: kernel(*x, cu_dev, cu_cpu), None, 1),
        "noCP-qla": lambda: run("noCP-qla", flash_qla_call(cu_dev), None, 1, "flash-qla's call"),
        "cp2hp": lambda: run("cp2hp", cp2hp(kernel, zpd, dist.group.WORLD), "zigzag_per_doc", b.W, "fla's kernels"),
        "cp2hp-qla": lambda: run("cp2hp-qla", cp2hp(first(flash_qla_call(cu_dev)), zpd, dist.group.WORLD),
                                 "zigzag_per_doc", b.W, perdoc.CP2HP_QLA),
        "mlm-chunkwise": lambda: run("mlm-chunkwise", mlm_op(c, s.model, args.smoke), "zigzag_per_doc", b.W,
                                     "fla CP, the op's inputs converted"),
        "fla-cp": lambda: run("fla-cp", functools.partial(fla_cp_rule(s.model, b.device, args.smoke),
                                                          plan=c.plans["contiguous"], group=dist.group.WORLD,
                                                          use_qk_l2norm=True),
                              "contiguous", b.W, "fla CP, contiguous input"),
        "kcp-noconvert": lambda: run("kcp-noconvert", functools.partial(ours, zpd), "zigzag_per_doc", b.W, pick_note),
        "kcp-unpipelined": lambda: run("kcp-unpipelined", functools.partial(ours, zpd), "zigzag_per_doc", b.W,
                                       pick_note),
        "kcp": lambda: run("kcp", functools.partial(ours, zpd), "zigzag_per_doc", b.W, pick_note),
        "kcp-convert": lambda: run("kcp-convert", functools.partial(ours, zpd), "zigzag_per_doc", b.W, pick_note),
        "kcp-gather": lambda: run("kcp-gather", functools.partial(ours, zpd), "zigzag_per_doc", b.W, pick_note),
        "kcp-contiguous": lambda: run("kcp-contiguous", functools.partial(ours, c.plans["contiguous"]), "contiguous",
                                      b.W, lambda p: f"{pick_note(p)}; fed the contiguous layout"),
        "kcp-graph": lambda: graphed("kcp-graph", functools.partial(ours, zpd), "zigzag_per_doc",
                                     lambda p: f"{pick_note(p)}, captured in a CUDA graph and replayed"),
        "kcp-ownstart-graph": lambda: under(perdoc.peer("kcp-ownstart"), graphed, "kcp-ownstart-graph",
                                            functools.partial(ours, zpd), "zigzag_per_doc",
                                            lambda p: f"{pick_note(p)}, captured in a CUDA graph and replayed"),
        **{m: functools.partial(under, perdoc.peer(m), run, m,
                                functools.partial(ours, zpd, **METHODS_DECLARED[m].options), "zigzag_per_doc",
                                b.W, functools.partial(pick_note, **METHODS_DECLARED[m].options))
           for m in perdoc.BY_NAME},
    }
    for method in args.methods:
        if method not in QLA or qla:
            run_method(c, "ops", method, methods[method])


def under(patch, run, *args):
    """``run(*args)`` (timed eager, or captured) under ``patch`` (a peer's, :func:`perdoc.peer`)."""
    with patch:
        run(*args)


def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows ``index`` (a rank's tokens in one layout) of a global ``[1, T, ...]`` tensor, where ``t`` is."""
    return t[:, index.to(t.device)]


class Sliced:
    """A global tensor of the pack held only as this rank's rows of each layout (``Case.index``), on
    ``device``: where one GPU cannot hold the pack beside the steps' work (H = 64 at 1M tokens: q, k, v
    and the output gradient take 16 GiB each, W times a rank's share). The whole pack is then
    unavailable: the one-device rows (``rows_of(None)``) fail as out of memory, as they would."""

    def __init__(self, t: torch.Tensor, index: dict, device):
        self.rows = {lay: take(t, idx).to(device) for lay, idx in index.items()}

    def rows_of(self, layout):
        if layout is None:
            raise torch.OutOfMemoryError("one GPU cannot hold the pack (the one-device run ran out of memory)")
        return self.rows[layout]


def gathered_reference(c: Case, rule, pick, xs, do):
    """(o, input gradients) of fla's CP call on the contiguous layout (``pick``: a global input's rows
    there), gathered into the global order and kept as every layout's rows of this rank
    (:class:`Sliced`) in host memory: the rows' reference where one GPU cannot run the whole pack (its
    rows' ``err`` then reads against fla's CP). One result is whole at a time, in host memory."""
    W, plan = c.b.W, c.plans["contiguous"]
    leaves = fresh_leaves(pick(x) for x in xs)
    o = rule(*leaves, plan=plan, group=dist.group.WORLD, use_qk_l2norm=True)
    local = [o.detach(), *torch.autograd.grad(o, leaves, pick(do).contiguous())]
    del o, leaves
    where = [local_token_index(build_plan(c.cu, "contiguous", W, r, CONV)) for r in range(W)]
    out = []
    for t in local:
        full = torch.empty(t.shape[0], c.T, *t.shape[2:], dtype=t.dtype)
        parts = [t.new_empty(t.shape[0], len(w), *t.shape[2:]) for w in where]
        dist.all_gather(parts, t.contiguous())
        for w, part in zip(where, parts):
            full[:, w] = part.cpu()
        del parts
        out.append(Sliced(full, c.index, "cpu"))
    return out


def first(fn):
    """``fn`` returning only the first of its results (flash-qla's call returns (o, final state))."""
    return lambda *x: fn(*x)[0]


def mlm_op(c: Case, model: str, smoke: bool):
    """Megatron-LM dev's scheme at op level: q, k, v, g, beta moved to the contiguous layout, fla's CP
    call there, o moved back."""
    from megatron_kcp.parallel.relayout import relayout
    rule, cu, group = fla_cp_rule(model, c.b.device, smoke), c.cu, dist.group.WORLD

    def step(*x):
        x = [t[None] for t in relayout([t[0] for t in x], cu, "zigzag_per_doc", "contiguous", group)]
        o = rule(*x, plan=c.plans["contiguous"], group=group, use_qk_l2norm=True)
        return relayout([o[0]], cu, "contiguous", "zigzag_per_doc", group)[0][None]
    return step


def module_level(c: Case, args, what: str, solo):
    """The mixer's or the block's methods on this rank's rows of the hidden states, with the weights of
    the one-device module."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_kcp import spec
    from megatron_kcp.layers import layout, transformer_layer
    from megatron_kcp.ops import kcp
    b, s, cu = c.b, c.s, c.cu
    cu_t = torch.tensor(cu, dtype=torch.int32, device=b.device)
    longest = max(q - p for p, q in zip(cu, cu[1:]))
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=cu_t,
                          cu_seqlens_kv_padded=cu_t, max_seqlen_q=longest, max_seqlen_kv=longest)
    gen = torch.Generator(device=b.device).manual_seed(c.T + 1)
    x, dy = (torch.randn(c.T, 1, s.hidden, generator=gen, device=b.device, dtype=b.dtype) for _ in range(2))
    gdn = s.model == "GDN"
    with env(FLA_FLASH_QLA="0"):
        ref_mod = perdoc.module(s, what, b.dtype, b.device, 1, solo)
    move = layout.move
    weights = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ref_mod.state_dict().items()}
    ref = None

    def run(method, width, make, patches=(), note="", fed="zigzag_per_doc"):
        """``fed``: the layout of the rows handed in (the output's: Megatron's, or for a mixer fed
        contiguous, contiguous)."""
        nonlocal ref
        mod = ref_mod if width == 1 else make()
        mod.load_state_dict(weights)
        note = note(mod) if callable(note) else note
        idx = None if width == 1 else c.index[fed]
        out_idx = None if width == 1 else c.index[fed if what == "mixer" else "zigzag_per_doc"]
        leaf = (x if idx is None else x[idx]).clone().requires_grad_()
        dyl = dy if out_idx is None else dy[out_idx]

        def step():
            with contextlib.ExitStack() as stack:
                for p in patches:
                    stack.enter_context(p)
                out = mod(leaf, None, packed_seq_params=thd)       # (hidden states, attention mask)
                out = out if what == "block" else out[0]          # a mixer returns (output, bias)
                return [out.detach(), *torch.autograd.grad(out, [leaf], dyl)]
        moves = []
        with mock.patch.object(layout, "move", lambda *a: moves.append(a[2:4]) or move(*a)):
            first = step()
        if ref is None:
            ref = first
        want = ref if idx is None else [ref[0][out_idx], ref[1][idx]]        # (y, dx)
        if width > 1 and not method.startswith("cp2hp"):     # cp2hp moves q, k, v, g and beta instead
            note = f"{note}{'; ' if note else ''}{len(moves)} hidden-state all-to-alls a forward"
        c.timed(what, method, width, step, first, want, note, fed if fed != "zigzag_per_doc" else None)

    def cp_module(**kw):
        return lambda: perdoc.module(s, what, b.dtype, b.device, b.W, **kw)

    mlm = [mock.patch.object(kcp, "gated_delta_rule", fla_cp_rule(s.model, b.device, args.smoke))]
    if what == "block":        # every linear layer its own run: the hidden states move around each
        mlm.append(mock.patch.object(transformer_layer, "run_of", lambda config, n: (n, n)))
    cp2hp = (dict(layer_spec=spec.cp2hp_gdn_hybrid_layer_spec if gdn else spec.cp2hp_kda_hybrid_layer_spec)
             if what == "block" else dict(cls=GatedDeltaNet) if gdn else dict(strategy="cp2hp"))
    methods = {
        "noCP": lambda: run("noCP", 1, None, note="fla's call" if b.cuda else ""),
        "noCP-qla": lambda: run("noCP-qla", 1, None, note="flash-qla's call (fla hands it GDN)"),
        "cp2hp": lambda: run("cp2hp", b.W, cp_module(**cp2hp), note="megatron-core's GatedDeltaNet" if gdn else
                             "KDA mixer, strategy cp2hp"),
        "cp2hp-qla": lambda: run("cp2hp-qla", b.W, cp_module(**cp2hp), note=perdoc.CP2HP_QLA),
        # the block is built inside the patch: a layer reads its run at construction
        "mlm-chunkwise": lambda: run("mlm-chunkwise", b.W, lambda: _built_with(mlm[1:], cp_module()), mlm,
                                     "fla CP, hidden states converted per layer"),
        "kcp-noconvert": lambda: run("kcp-noconvert", b.W, cp_module()),
        "kcp": lambda: run("kcp", b.W, cp_module(), note=lambda mod: kcp_note(c, mod, what)),
        "kcp-gather": lambda: run("kcp-gather", b.W, cp_module(), note=lambda mod: kcp_note(c, mod, what)),
        "kcp-contiguous": lambda: run("kcp-contiguous", b.W, cp_module(), [fed_contiguous(what)],
                                      lambda mod: f"{kcp_note(c, mod, what)}; {FED[what]}", "contiguous"),
    }
    for method in args.methods:
        if method in ("fla-cp", "kcp-unpipelined", *ONLY_OPS) or method in QLA and not (
                gdn and b.cuda):
            continue                           # op level only; flash-qla: GDN on a GPU
        if method == "cp2hp" and gdn and not b.cuda:
            c.skip(what, method, "n/a on the CPU: megatron-core's GatedDeltaNet runs packed sequences with fla's "
                   "kernels only")
        else:
            run_method(c, what, method, methods[method])


FED = {"mixer": "fed the contiguous layout: no conversion",
       "block": "fed the contiguous layout: the run's move in skipped, its move out (for the attention) kept"}


class fed_contiguous:  # noqa: N801 - used as a patch, like mock.patch
    """The hidden states arrive in the contiguous layout: the mixer's moves, or the block's move into
    its run of linear layers, are the identity (the block's run still moves its output to Megatron's
    layout, which the softmax layer needs). Entered once a step; the move in place at entry is kept for
    the others, so a counting patch outside still counts the all-to-alls that run."""

    def __init__(self, what: str):
        self.what, self.patch = what, None

    def __enter__(self):
        from megatron_kcp.layers import layout
        inner = layout.move

        def move(hidden, cu, source, target, *rest):
            if self.what == "mixer" or source != layout.TARGET:
                return hidden
            return inner(hidden, cu, source, target, *rest)
        self.patch = mock.patch.object(layout, "move", move)
        return self.patch.__enter__()

    def __exit__(self, *exc):
        return self.patch.__exit__(*exc)


def _built_with(patches, make):
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        return make()


def kcp_note(c: Case, mod, what: str) -> str:
    """The default's pick at mixer or block level: the hidden states' layout (the cost model's, for the
    mixer alone or the block's run of three linear layers) and the op's decision there."""
    from megatron_kcp.layers.batch import Batch
    from megatron_kcp.layers.layout import converts
    from megatron_kcp.ops import dispatch
    s, b = c.s, c.b
    moved = converts(mod.config, Batch(c.cu, "zigzag_per_doc", thd=True), b.W, 1, 3 if what == "block" else 1)
    plan = c.plans["contiguous" if moved else "zigzag_per_doc"]
    like = dict(device=b.device, dtype=b.dtype)
    q, v = torch.empty(1, 1, s.H, s.K, **like), torch.empty(1, 1, s.HV, s.K, **like)
    g = torch.empty(1, 1, s.HV, *((s.K,) if s.model == "KDA" else ()), device=b.device)
    pick = dispatch.decide(plan, q, v, g).describe()
    return f"{'contiguous' if moved else 'zigzag_per_doc'} ({pick})"


def worker(rank, W, port, args, shapes):
    from megatron.core import parallel_state as ps

    from megatron_kcp import megatron_cpu
    from megatron_kcp.testing.layers import solo_pg
    b = Bench(args, init_rank(rank, W, port, args.device), W, rank)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // W))
    megatron_cpu.enable()
    ps.initialize_model_parallel(context_parallel_size=W)
    if b.cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)
    solo = solo_pg()
    write = perdoc.row_writer(args.csv, "measured") if rank == 0 else None
    try:
        for s in shapes.values():
            for T in args.tokens:
                for docs in args.docs:
                    c = Case(b, s, T, docs, write)
                    if b.out_of_time():
                        c.skip("-", "-", "skipped: --budget spent")
                        continue
                    if "ops" in args.levels:
                        ops_level(c, args)
                    for what in ("mixer", "block"):
                        if what in args.levels and s.hidden:
                            module_level(c, args, what, solo)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def parse(argv=None, prog=None):
    """(args, W, shapes) of a command line."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", nargs="+", choices=list(perdoc.SHAPES), default=["qwen3-next", "kimi-linear"])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768])
    p.add_argument("--docs", nargs="+", choices=perdoc.DOCS, default=list(perdoc.DOCS))
    p.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(perdoc.METHODS))
    p.add_argument("--cp", type=int, default=None, help="CP size W (default: the number of GPUs)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backend", choices=["auto", "fla", "qla"], default="auto",
                   help="the core of our op-level rows (auto: the default's pick)")
    p.add_argument("--budget", type=float, default=None, help="seconds; cases left after it are skipped")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="after timing --profile-methods, print each rank's profile of one step (ROWS operators)")
    p.add_argument("--profile-methods", nargs="+", choices=METHODS, default=["kcp"], metavar="METHOD")
    p.add_argument("--csv", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo ranks, reference core, tiny sizes")
    args = p.parse_args(argv)
    if "noCP" not in args.methods:
        args.methods.insert(0, "noCP")       # the reference every row's err and eff are read against
    args.methods = [m for m in METHODS if m in args.methods]
    if args.smoke:
        args.tokens, args.warmup, args.iters, args.dtype, args.device = [256], 0, 1, "float32", "cpu"
        args.docs = [d for d in args.docs if d in ("single", "varlen")] or ["varlen"]   # 100 documents need more tokens
        args.shapes = [n for n in args.shapes if n in perdoc.TINY] or list(perdoc.TINY)
        args.backend, W = "auto", args.cp or 2
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        shapes = {n: perdoc.TINY[n] for n in args.shapes}
    else:
        args.device, W = "cuda", measured_world(args.cp, "; benchmarks/perdoc.py predicts W >= 2 from one GPU")
        shapes = {n: perdoc.SHAPES[n] for n in args.shapes}
    args.deadline = time.time() + (args.budget if args.budget is not None else 1e9)
    return args, W, shapes


def main(argv=None, prog=None):
    args, W, shapes = parse(argv, prog)
    spawn(worker, W, args, shapes)
