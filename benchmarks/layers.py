"""Layer level: KCPGatedDeltaNet and megatron-core's GatedDeltaNet (CP=1 and CP=W, cp2hp), and the
KDA mixer (CP=1, and CP=W with KCP and with cp2hp), with the same config and weights, fwd+bwd,
Megatron's local layers; per --docs: one sequence ([s, b] batch, zigzag over CP), or a THD batch of
packed documents (PackedSeqParams, documents padded to multiples of 2W, Megatron's per-document zigzag
over CP). megatron-core's rows run fla's kernels as the process's ``FLA_FLASH_QLA`` says (bench_ops.py:
off unless set); where flash-qla runs the problem, ``megatron-qla`` and ``cp2hp-qla`` add them with fla
handing the call to flash-qla, as megatron-core runs where flash-qla is installed. Our mixers' rows say
in ``note`` what their op ran (``strategy S, core C`` as the ``KCP active`` line prints it). ``--profile
ROWS``: after timing each of ``--profile-methods``, every rank's profile of one step. ``--graph METHODS``:
after each of those rows, ``METHOD-graph``: the same step (fwd+bwd, collectives included) captured once in a
CUDA graph and replayed, which is the step without its host time; where capture fails, the row says why.
``--kcp-parts N``: GDN rows ``kcp-partsN``, our mixer with its op's segments split into parts of N tokens
on flash-qla's core (not the kernels' pick), beside the default's ``kcp``; ``--graph kcp`` captures them too."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from benchmarks.catalogue import cu_seqlens
from benchmarks.common import env, rel_err, split_parts
from benchmarks.table import Table
from benchmarks.timing import Bench


def _packed(docs, T, W):
    """(PackedSeqParams of the THD batch, or None for one sequence; local rows of rank r)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_kcp.plan import build_plan, local_token_index
    from megatron_kcp.testing.layers import zigzag_rows
    if docs == "single":
        return None, lambda t, cp, r: t if cp == 1 else zigzag_rows(t, cp, r)
    cu = cu_seqlens(docs, T, pad=2 * W)
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=cu_t,
                             cu_seqlens_kv_padded=cu_t, max_seqlen_q=longest, max_seqlen_kv=longest)

    def rows(t, cp, r):
        return t if cp == 1 else t[local_token_index(build_plan(cu, "zigzag_per_doc", cp, r)).to(t.device)]
    return params, rows


def _graphed(b: Bench, meta, step, check, note):
    """The row of ``step`` captured once in a CUDA graph and replayed; ``check(y)``: the error of a replay's
    output ``y`` (and of the input gradient it wrote)."""
    from megatron_kcp.testing.graphs import capture
    meta = dict(meta, method=f"{meta['method']}-graph", **{"pass": "fwd+bwd"})
    if not b.cuda:
        return [dict(meta, note="n/a on the CPU: CUDA graphs")]
    try:
        graph, y = capture(step, warmup=max(1, b.args.warmup))
        ms, _ = b.measure(graph.replay)
    except Exception as e:  # noqa: BLE001 - a module that cannot be captured: say why
        return b.failed(meta, ["fwd+bwd"], e)
    err = b.max_over_ranks([check(y.detach())])[0]
    return [dict(meta, ms=ms, err=err, note="; ".join(filter(None, [note, "captured in a CUDA graph, replayed"])))]


@contextlib.contextmanager
def _picks():
    """What our op decides to run in the mixer's step: each ``Dispatch.describe()``, once (none for megatron-core's)."""
    from megatron_kcp.ops import dispatch
    seen, decide = {}, dispatch.decide

    def spy(*args, **kwargs):
        chosen = decide(*args, **kwargs)
        seen[chosen.describe()] = None
        return chosen
    with mock.patch.object(dispatch, "decide", spy):
        yield seen


