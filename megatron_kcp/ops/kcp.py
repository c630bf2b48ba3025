"""The KCP ops the mixers call: the gated delta rule (GDN and KDA) and the short conv over CP shards.

Each rank passes its shard of the packed stream (Megatron's CP layout, described by a
:class:`~megatron_kcp.plan.KCPPlan`) and gets its shard of the output, equal to the
single-device run forward and backward. Which local core and exchange strategy run is
:func:`megatron_kcp.ops.dispatch.decide`'s.
"""
from __future__ import annotations

import torch

from megatron_kcp.kernels import conv_reference

from megatron_kcp.ops import dispatch
from megatron_kcp.options import CONV_ENV, Options
from megatron_kcp.parallel import halo
from megatron_kcp.plan import MAX_HEAD_DIM, KCPPlan, cp_group_from_megatron, split_segments

CONV_BACKENDS = ("auto", "reference", "fla", "gluon", "qla")


def check_inputs(q, k, v, g, beta, plan: KCPPlan, initial_state=None) -> None:
    """Shape checks that name the fix; run before any kernel."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be the packed local stream [1, T, H, K], got {tuple(q.shape)}")
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims K={K}, V={V}: the chunked kernels support at most {MAX_HEAD_DIM}; "
                         "use more heads of a smaller head dim")
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or HV % H:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k must match q, v must be "
                         "[1, T, HV, V] with HV a multiple of H")
    if g.shape not in ((1, T, HV), (1, T, HV, K)) or beta.shape != (1, T, HV):
        raise ValueError(f"g {tuple(g.shape)} must be [1, T, HV] (GDN) or [1, T, HV, K] (KDA) and beta "
                         f"{tuple(beta.shape)} [1, T, HV] with T={T}, HV={HV}, K={K}")
    if T != plan.num_local_tokens:
        raise ValueError(f"this rank holds {T} tokens but cu_seqlens / CP layout give it {plan.num_local_tokens} "
                         f"(global {plan.num_local_tokens * plan.world_size}): cu_seqlens[-1] must equal "
                         "the local length times the CP size")
    if initial_state is not None and initial_state.shape != (plan.num_seqs, HV, K, V):
        raise ValueError(f"initial_state must be [num_seqs={plan.num_seqs}, {HV}, {K}, {V}], "
                         f"got {tuple(initial_state.shape)}")


def gated_delta_rule(q, k, v, g, beta, plan: KCPPlan, group=None, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                     backend: str = "auto", strategy: str = "auto", max_segment: int | None = None) -> torch.Tensor:
    """The gated delta rule on this rank's shard.

    Args:
        q, k: ``[1, T, H, K]``; v: ``[1, T, HV, V]`` (HV a multiple of H; value head i reads q/k head
            ``i // (HV / H)``); g: ``[1, T, HV]`` (GDN) or ``[1, T, HV, K]`` (KDA), natural-log decay;
            beta: ``[1, T, HV]``. T is this rank's token count under ``plan``.
        plan: this rank's plan (``plan_for_cp_group``); group: the CP group (default Megatron's).
        scale: of q (default ``K ** -0.5``).
        initial_state: ``[N, HV, K, V]``, one state per global sequence (the same on every rank); its
            gradient on each rank is that rank's share (sum over the CP group for the total).
        use_qk_l2norm: l2-normalise q and k inside the op.
        backend: the local core, ``auto`` | ``reference`` | ``fla`` | ``qla``.
        strategy: ``auto`` | ``relay`` | ``gather`` | ``cp2hp`` (megatron-core's all-to-all, the peer) |
            ``convert`` (the contiguous layout and back around the exchange; ``auto`` converts where the
            cost model says it pays, to head shards as cp2hp does where the heads divide the CP size
            and no initial state is passed; for KDA on a contiguous plan where a rank's step is
            host-bound, fla's own CP call) | ``fla-cp`` (fla's own CP call, on a contiguous plan).
        max_segment: split local segments into parts of at most this many tokens, chained by the
            all-gather; 0 never; None: the kernels' pick (``dispatch.qla_max_segment``, ``fla_max_segment``).
    Returns:
        o ``[1, T, HV, V]`` in v's dtype.
    """
    check_inputs(q, k, v, g, beta, plan, initial_state)
    chosen = dispatch.decide(plan, q, v, g, backend, strategy, max_segment, initial_state)
    exchange = chosen.exchange()
    exchange.check(q, v, plan, initial_state)
    if group is None and plan.world_size > 1:
        group = cp_group_from_megatron()[0]
    if chosen.max_segment and not chosen.layout:
        plan = split_segments(plan, chosen.max_segment)
    core = dispatch.build_core(chosen.core, q, v, g)
    return exchange.apply(core, q, k, v, g, beta, plan, group, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                          initial_state=initial_state, use_qk_l2norm=use_qk_l2norm)


def causal_conv1d(x, weight, bias=None, activation: str | None = "silu", plan: KCPPlan = None, group=None,
                  backend: str = "auto") -> torch.Tensor:
    """Depthwise causal conv of this rank's shard, each piece reading the tokens before it (the halo).

    Args:
        x: ``[1, T, D]``, this rank's stream; weight: ``[D, kernel_size]``; bias: ``[D]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
        plan: this rank's plan, built with ``conv_kernel_size=kernel_size``; group: the CP group.
        backend: ``auto`` (:func:`conv_backend`), ``reference``, ``fla`` / ``qla`` (fla's Triton kernels:
            flash-qla has no conv) or ``gluon`` (fla's Gluon kernels, Hopper and newer).
    Returns:
        ``[1, T, D]``.
    """
    return causal_conv1ds([x], [weight], [bias], activation, plan, group, backend)[0]


def causal_conv1ds(xs, weights, biases=None, activation: str | None = "silu", plan: KCPPlan = None, group=None,
                   backend: str = "auto") -> list[torch.Tensor]:
    """:func:`causal_conv1d` of several streams of one plan (KDA's q, k and v), their halos in one
    exchange each way: one collective forward and one backward, not one a conv.

    Args:
        xs: ``[1, T, D_i]`` each, of one dtype; weights: ``[D_i, kernel_size]`` each, one kernel size;
            biases: ``[D_i]`` or None each (None: none at all); the rest as :func:`causal_conv1d`.
    Returns:
        ``[1, T, D_i]`` each.
    """
    biases = [None] * len(xs) if biases is None else biases
    if plan is None:
        raise ValueError("causal_conv1d needs a KCP plan: plan_for_cp_group(cu_seqlens, layout, conv_kernel_size)")
    if not len(xs) == len(weights) == len(biases) > 0:
        raise ValueError(f"causal_conv1ds: {len(xs)} streams, {len(weights)} weights, {len(biases)} biases: give one "
                         "weight and one bias (or None) a stream")
    for x, weight in zip(xs, weights):
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != plan.num_local_tokens:
            raise ValueError(f"x must be the packed local stream [1, {plan.num_local_tokens}, D], got {tuple(x.shape)}")
        if plan.conv_kernel_size != weight.shape[-1]:
            raise ValueError(f"plan was built for conv kernel size {plan.conv_kernel_size}, weight has "
                             f"{weight.shape[-1]}: build the plan with conv_kernel_size={weight.shape[-1]}")
    if len({x.dtype for x in xs}) != 1:
        raise ValueError(f"causal_conv1ds: the streams' dtypes differ ({sorted({str(x.dtype) for x in xs})}): "
                         "cast them to one")
    if plan.max_segment:
        raise ValueError("causal_conv1d takes the layout's plan, not one split by max_segment (its halo follows the "
                         "pieces): pass the plan the mixer built")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}: use 'silu' or None")
    backend = conv_backend(xs[0].device, xs[0].dtype, plan.conv_kernel_size, backend)
    if group is None and plan.world_size > 1:
        group = cp_group_from_megatron()[0]
    if backend == "gluon":
        from megatron_kcp.kernels import conv_gluon as local
    elif backend == "fla":
        from megatron_kcp.environment import check_fla
        from megatron_kcp.kernels import conv_fla as local
        check_fla(xs[0].device)
    else:
        local = conv_reference
    rows = [None] * len(xs)
    # the reference's taps read halo rows on one rank too; fla's kernels only where a piece may continue
    # on another rank, and there every rank joins the exchange, forward and backward, whether or not a
    # segment of its own continues
    if plan.halo_len and (plan.world_size > 1 or local is conv_reference):
        streams, rows = halo.halos([x[0] for x in xs], plan, group)
        xs = [x[None] for x in streams]
    return [local.local_conv(x, w, b, activation, plan, r) for x, w, b, r in zip(xs, weights, biases, rows)]


def conv_backend(device: torch.device, dtype: torch.dtype, kernel_size: int, backend: str = "auto") -> str:
    """The conv kernels a call runs, ``reference`` | ``fla`` (fla's Triton kernels) | ``gluon`` (fla's
    Gluon kernels). ``auto`` means ``KCP_CONV`` where set, else Gluon's where they run (measured faster
    forward and backward: BENCHMARKS.md, "The short conv"), fla's Triton kernels elsewhere on CUDA, the
    reference on the CPU. A backend named (or set in ``KCP_CONV``) that cannot run here is an error."""
    if backend not in CONV_BACKENDS:
        raise ValueError(f"unknown conv backend {backend!r}: choose one of {CONV_BACKENDS}")
    if backend == "auto":
        backend = Options.from_env().conv or "auto"
        if backend not in CONV_BACKENDS:
            raise ValueError(f"{CONV_ENV}={backend!r} is not a conv backend: set one of {CONV_BACKENDS} or unset it")
    from megatron_kcp.environment import check_gluon_conv, gluon_conv_runs
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        return "gluon" if gluon_conv_runs(device, dtype, kernel_size) else "fla"
    if backend == "gluon":
        check_gluon_conv(device, dtype, kernel_size)
    return "fla" if backend == "qla" else backend
