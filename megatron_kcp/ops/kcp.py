"""The KCP ops the mixers call: gated delta rule (GDN/KDA) and short conv over CP shards.

One CP step for every layout and any number of documents: a *core* computes on ranges of the
local segments (``backend="fla"``: fla's kernels on CUDA, ``core_fla``; ``"qla"``: flash-qla's
fused GDN kernels, ``core_qla``; ``"reference"``: the pure-PyTorch oracle, ``core_reference``;
``"auto"``: qla where it runs (GDN, bf16/fp16, K = V = 128, Hopper or Blackwell, flash-qla
installed) and is worth it (``qla_worth``; or, with few heads and a few long segments a rank, on
a ``split`` plan, ``qla_split``), fla elsewhere on CUDA, the reference on CPU; without CP on CUDA,
fla's own chunk call, ``single_device``: nothing to exchange) and an
exchange *strategy* decides what crosses ranks and when (``"relay"``: true states point to point
along each sequence; ``"gather"``: one all-gather of affine maps per direction; ``"auto"``: the
cost model's pick, ``megatron_kcp.parallel.strategy``; under qla, the relay wherever a map would
be needed, except on a split plan). ``"cp2hp"`` is not KCP but its peer,
megatron-core GatedDeltaNet's all-to-all to head shards (``megatron_kcp.parallel.cp2hp``), for
comparisons under the same mixer.
"""
from __future__ import annotations

import functools

import torch

from megatron_kcp.ops import conv_reference
from megatron_kcp.parallel.gather import AllGather
from megatron_kcp.parallel.plan import MAX_HEAD_DIM, KCPPlan, build_plan, cp_group_from_megatron, index_tensor, split
from megatron_kcp.parallel.relay import Relay
from megatron_kcp.parallel.strategy import STRATEGIES, choose, needs_maps

BACKENDS = ("auto", "reference", "fla", "qla")
EXCHANGES = (*STRATEGIES, "cp2hp")


def _backend(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown KCP backend {backend!r}: choose one of {BACKENDS}")
    if backend == "auto":
        return "fla" if x.is_cuda else "reference"
    return backend


def kernels(backend: str, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, plan: KCPPlan,
            strategy: str = "auto", max_segment: int | None = None) -> tuple[str, str, int]:
    """(the core that runs: fla, qla, reference, or chunk: fla's own single-device call; the exchange:
    relay or gather; the length its plan's segments are cut to, 0: not cut) for this call.
    ``max_segment=None``: qla's cut where it pays. ``auto`` without CP on a GPU is ``chunk``
    (``single_device``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown KCP backend {backend!r}: choose one of {BACKENDS}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown KCP exchange strategy {strategy!r}: choose one of {EXCHANGES}")
    if max_segment is not None and max_segment < 0:
        raise ValueError(f"max_segment must be >= 0 (0: segments not cut; None: the kernels' pick), got {max_segment}")
    if backend == "auto" and max_segment is None and plan.world_size == 1 and q.is_cuda:
        return "chunk", strategy if strategy != "auto" else "gather", 0
    if max_segment is None:
        qla = backend == "qla" or backend == "auto" and q.is_cuda and qla_runs(q, v, g)
        max_segment = qla_split(plan, v.shape[2]) if qla and strategy != "relay" else 0
    if max_segment:
        if strategy == "relay":
            raise ValueError("a plan cut by max_segment chains its parts through the all-gather's fold: use "
                             "strategy='gather' (or 'auto'), or max_segment=0 for the relay")
        if backend == "auto":
            backend = "reference" if not q.is_cuda else "qla" if qla_runs(q, v, g) else "fla"
        return backend, "gather", max_segment
    name = choose(plan, v.shape[2]) if strategy == "auto" else strategy
    maps = name == "gather" and plan.world_size > 1 and needs_maps(plan.global_cu_seqlens, plan.layout,
                                                                   plan.world_size)
    if backend == "auto":
        if not q.is_cuda:
            return "reference", name, 0
        backend = "qla" if not maps and qla_worth(plan, v.shape[2]) and qla_runs(q, v, g) else "fla"
    if backend == "qla" and maps and strategy == "auto":
        name = "relay"           # what ran and measured (W = 2, H = 64); qla's all-gather with maps did not
    return backend, name, 0


QLA_MIN_CHAINS = 32          # heads x (local tokens / longest local segment): below, qla's scans are latency-bound
QLA_MAX_INTERLEAVED = 64     # segments a rank holds on per-document zigzag: above, qla's covering passes lose
QLA_SPLIT_CHAINS = 128       # scans a rank runs side by side once its segments are cut (an H200 has 132 SMs)
QLA_SPLIT_MIN_WORK = 1 << 18  # local tokens x heads: below, a cut step is bound by its host launches
QLA_SPLIT_MIN_PART = 4096     # tokens: shorter parts add launches (fold steps) to a host-bound step


def qla_worth(plan: KCPPlan, value_heads: int) -> bool:
    """Whether flash-qla's fused kernels beat fla's on this plan, from what every rank shares (all ranks
    must pick alike). qla runs a segment's state pass and its output as one scan per head, so a
    rank's time is at least its longest segment's scan: with few heads and one long segment per rank
    (GDN, H = 16, one 32k sequence, 2 x H200) it is latency-bound, 6.2 ms against fla's 5.1; with
    10 documents, 3.5 against 6.0, and at H = 64 1.3-2.4x ahead of fla. On per-document zigzag its
    state passes cover the whole range between the segments that need them: at 100 documents (200
    segments a rank, H = 64) 30.2 ms against fla's 26.6, at 10 (20 segments) 8.9 against 11.8."""
    return _qla_worth(plan.global_cu_seqlens, plan.layout, plan.world_size, value_heads)


@functools.lru_cache(maxsize=256)
def _qla_worth(cu_seqlens: tuple[int, ...], layout: str, world_size: int, value_heads: int) -> bool:
    plans = [build_plan(cu_seqlens, layout, world_size, r) for r in range(world_size)]
    chains = min(p.num_local_tokens / max(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])) for p in plans)
    if value_heads * chains < QLA_MIN_CHAINS:
        return False
    return layout != "zigzag_per_doc" or max(p.num_segments for p in plans) <= QLA_MAX_INTERLEAVED


