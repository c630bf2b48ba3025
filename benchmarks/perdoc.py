"""Packed documents at W CP ranks, predicted from one GPU: op, mixer and hybrid-block level.

    python -m benchmarks predict matrix --csv perdoc_h200x1_predicted.csv
    python -m benchmarks predict matrix --shapes qwen3-next --tokens 131072 --cp 2 4 8 16 64 --levels ops
    python -m benchmarks predict --problem single-scale     # a named problem (benchmarks/catalogue.py)
    python -m benchmarks predict matrix --smoke             # CPU, reference core, tiny sizes: checks the bench

Megatron's layout of a packed THD batch (``--layouts``: the per-document zigzag of ``--sft``, every
document cut into 2W chunks, by default; ``zigzag``, the whole stream cut into 2W chunks, as
``--dataloader-inter-document-masking`` cuts it; ``contiguous``) against the peers, fwd+bwd, per
shape (``--shapes``: ``qwen3-next`` GDN, 16 q/k and 32 v heads, K = V = 128, d_model 2048, attention
16 q / 2 kv heads of 256; ``kimi-linear`` KDA, 32 heads, K = V = 128, d_model 2304, attention 32 heads
of 128 (MLA stood in by GQA-free attention); ``h64-gdn`` / ``h64-kda``: 64 heads, op level), tokens T
and documents (``single``, ``varlen`` 10, ``varlen100``, ``varlen300``, each a multiple of 2W tokens).
Methods:

* ``noCP``, ``noCP-qla``: the whole pack on one GPU (fla's call; flash-qla's for GDN), measured;
* ``cp2hp``: megatron-core's all-to-all to head shards: the core on the whole pack with H/W heads
  (measured; fla's kernels) and its four all-to-alls of q, k, v, g, beta and o over the link;
  ``cp2hp-qla``: the same on flash-qla's call, what megatron-core runs for GDN with flash-qla installed
  (fla hands its call to flash-qla);
* ``mlm-chunkwise``: Megatron-LM dev's scheme: an all-to-all to the contiguous layout per linear
  layer (op level: of q, k, v, g, beta; mixer and block: of the hidden states), fla's CP call
  (``build_cp_context``, its all-gathers over the link), and back;
* ``fla-cp``: fla's CP call on the same tokens fed in the contiguous layout, no conversion (op level);
* ``kcp-noconvert``: our step on the per-document layout (``KCP_CONVERT=0``);
* ``kcp-unpipelined``: the default with the relay on one head group (``KCP_RELAY_GROUPS=1``; op level);
* ``kcp``: the default (``note``: its strategy and layout); at mixer and block level the hidden
  states move once per run of linear layers (four all-to-alls), at op level the op's own inputs
  where the cost model says so;
* peers of one part of the default, asked for by name (op level, :data:`BY_NAME`, declared in
  ``benchmarks/methods.py``): ``kcp-foldloop``,
  the all-gather's fold in PyTorch, a launch a chain step (``gather.fold_reference``), beside the fold
  in one kernel; ``kcp-ownstart``, every sequence start on a state pass of its own, not the maps pass
  (``methods.OwnStartsGather``); ``kcp-whole``, no segment split by the kernels' pick (``max_segment=0``:
  ``dispatch.qla_max_segment``, ``dispatch.fla_max_segment``).

Predicted (``source`` = predicted): every rank's step timed alone with its exchange stubbed and
replayed over the fitted link (``simulate.py``, the link of ``megatron_kcp.calibration``), the slowest
rank. Mixer level adds the mixer's
per-token work at T/W tokens (the mixer at CP=1 with its gated delta rule stubbed, measured) and the
hidden-state all-to-alls. Block level (3 linear + 1 softmax attention, one run of linear layers):
three mixers' cores, the per-token work of all four layers at T/W tokens (measured with the cores
stubbed), the attention core's share (varlen flash attention over the pack / W: the per-document
zigzag gives each rank 1/W of every document's causal work) and its K/V all-gather. ``eff`` =
noCP / (W ms); ``x_cp2hp`` = cp2hp / ms. ``--methods`` picks rows; a one-device call that does not fit
the GPU is left out.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from unittest import mock

import torch

from benchmarks import simulate
from benchmarks.catalogue import CONV, DOCS, SHAPES, TINY, Shape, cu_seqlens
from benchmarks.common import free_port, fresh_leaves
from benchmarks.methods import METHODS as REGISTRY
from benchmarks.schema import Writer
from megatron_kcp.plan import LAYOUTS, build_plan

CP2HP_QLA = "flash-qla's call (megatron-core with flash-qla installed)"
METHODS = ("noCP", "noCP-qla", "cp2hp", "cp2hp-qla", "mlm-chunkwise", "fla-cp", "kcp-noconvert", "kcp-unpipelined",
           "kcp")
BY_NAME = ("kcp-foldloop", "kcp-ownstart", "kcp-whole")   # the default with one part changed: only where asked
__all__ = ["Shape", "SHAPES", "TINY", "DOCS", "main"]


def peer(method: str):
    """The registry's ``method`` in place (:data:`BY_NAME`); yields its op options."""
    return REGISTRY[method].applied()