def layers_case(b: Bench, model, T, H, table, solo, docs="single"):
    """The mixers at CP=1 and CP=W with the same weights, fwd+bwd."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_kcp.environment import qla_runs
    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    from megatron_kcp.testing.layers import Shape, build, config
    args, W, rank, dev = b.args, b.W, b.rank, b.device
    shape = Shape(hidden=args.hidden, heads=(H, H), head_dim=args.head_dim, seq=T, batch=1, device=dev.type)
    kw = dict(bf16=True, params_dtype=torch.bfloat16) if b.dtype == torch.bfloat16 else {}
    if not b.cuda:
        kw["deterministic_mode"] = True          # megatron's pure-torch GDN path (fla's kernels need CUDA)
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    gen = torch.Generator(device=dev).manual_seed(T + H)
    x, dy = (torch.randn(T, 1, args.hidden, generator=gen, device=dev, dtype=b.dtype) for _ in range(2))
    m = model.lower()
    # KDA's cp2hp: megatron-core has no KDA module, so our mixer with the all-to-all around its kernel
    variants = [("noCP", 1, None, {}), ("cp2hp", W, None, {"strategy": "cp2hp"}), ("kcp", W, None, {})]
    if model == "GDN":
        variants = [("megatron", 1, GatedDeltaNet, {}), ("noCP", 1, KCPGatedDeltaNet, {}),
                    ("cp2hp", W, GatedDeltaNet, {}), ("kcp", W, KCPGatedDeltaNet, {})]
        if qla_runs(dev, b.dtype, False, (args.head_dim, args.head_dim)):
            variants[1:1] = [("megatron-qla", 1, GatedDeltaNet, {})]
            variants[-1:-1] = [("cp2hp-qla", W, GatedDeltaNet, {})]
        variants += [(f"kcp-parts{n}", W, KCPGatedDeltaNet, {"parts": n}) for n in args.kcp_parts]
    state, y_ref, dx_ref = None, None, None
    packed, rows_of = _packed(docs, T, W)
    for method, cp, cls, options in variants:
        meta = dict(level="layers", model=model, tokens=T, docs=docs, heads=H, method=method,
                    layout=("zigzag" if packed is None else "zigzag_per_doc") if cp > 1 else "-", W=cp)
        if cls is GatedDeltaNet and packed is not None and not b.cuda:
            table.add(dict(meta, **{"pass": "fwd+bwd"}, note="n/a on the CPU: megatron-core's GatedDeltaNet "
                           "runs packed sequences with fla's kernels only"))
            continue
        qla = env(FLA_FLASH_QLA="1") if method.endswith("-qla") else contextlib.nullcontext()
        parts, options = options.get("parts"), {k: v for k, v in options.items() if k != "parts"}
        try:
            with qla, split_parts(parts):             # megatron-core's call handed to flash-qla, or not
                mod = build(m, config(m, shape, cp, **kw), solo if cp == 1 else mpu, dev.type, cls=cls, **options)
                mod = mod.to(b.dtype)
                if state is None:
                    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mod.state_dict().items()}
                mod.load_state_dict(state)

                def local(t, cp=cp):
                    return rows_of(t, cp, rank)
                leaf, dyl = local(x).clone().requires_grad_(), local(dy).contiguous()

                def step():
                    for p in [leaf, *mod.parameters()]:
                        p.grad = None
                    y, _ = mod(leaf, None, packed_seq_params=packed)
                    y.backward(dyl)
                    return y
                with _picks() as picks:
                    y = step().detach()              # first call: output and input gradient against CP=1's
                if y_ref is None:
                    y_ref, dx_ref = y, leaf.grad.clone()

                def error(y, cp=cp):
                    return max(rel_err(y, rows_of(y_ref, cp, rank)), rel_err(leaf.grad, rows_of(dx_ref, cp, rank)))
                err = b.max_over_ranks([error(y)])[0]
                rows = [dict(r, note="; ".join(picks)) for r in
                        b.rows(meta, lambda pas: step, {"fwd+bwd": leaf.nbytes + dyl.nbytes}, err, ["fwd+bwd"])]
                if args.profile and method in args.profile_methods:
                    b.profile(step, f"layers {method} {model} H={H} T={T} {docs}", args.profile)
                if method.split("-parts")[0] in args.graph:
                    rows += _graphed(b, meta, step, error, "; ".join(picks))
        except Exception as e:  # noqa: BLE001 - e.g. megatron's module refusing a config: say why
            rows = b.failed(meta, ["fwd+bwd"], e)
        for r in rows:
            table.add(r)
        mod = step = None                        # free this variant before building the next
        if b.cuda:
            torch.cuda.empty_cache()


def run_layers(b: Bench, table: Table):
    """Every layer-level case of the command line (at the first --heads); --budget skips those left."""
    from megatron.core import parallel_state as ps

    from megatron_kcp.testing.layers import solo_pg
    args, W = b.args, b.W
    if not b.cuda:
        import megatron.core.ssm.gated_delta_net.common as common

        from megatron_kcp.kernels.reference import l2norm
        common.l2norm = l2norm           # fla's l2norm is a Triton kernel; megatron's CPU path needs this one
    ps.initialize_model_parallel(context_parallel_size=W)
    solo = solo_pg()
    for T in args.tokens:
        for model in args.models:
            for docs in args.docs:
                if b.out_of_time():
                    table.skipped(level="layers", model=model, tokens=T, docs=docs, heads=args.heads[0], W=W)
                    continue
                layers_case(b, model, T, args.heads[0], table, solo, docs)