def qla_split(plan: KCPPlan, value_heads: int) -> int:
    """Where flash-qla's scans would be latency-bound (``qla_worth``'s first test fails: few heads, a
    few long segments a rank), the length (a multiple of the 64-token chunk, at least
    ``QLA_SPLIT_MIN_PART``) that cuts the busiest rank's stream into ``QLA_SPLIT_CHAINS`` scans; 0
    where no cut is needed or none pays. The parts' maps then run at once under the all-gather and
    fold locally (``plan.split``). Measured on one H200 (simulate.py, one call), GDN, H = 16, one
    sequence, cut to 4096: at CP = 1 4.3 ms against fla's 6.1 on 32k; at CP = 2 5.1-5.3 against
    fla's 5.7-7.4 on 32k and 7.0-7.2 against 8.5-8.6 on 64k. Below 16k tokens x 16 heads a rank the
    step is bound by its host (``QLA_SPLIT_MIN_WORK``); parts of 2048 tokens were slower than 4096
    at CP = 2 on 32k (7.3 against 6.9 ms with fla's maps) and 8192 slower at CP = 1 (5.5 against 4.4)."""
    return _qla_split(plan.global_cu_seqlens, plan.layout, plan.world_size, value_heads)


@functools.lru_cache(maxsize=256)
def _qla_split(cu_seqlens: tuple[int, ...], layout: str, world_size: int, value_heads: int) -> int:
    plans = [build_plan(cu_seqlens, layout, world_size, r) for r in range(world_size)]
    longest = max(max(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])) for p in plans)
    chains = min(p.num_local_tokens for p in plans) / longest
    tokens = max(p.num_local_tokens for p in plans)
    if value_heads * chains >= QLA_MIN_CHAINS or tokens * value_heads < QLA_SPLIT_MIN_WORK or \
            layout == "zigzag_per_doc" and max(p.num_segments for p in plans) > QLA_MAX_INTERLEAVED:
        return 0
    cut = max(QLA_SPLIT_MIN_PART, -(-tokens * value_heads // (QLA_SPLIT_CHAINS * 64)) * 64)
    return cut if cut < longest else 0


def qla_runs(q: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether flash-qla can run this problem here (``core_qla.check_qla`` says why not)."""
    return _qla_runs(q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]))


@functools.lru_cache(maxsize=64)
def _qla_runs(device, dtype, kda, head_dims) -> bool:
    from megatron_kcp.ops import core_qla
    try:
        core_qla.check_qla(device, dtype, kda, head_dims)
    except (ValueError, RuntimeError):
        return False
    return True


def check_inputs(q, k, v, g, beta, plan: KCPPlan, initial_state=None):
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


class KCPFunction(torch.autograd.Function):
    """One rank's KCP step: ``o`` of its shard, equal to the single-device run, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, init, plan: KCPPlan, group, scale, l2, core, strategy):
        starts = [i for i in range(plan.num_segments) if plan.pred[i] is None]
        # the initial states that can be nonzero: received ones, and the user's (the core skips the rest)
        kept = sorted({c.segment for c in plan.recv_fwd} | (set(starts) if init is not None else set()))
        P = core.prepare(q, k, v, g, beta, plan, scale, l2, live=frozenset(kept))
        h0 = q.new_zeros(plan.num_segments, v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
        ix = functools.partial(index_tensor, device=h0.device)      # no list indexing: it syncs the host
        if init is not None:
            h0.index_copy_(0, ix(starts), init.float().index_select(0, ix([plan.seg_seq[i] for i in starts])))
        o, extra = strategy.forward(core, P, plan, group, h0)
        ctx.save_for_backward(*P.tensors(), h0.index_select(0, ix(kept)), extra)
        ctx.kept, ctx.starts, ctx.has_init = kept, starts, init is not None
        ctx.dtypes = [x.dtype for x in (q, k, v, g, beta)]
        ctx.plan, ctx.group, ctx.scale, ctx.l2, ctx.core, ctx.strategy = plan, group, scale, l2, core, strategy
        return o

    @staticmethod
    def backward(ctx, do):
        *saved, h0_kept, extra = ctx.saved_tensors
        plan, core = ctx.plan, ctx.core
        P = core.restore(saved, plan, ctx.scale, ctx.l2, live=frozenset(ctx.kept))
        h0 = h0_kept.new_zeros(plan.num_segments, *h0_kept.shape[1:])
        h0.index_copy_(0, index_tensor(ctx.kept, h0.device), h0_kept)
        do = do.contiguous()
        grads, dh0 = ctx.strategy.backward(core, P, plan, ctx.group, h0, do, extra)
        dq, dk, dv, dg, db = (d.to(t) for d, t in zip(core.finish(P, grads), ctx.dtypes))
        dinit = None
        if ctx.has_init:
            # the user's state enters a sequence only where it starts; elsewhere dh0 flowed to earlier ranks
            dinit = dh0.new_zeros(plan.num_seqs, *dh0.shape[1:])
            ix = functools.partial(index_tensor, device=dh0.device)
            dinit.index_add_(0, ix([plan.seg_seq[i] for i in ctx.starts]), dh0.index_select(0, ix(ctx.starts)))
        return dq, dk, dv, dg, db, dinit, None, None, None, None, None, None


def _core(backend: str, q, v, g):
    if backend == "qla":
        from megatron_kcp.ops import core_qla
        return core_qla.core(q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]))
    if backend == "fla":
        from megatron_kcp.ops import core_fla
        return core_fla.core(kda=g.dim() == 4, device=g.device)
    from megatron_kcp.ops.core_reference import ReferenceCore
    return ReferenceCore()


def gated_delta_rule(q, k, v, g, beta, plan: KCPPlan, group=None, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                     backend: str = "auto", strategy: str = "auto", max_segment: int | None = None) -> torch.Tensor:
    """o ``[1, T, HV, V]`` of this rank's shard; equals the single-device run, forward and backward.

    ``initial_state`` ``[N, HV, K, V]`` holds one state per global sequence (the same on every
    rank); its gradient on each rank is that rank's share (sum over the CP group for the total).
    ``group`` defaults to Megatron's context-parallel group. ``max_segment`` > 0 cuts the local
    segments into parts of at most that many tokens, chained by the all-gather (``plan.split``);
    0 never; None: where qla's scans would be latency-bound (``qla_split``).
    """
    check_inputs(q, k, v, g, beta, plan, initial_state)
    if strategy not in EXCHANGES:
        raise ValueError(f"unknown KCP exchange strategy {strategy!r}: choose one of {EXCHANGES}")
    if group is None and plan.world_size > 1:
        group = cp_group_from_megatron()[0]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if strategy == "cp2hp" and plan.world_size > 1:
        check_cp2hp(q.shape[2], v.shape[2], plan.world_size, initial_state)
        if max_segment:
            raise ValueError("max_segment cuts KCP's segments and strategy 'cp2hp' has none: drop it, or use a KCP "
                             "strategy")
        if backend == "qla":
            raise ValueError("strategy 'cp2hp' runs fla's kernels, as megatron-core's peer does: use backend 'fla' "
                             "or 'auto'")
        return _cp2hp(plan, group, g.dim() == 4, _backend(backend, q), scale, use_qk_l2norm, q.device)(q, k, v, g, beta)
    backend, name, cut = kernels(backend, q, v, g, plan, "auto" if strategy == "cp2hp" else strategy, max_segment)
    if backend == "chunk":
        return single_device(q, k, v, g, beta, plan, scale, initial_state, use_qk_l2norm)
    if cut:
        plan = split(plan, cut)
    return KCPFunction.apply(q, k, v, g, beta, initial_state, plan, group, scale, use_qk_l2norm,
                             _core(backend, q, v, g), Relay() if name == "relay" else AllGather())


def single_device(q, k, v, g, beta, plan: KCPPlan, scale: float, initial_state=None, l2: bool = False):
    """Without CP there is nothing to exchange: fla's own chunk call over the local sequences, the
    call megatron-core's mixer makes (fla hands GDN to flash-qla where that is installed, with its
    intra-GPU split). Our step at W = 1 ran the map passes and fold of a cut plan instead: one H100,
    GDN, H = 16, 32k tokens, the mixer's fwd+bwd 14.3 ms against megatron-core's 11.1."""
    from megatron_kcp.ops import core_fla
    kda = g.dim() == 4
    core_fla.core(kda=kda, device=q.device)                  # the environment check
    if kda:
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    # fp32 gate: flash-qla's backward needs it (and fla's kernels cumsum the gate in fp32 either way)
    o, _ = fn(q, k, v, g.float(), beta, scale=scale, initial_state=initial_state, output_final_state=False,
              use_qk_l2norm_in_kernel=l2, cu_seqlens=plan.cu_seqlens_tensor(q.device),
              cu_seqlens_cpu=plan.cu_seqlens_tensor())
    return o


def check_cp2hp(heads: int, value_heads: int, world_size: int, initial_state=None) -> None:
    """What the all-to-all to head shards needs, with the fix (also called by the mixers at construction)."""
    if heads != value_heads or heads % world_size:
        raise ValueError(f"strategy 'cp2hp' splits the heads over the CP ranks: it needs as many q/k as v heads "
                         f"(got {heads} and {value_heads}) and a head count divisible by the CP size {world_size}; "
                         "change the heads or the CP size, or use a KCP strategy (auto, relay, gather)")
    if initial_state is not None:
        raise ValueError("strategy 'cp2hp' takes no initial_state: use a KCP strategy (auto, relay, gather)")


@functools.lru_cache(maxsize=64)
def _cp2hp(plan: KCPPlan, group, kda: bool, backend: str, scale: float, l2: bool, device: torch.device):
    """The all-to-all step for this plan (every rank's plan of its layout gives the token order), over the
    single-device kernel (o of the whole sequence, this rank's heads): fla's chunk kernel on CUDA, the
    chunked reference elsewhere."""
    from megatron_kcp.parallel.cp2hp import CP2HP
    if backend == "fla":
        from megatron_kcp.ops import core_fla
        core_fla.core(kda=kda, device=device)          # the environment check
        if kda:
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn

        def kernel(q, k, v, g, beta, cu, cu_cpu):
            # fp32 gate: fla 0.6.0 sends GDN to flash-qla when that is installed, whose backward needs it
            return fn(q, k, v, g.float(), beta, scale=scale, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                      cu_seqlens_cpu=cu_cpu)[0]
    else:
        from megatron_kcp.ops import reference

        def kernel(q, k, v, g, beta, cu, cu_cpu):
            return reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm=l2,
                                                    cu_seqlens=cu_cpu)[0]
    cu = plan.global_cu_seqlens
    plans = [build_plan(cu, plan.layout, plan.world_size, r, plan.conv_kernel_size) for r in range(plan.world_size)]
    return CP2HP(kernel, plans, cu, group, device)


def causal_conv1d(x, weight, bias=None, activation: str | None = "silu", plan: KCPPlan = None, group=None,
                  backend: str = "auto") -> torch.Tensor:
    """Depthwise causal conv of the packed local stream ``[1, T, D]``, weight ``[D, kernel_size]``."""
    if plan is None:
        raise ValueError("causal_conv1d needs a KCP plan: plan_for_cp_group(cu_seqlens, layout, conv_kernel_size)")
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != plan.num_local_tokens:
        raise ValueError(f"x must be the packed local stream [1, {plan.num_local_tokens}, D], got {tuple(x.shape)}")
    if plan.conv_kernel_size != weight.shape[-1]:
        raise ValueError(f"plan was built for conv kernel size {plan.conv_kernel_size}, weight has {weight.shape[-1]}: "
                         f"build the plan with conv_kernel_size={weight.shape[-1]}")
    if plan.max_segment:
        raise ValueError("causal_conv1d takes the layout's plan, not one cut by max_segment (its halo follows the "
                         "pieces): pass the plan the mixer built")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r}: use 'silu' or None")
    if group is None and plan.world_size > 1:
        group = cp_group_from_megatron()[0]
    if _backend(backend, x) == "fla":
        from megatron_kcp.ops import core_fla
        core_fla.core(kda=False, device=x.device)          # the environment check
        return core_fla.causal_conv1d(x, weight, bias, activation, plan, group)
    return conv_reference.causal_conv1d(x, weight, bias, activation, plan, group)