def inputs(s: Shape, T: int, dtype, dev, seed: int):
    """q, k, v, g (fp32 log decay, slow), beta and do of one pack."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    r = dict(device=dev, generator=gen)
    q, k = (torch.randn(1, T, s.H, s.K, dtype=dtype, **r) for _ in range(2))
    v = torch.randn(1, T, s.HV, s.K, dtype=dtype, **r)
    g = -1e-3 * (0.5 + torch.rand(1, T, s.HV, *((s.K,) if s.model == "KDA" else ()), **r))
    beta = torch.rand(1, T, s.HV, dtype=dtype, **r)
    return [q, k, v, g, beta], torch.randn(1, T, s.HV, s.K, dtype=dtype, **r)


def timed(step, args) -> float:
    """Median seconds of ``step()`` after the warm-up."""
    cuda = torch.cuda.is_available() and not args.smoke
    times = []
    for i in range(args.warmup + args.iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            t = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(t)
    return statistics.median(times)


def fwd_bwd(fn, xs, do):
    leaves = fresh_leaves(xs)

    def step():
        o = fn(*leaves)
        torch.autograd.grad(o[0] if isinstance(o, tuple) else o, leaves, do)   # flash-qla returns (o, state)
    return step


def link(nbytes: float, W: int, args) -> float:
    """Seconds of one all-to-all moving ``nbytes`` of a rank's rows ((W-1)/W of them leave)."""
    return args.alpha_us * 1e-6 + nbytes * (W - 1) / W / (args.bw_gbs * 1e9)


def predicted(cu, W, xs, do, fn_of, args, layout: str = "zigzag_per_doc") -> tuple[float, int]:
    """(slowest rank's simulated fwd+bwd seconds, bytes it sent) with ``fn_of(plan)`` each rank's step on
    its plan of ``layout``."""
    tls = []
    for r in range(W):
        plan = build_plan(cu, layout, W, r, CONV)
        tls.append(simulate.rank_timeline(plan, xs, do, "auto", args.backend, args, fn=fn_of(plan)))   # labels only
        if args.profile:
            print(f"rank {r} timeline (ms): " + " ".join(f"{x[1] * 1e3:.2f}" if x[0] == "compute" else x[0]
                                                         for x in tls[-1]), flush=True)
    ends, _ = simulate.simulate(tls, args.alpha_us * 1e-6, args.bw_gbs * 1e9)
    sent = max(sum(x[2] for x in tl if x[0] == "send") + sum(x[1] for x in tl if x[0] in ("allgather", "alltoall"))
               for tl in tls)
    return max(ends), sent


def core_steps(s: Shape, cu, W, xs, do, args, backend, done=lambda key, result: None, layout="zigzag_per_doc"):
    """{method: (seconds, bytes sent, note)} of the core's CP step alone, for the methods asked for:
    ``kcp-op`` converts the op's own inputs where the cost model says so, ``kcp-contiguous`` runs on the
    contiguous plan (the mixers' conversions happen outside), ``mlm-op`` / ``mlm-contiguous`` are fla's CP
    call with and without the op's conversion, on the tokens in ``layout`` (Megatron's cut). A method that
    fails (out of memory) is left out, said. ``done(key, result)`` is called as each finishes."""
    from megatron_kcp.ops import dispatch, kcp
    from megatron_kcp.parallel.relayout_exchange import target_plan
    from megatron_kcp.parallel.cost_model import pipeline_depth
    from megatron_kcp.parallel.relayout import relayout
    out, want = {}, set(args.methods)

    def ours(plan, strategy="auto", **options):
        return lambda *x: kcp.gated_delta_rule(*x, plan, simulate.NO_GROUP, use_qk_l2norm=True, backend=backend,
                                               strategy=strategy, **options)

    def note(plan, **options):
        d = dispatch.decide(plan, xs[0], xs[2], xs[3], backend, **options)
        depth = ""
        if d.strategy == "relay" and W > 1:
            inner = target_plan(plan, d.layout) if d.layout else plan
            core = dispatch.build_core(d.core, xs[0], xs[2], xs[3])
            groups = pipeline_depth(inner, s.HV, s.H, s.K, core.min_group_heads)
            depth = f", {groups} head group{'s' if groups > 1 else ''}"
        return d.describe() + depth

    def run(method, fn_of, plan, text=None, **options):
        try:
            with REGISTRY[method].applied() if method in REGISTRY else contextlib.nullcontext():
                out[method] = (*predicted(cu, W, xs, do, fn_of, args, plan.layout), text or note(plan, **options))
            done(method, out[method])
        except torch.OutOfMemoryError:
            print(f"{method}: out of memory", flush=True)
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    plan0, contiguous = build_plan(cu, layout, W, 0), build_plan(cu, "contiguous", W, 0)
    if "kcp-noconvert" in want:
        run("kcp-noconvert", ours, plan0)
    if "kcp" in want:
        run("kcp-op", ours, plan0)
        if set(args.levels) - {"ops"}:
            run("kcp-contiguous", lambda p: ours(target_plan(p, "contiguous")), contiguous)
    if "kcp-unpipelined" in want:
        run("kcp-unpipelined", ours, plan0)
    for method in (m for m in BY_NAME if m in want):
        options = REGISTRY[method].options
        run(method, lambda p, o=options: ours(p, **o), plan0, **options)
    if not args.smoke and want & {"mlm-chunkwise", "fla-cp"}:
        from benchmarks.ops import chunk_kernel
        from fla.ops.cp import build_cp_context
        kernel = chunk_kernel(s.model, xs[0].device)
        dev = xs[0].device

        def fla_cp(plan, convert):
            """fla's CP call on this rank's contiguous share (moved there and back where ``convert``)."""
            with mock.patch("torch.distributed.get_world_size", lambda group=None: W), \
                    mock.patch("torch.distributed.get_rank", lambda group=None: plan.rank):
                ctx = build_cp_context(torch.tensor(cu, device=dev), group=simulate.NO_GROUP,
                                       cu_seqlens_cpu=torch.tensor(cu), layout="contiguous")

            def step(*x):
                if convert:
                    x = [t[None] for t in relayout([t[0] for t in x], cu, plan.layout, "contiguous",
                                                   simulate.NO_GROUP)]
                o = kernel(*x, cp_context=ctx)
                if convert:
                    o = relayout([o[0]], cu, "contiguous", plan.layout, simulate.NO_GROUP)[0][None]
                return o
            return step
        try:
            if "mlm-chunkwise" in want and "ops" in args.levels:
                run("mlm-op", lambda p: fla_cp(p, True), plan0, text="fla CP, contiguous")
            run("mlm-contiguous", lambda p: fla_cp(p, False), plan0, text="fla CP, contiguous input")
        except Exception as e:  # noqa: BLE001 - the peer failing must not lose our rows
            print(f"mlm-chunkwise: {type(e).__name__}: {e}", flush=True)
    return out


def single_core(s: Shape, cu, xs, do, args, heads_div: int = 1, qla: bool = False) -> float:
    """Seconds of the one-device call on the whole pack (``heads_div``: with H/heads_div heads, as cp2hp runs it)."""
    dev = xs[0].device
    xs = [x[:, :, : x.shape[2] // heads_div].contiguous() for x in xs]
    do = do[:, :, : do.shape[2] // heads_div].contiguous()
    cu_dev = torch.tensor(cu, device=dev, dtype=torch.long)
    if args.smoke:
        from megatron_kcp.kernels import reference
        fn = (lambda *x: reference.chunk_gated_delta_rule_fp64(*x, use_qk_l2norm=True, cu_seqlens=torch.tensor(cu))[0])
    elif qla:
        from benchmarks.ops import flash_qla_call
        fn = flash_qla_call(cu_dev)
    else:
        from benchmarks.ops import chunk_kernel
        kernel = chunk_kernel(s.model, dev)
        fn = (lambda *x: kernel(*x, cu_dev, torch.tensor(cu)))
    return timed(fwd_bwd(fn, xs, do), args)


def attention_core(s: Shape, cu, dtype, dev, args) -> float:
    """Seconds of causal attention over the pack, document by document (fwd+bwd): flash varlen attention."""
    hq, hkv, d = s.attn
    T = cu[-1]
    gen = torch.Generator(device=dev).manual_seed(5)
    q, k, v, do = (torch.randn(T, h, d, device=dev, dtype=dtype, generator=gen) for h in (hq, hkv, hkv, hq))
    cu_t = torch.tensor(cu, device=dev, dtype=torch.int32)
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    if args.smoke:
        import torch.nn.functional as F

        def fn(q, k, v):
            return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                                             is_causal=True, enable_gqa=hq != hkv)[0].transpose(0, 1)
                              for a, b in zip(cu, cu[1:])])
    else:
        from torch.nn.attention.varlen import varlen_attn
        if hkv != hq:
            k, v = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))

        def fn(q, k, v):
            try:
                return varlen_attn(q, k, v, cu_t, cu_t, longest, longest, window_size=(-1, 0))
            except TypeError:                           # torch < 2.12: is_causal
                return varlen_attn(q, k, v, cu_t, cu_t, longest, longest, is_causal=True)
    return timed(fwd_bwd(fn, [q, k, v], do), args)


def module(s: Shape, what: str, dtype, dev, cp: int = 1, pg=None, layer_spec=None, cls=None, **options):
    """The mixer (``what`` = mixer) or the 4-layer hybrid block (block: layers 1-3 linear, layer 4 softmax
    attention) of shape ``s`` at CP = ``cp`` over ``pg`` (default: Megatron's groups), Megatron's local
    layers, seeded: every call with the same arguments builds the same weights. ``layer_spec`` replaces
    the block's hybrid spec, ``cls`` the GDN mixer's class; ``options`` go to the KDA mixer."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_kcp import spec
    from megatron_kcp.testing.layers import Shape as LShape
    from megatron_kcp.testing.layers import build, config
    m = s.model.lower()
    ls = LShape(hidden=s.hidden, heads=(s.H, s.HV), head_dim=s.K, batch=1, device=dev.type)
    kw = dict(bf16=True, params_dtype=torch.bfloat16) if dtype == torch.bfloat16 else {}
    kw["use_cpu_initialization"] = dev.type == "cpu"
    if s.model == "KDA":
        kw["kda_gate_rank"] = s.K
    pg = pg or ProcessGroupCollection.use_mpu_process_groups()
    if what == "mixer":
        return build(m, config(m, ls, cp, **kw), pg, dev.type, cls=cls, **options).to(dtype)
    hq, hkv, d = s.attn
    cfg = config(m, ls, cp, num_layers=4, linear_attention_freq=4, num_attention_heads=hq, num_query_groups=hkv,
                 kv_channels=d, ffn_hidden_size=4 * s.hidden, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    torch.manual_seed(0)
    if dev.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)
    layer_spec = layer_spec or (spec.kda_hybrid_layer_spec if m == "kda" else spec.gdn_hybrid_layer_spec)
    return TransformerBlock(cfg, layer_spec, pg_collection=pg).to(dev).to(dtype)


def per_token_work(shape_name: str, s: Shape, tokens: int, what: str, dtype, dev, args) -> float:
    """Seconds (fwd+bwd) of the mixer (``what`` = mixer) or the 4-layer hybrid block (block) at CP=1 on
    ``tokens`` tokens with every gated delta rule and the attention core stubbed: the work that scales
    with a rank's tokens whatever the CP scheme. The GDN mixers' q/k norms are left to the core's step,
    timed with the op's norms as every row's core is (megatron-core's mixer runs them as calls of their
    own; ours fuses them into its split, which these rows therefore count at the peers' cost)."""
    from megatron_kcp.layers.attention import CPDotProductAttention
    from megatron_kcp.ops import kcp
    mod = module(s, what, dtype, dev)
    for m in mod.modules():
        if hasattr(m, "use_qk_l2norm"):
            m.use_qk_l2norm = False
    x = torch.randn(tokens, 1, s.hidden, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, 1, s.hidden, device=dev, dtype=dtype)

    def stub_core(q, k, v, g, beta, *a, **kw):
        return v * 1.0

    def stub_attn(self, query, key, value, *a, **kw):
        return query.reshape(query.shape[0], query.shape[1], -1) * 1.0

    def step():
        out = mod(x, None) if what == "block" else mod(x)[0]
        torch.autograd.grad(out, [x, *mod.parameters()], dy, allow_unused=True)
    with mock.patch.object(kcp, "gated_delta_rule", stub_core), \
            mock.patch.object(CPDotProductAttention, "forward", stub_attn), \
            mock.patch.dict(os.environ, {"KCP_CONVERT": "0"}):
        return timed(step, args)


def case(shape_name: str, s: Shape, T: int, docs: str, W: int, args, dev, dtype, write,
         layout: str = "zigzag_per_doc") -> None:
    cu = cu_seqlens(docs, T, pad=2 * W)        # the same documents in every layout
    xs, do = inputs(s, T, dtype, dev, seed=T + W)
    backend = "reference" if args.smoke else args.backend
    want = set(args.methods)
    e = torch.finfo(dtype).bits // 8
    in_bytes = T // W * ((2 * s.H * s.K + s.HV * s.K + s.HV) * e + s.HV * (s.K if s.model == "KDA" else 1) * 4)
    o_bytes = T // W * s.HV * s.K * e
    hidden_bytes = T // W * s.hidden * e
    base = dict(model=s.model, tokens=T, docs=docs, heads=s.HV, head_dim=s.K, dtype=str(dtype).split(".")[-1],
                source="predicted", W=W)

    def one_gpu(**kw):
        """The one-device call's seconds, None where it does not fit (said)."""
        try:
            return single_core(s, cu, xs, do, args, **kw)
        except torch.OutOfMemoryError:
            print(f"one-device call {kw}: out of memory", flush=True)
            torch.cuda.empty_cache()
            return None
    qla_ok = s.model == "GDN" and not args.smoke and args.qla

    def emit(level, rows, method):
        """Write one row of ``rows`` ({method: (seconds, width, note)}), eff and x_cp2hp from the rows
        there."""
        sec, width, note = rows[method]
        eff = rows["noCP"][0] / (W * sec) if width > 1 and "noCP" in rows else 1.0 if width == 1 else ""
        x = rows["cp2hp"][0] / sec if "cp2hp" in rows and width > 1 else ""
        write(dict(base, level=level, method=method, W=width, ms=sec * 1e3, eff=eff, x_cp2hp=x, note=note,
                   layout="-" if width == 1 else "contiguous" if method == "fla-cp" else layout,
                   **{"pass": "fwd+bwd"}))

    # op-level rows are written as each finishes (a run cut short keeps them); the others at the end
    ops_rows = {}

    def op_row(method, sec, width, note):
        ops_rows[method] = (sec, width, note)
        if "ops" in args.levels:
            emit("ops", ops_rows, method)
    nocp = one_gpu() if "noCP" in want else None
    if nocp is not None:
        op_row("noCP", nocp, 1, "")
    qla = one_gpu(qla=True) if qla_ok and "noCP-qla" in want else None
    if qla is not None:
        op_row("noCP-qla", qla, 1, "flash-qla's call")
    link_cp2hp = 2 * (link(in_bytes, W, args) + link(o_bytes, W, args))
    cp2hp = cp2hp_qla = None
    if s.H % W == 0:
        if "cp2hp" in want and (c := one_gpu(heads_div=W)) is not None:
            cp2hp = c + link_cp2hp
            op_row("cp2hp", cp2hp, W, "fla's kernels")
        if "cp2hp-qla" in want and qla_ok and (c := one_gpu(heads_div=W, qla=True)) is not None:
            cp2hp_qla = c + link_cp2hp
            op_row("cp2hp-qla", cp2hp_qla, W, CP2HP_QLA)
    named = {"mlm-op": "mlm-chunkwise", "mlm-contiguous": "fla-cp", "kcp-noconvert": "kcp-noconvert",
             "kcp-unpipelined": "kcp-unpipelined", "kcp-op": "kcp", **{m: m for m in BY_NAME}}

    def core_done(key, result):
        if key in named and named[key] in want:
            op_row(named[key], result[0], W, result[2])
    core = core_steps(s, cu, W, xs, do, args, backend, core_done, layout)

    levels = {}                            # level: (per-token work at CP = W, at CP = 1, linear layers)
    if s.hidden and "mixer" in args.levels:
        levels["mixer"] = (per_token_work(shape_name, s, T // W, "mixer", dtype, dev, args),
                           per_token_work(shape_name, s, T, "mixer", dtype, dev, args), 1)
    if s.hidden and "block" in args.levels:
        attn = attention_core(s, cu, dtype, dev, args)
        hq, hkv, d = s.attn
        kv_gather = (W - 1) * (args.alpha_us * 1e-6 + 2 * T // W * hkv * d * e / (args.bw_gbs * 1e9)) * 2
        levels["block"] = (per_token_work(shape_name, s, T // W, "block", dtype, dev, args) + attn / W + kv_gather,
                           per_token_work(shape_name, s, T, "block", dtype, dev, args) + attn, 3)
    for level, (rest, rest_nocp, layers) in levels.items():
        # hidden-state all-to-alls: four per run of linear layers (kcp), four per layer (Megatron-LM dev)
        conv_run = 4 * link(hidden_bytes, W, args)
        rows = {}
        if nocp is not None:
            rows["noCP"] = (rest_nocp + layers * nocp, 1, "")
        if qla is not None:
            rows["noCP-qla"] = (rest_nocp + layers * qla, 1, "flash-qla's call")
        if cp2hp is not None:
            rows["cp2hp"] = (rest + layers * cp2hp, W, "fla's kernels")
        if cp2hp_qla is not None:
            rows["cp2hp-qla"] = (rest + layers * cp2hp_qla, W, CP2HP_QLA)
        if "mlm-chunkwise" in want and "mlm-contiguous" in core:
            rows["mlm-chunkwise"] = (rest + layers * (core["mlm-contiguous"][0] + conv_run), W,
                                     "fla CP, hidden states converted per layer")
        if "kcp-noconvert" in core:
            rows["kcp-noconvert"] = (rest + layers * core["kcp-noconvert"][0], W, core["kcp-noconvert"][2])
        # what the default runs: the mixers' rule (layers/layout.py) with a run of ``layers``
        from megatron_kcp.layers.layout import run_traffic
        from megatron_kcp.parallel.cost_model import relayout_pays
        if "kcp" not in want:
            pass
        elif relayout_pays(cu, layout, W, s.HV, s.K, *run_traffic(s.hidden * e, layers)) and "kcp-contiguous" in core:
            rows["kcp"] = (rest + layers * core["kcp-contiguous"][0] + conv_run, W,
                           f"hidden states in the contiguous layout ({core['kcp-contiguous'][2]})")
        elif "kcp-op" in core:
            rows["kcp"] = (rest + layers * core["kcp-op"][0], W, core["kcp-op"][2])
        for method in rows:
            emit(level, rows, method)


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--docs", nargs="+", choices=DOCS, default=list(DOCS))
    p.add_argument("--cp", type=int, nargs="+", default=[2])
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["zigzag_per_doc"],
                   help="the CP layouts Megatron hands the layers: zigzag_per_doc (--sft), zigzag "
                        "(--dataloader-inter-document-masking), contiguous")
    p.add_argument("--levels", nargs="+", choices=["ops", "mixer", "block"], default=["ops", "mixer", "block"])
    p.add_argument("--methods", nargs="+", choices=METHODS + BY_NAME, default=list(METHODS))
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--backend", choices=["auto", "fla", "qla"], default="auto",
                   help="the core of our rows (auto: the default's pick, flash-qla for GDN where it wins)")
    p.add_argument("--no-qla", dest="qla", action="store_false", help="skip flash-qla's one-GPU call")
    simulate.add_link_args(p)
    p.add_argument("--csv", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="print every rank's timeline (compute between its exchange points) and kernel table "
                        "(torch.profiler, one step, ROWS kernels) for each CP method")
    p.add_argument("--smoke", action="store_true", help="CPU, reference core, tiny sizes: checks the script")
    args = p.parse_args(argv)
    args.max_segment = None                           # what simulate.rank_timeline reads
    if args.smoke:
        args.tokens, args.warmup, args.iters, args.dtype = [512], 0, 1, "float32"
        args.shapes = [n for n in args.shapes if n in TINY]
        shapes = {n: TINY[n] for n in args.shapes}
    else:
        shapes = {n: SHAPES[n] for n in args.shapes}
    os.environ.setdefault("FLA_FLASH_QLA", "0")      # fla's own kernels under every fla call; flash-qla's is noCP-qla
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke for the CPU check")
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype = getattr(torch, args.dtype)
    init_megatron(dev)
    write = row_writer(args.csv)
    for name, s in shapes.items():
        for T in args.tokens:
            for docs in args.docs:
                for W in args.cp:
                    for layout in args.layouts:
                        try:
                            case(name, s, T, docs, W, args, dev, dtype, write, layout)
                        except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
                            first = str(e).splitlines()[0][:160] if str(e) else ""
                            write(dict(model=s.model, tokens=T, docs=docs, heads=s.HV, W=W, layout=layout,
                                       note=f"error: {type(e).__name__}: {first}"))
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()


def row_writer(path, source="predicted"):
    """write(row): prints the row's main columns and appends it to the CSV at ``path`` (the results schema,
    ``benchmarks/schema.py``), whose header it writes first."""
    writer = Writer(path, source)

    def write(row):
        print(" ".join(f"{row.get(c, '')}" if not isinstance(row.get(c), float) else f"{row[c]:.4g}"
                       for c in ("level", "model", "tokens", "docs", "heads", "W", "method", "layout", "ms", "eff",
                                 "x_cp2hp", "err", "note")), flush=True)
        writer(row)
    return write


def init_megatron(dev):
    """One process, CP = TP = 1: Megatron's groups for the modules timed at CP=1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    if dev.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(0)
