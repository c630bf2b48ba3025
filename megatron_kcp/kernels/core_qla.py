"""The local core of a KCP step for GDN on flash-qla's fused TileLang kernels (Hopper, Blackwell).

Implements :class:`megatron_kcp.kernels.core.LocalCore`. flash-qla fuses what fla runs as separate
kernels: the state pass with the output (``fused_gdr_fwd``) and the state-gradient pass with the
rest of the backward (``fused_gdr_bwd``). Its stand-alone passes (``fused_gdr_h``: final states,
or chunk states; ``fused_gdr_dh``: initial-state gradients) give what the exchange must send early.
So this core takes the step apart differently from ``core_fla``: ``state`` runs a pass only where a successor takes
the final state, ``output`` runs the fused forward from the initial states (its own state pass),
``backward_state`` runs a pass only where a predecessor (or the user's initial state) takes the
gradient, and ``backward_rest`` runs the fused backward from the final-state gradients. Every pass
keeps its states in fp32 (flash-qla's own top-level call, ``auto_cp``, exchanges them in bf16: the
step does not use it; ``single_device``, the call on a whole stream of head shards, is that call).
``maps`` runs one state pass from zero states in the kernel's CP mode, which computes the transition
M beside the final state H in the same scan (:func:`_maps_pass`); the backward's ``M^T`` is the
forward's. That is what a plan with ``max_segment`` needs at few heads (:func:`qla_max_segment`).

A pass runs once over the range from the first to the last segment that needs it (every segment
in between computed and dropped): one launch, never a gather of tokens. On contiguous and zigzag
layouts that range is one segment a piece; on per-document zigzag it is most of the stream.

A pass on a group of value heads (the relay's pipeline) runs on contiguous copies of the heads' part
of its range's inputs (q/k heads: those the value heads read). Its kernels write nothing that
``output`` or ``backward_rest`` read (``state`` and ``backward_state`` only return rows, and the
final-state gradients stay whole in ``Backward.dht``), so nothing is copied back.
"""
from __future__ import annotations

import functools
import importlib

import torch

from megatron_kcp import environment
from megatron_kcp.calibration import CALIBRATION
from megatron_kcp.environment import check_qla
from megatron_kcp.kernels import registry
from megatron_kcp.kernels.core import Backward, Prepared, States, heads_of, may_be_nonzero
from megatron_kcp.plan import KCPPlan, all_plans, index_tensor


@functools.lru_cache(maxsize=None)
def _kernels():
    """flash-qla's entry points the core calls (its kernels, and its top-level call for ``single_device``),
    and fla's l2norm (Triton, tuned once for both cores; the CPU tests put a reference of each contract
    here)."""
    from types import SimpleNamespace

    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from flash_qla import chunk_gated_delta_rule
    from flash_qla.ops.gated_delta_rule import chunk as C
    from flash_qla.ops.utils import group_reduce_vector
    from flash_qla.utils.index import prepare_varlen_metadata
    if C.CHUNK_SIZE != 64:
        raise RuntimeError(f"flash-qla runs chunks of {C.CHUNK_SIZE} on this GPU; the qla core needs 64: "
                           "use backend='fla'")
    return SimpleNamespace(chunk_local_cumsum=C.chunk_local_cumsum, kkt_solve=C.kkt_solve, fused_gdr_h=C.fused_gdr_h,
                           maps_pass=_maps_pass,
                           fused_gdr_fwd=C.fused_gdr_fwd, fused_gdr_dh=C.fused_gdr_dh, fused_gdr_bwd=C.fused_gdr_bwd,
                           group_reduce_vector=group_reduce_vector, prepare_varlen_metadata=prepare_varlen_metadata,
                           l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd, chunk_gated_delta_rule=chunk_gated_delta_rule)


def _maps_pass(k, v, a, g, b, cu_seqlens, num_chunks):
    """(H ``[N, HV, K, V]``, M ``[N, HV, K, K]``) fp32 of the N sequences of ``cu_seqlens``: one state
    pass from zero states. flash-qla's state-pass kernel, in the mode its own CP runs it (a chunk count
    per sequence and head given), computes M beside H in the same scan. That scan takes about as long
    as two plain passes, but nothing is filled for it: no zero values, identity states or zero initial
    states (benchmarks/reports/, host time). Its wrapper (``fused_gdr_h`` with ``num_warmup_chunks``) stores
    both in bf16 for flash-qla's exchange; the kernel is built here with fp32 outputs, as every state
    the step exchanges.

    Args:
        k, v, a, g, b: as ``fused_gdr_h`` takes them (``a``: the triangular solve's; ``g``: cumsummed, fp32).
        cu_seqlens: int32 on the device, flash-qla's chunk metadata attached.
        num_chunks: ``[N, HV]`` int32, each sequence's chunk count (M is computed only where the pass
            runs every chunk).
    """
    from flash_qla.utils import prepare_chunk_offsets
    _, T, Hg, K = k.shape
    HV, V, N = v.shape[2], v.shape[3], len(cu_seqlens) - 1
    offsets, chunks = prepare_chunk_offsets(cu_seqlens, 64)
    kernel = _maps_kernel(HV, Hg, K, V, k.dtype, g.dtype, b.dtype, cu_seqlens.dtype, chunks * 64 != T)
    h0, H = (k.new_empty(N, HV, K, V, dtype=torch.float32) for _ in range(2))      # h0: not read
    M = k.new_empty(N, HV, K, K, dtype=torch.float32)
    kernel(k, v, a, g, b, h0, cu_seqlens, offsets.to(cu_seqlens.dtype), num_chunks, k.new_empty(1, 0, HV, K, V), H, M)
    return H, M


@functools.lru_cache(maxsize=64)
def _maps_kernel(HV, Hg, K, V, qkva_dtype, g_dtype, b_dtype, seqlen_dtype, partial_tile: bool):
    """:func:`_maps_pass`'s kernel, built once per shape by flash-qla's builder of the state pass
    (``tilelang_prepare_h`` of the GPU's kernel module): tilelang's lookup of a built kernel parses its
    arguments on every call. Blackwell's builder also takes whether the last chunk is partial; Hopper's
    kernel reads the lengths."""
    from flash_qla.ops.gated_delta_rule import chunk as C
    build = importlib.import_module(C.fused_gdr_h.__module__).tilelang_prepare_h
    tile = {"has_incomplete_tile": partial_tile} if "has_incomplete_tile" in build.signature.parameters else {}
    return build(HV, Hg, K, V, 64, qkva_dtype=qkva_dtype, g_dtype=g_dtype, b_dtype=b_dtype, h0_dtype=torch.float32,
                 ht_dtype=torch.float32, h_dtype=qkva_dtype, seqlen_dtype=seqlen_dtype, accum_dtype="float32",
                 use_initial_state=False, store_final_state=True, store_h=False, is_varlen=True, is_cp=True,
                 state_v_first=False, **tile)


@functools.lru_cache(maxsize=256)
def _cu(plan: KCPPlan, lo: int, hi: int, device: str):
    """(token start, end, int32 cu_seqlens of segments [lo, hi) on the device with flash-qla's chunk
    metadata attached: its kernels then never read lengths back to the host)."""
    a, b = plan.token_range(lo, hi)
    cpu = torch.tensor(plan.cu_seqlens[lo:hi + 1], dtype=torch.int32) - a
    return a, b, _kernels().prepare_varlen_metadata(cpu.to(device), cpu)


@functools.lru_cache(maxsize=256)
def _chunks(plan: KCPPlan, lo: int, hi: int, HV: int, device: str) -> torch.Tensor:
    """Each segment of [lo, hi)'s chunk count, per value head: ``[hi - lo, HV]`` int32 on the device."""
    n = torch.tensor(plan.cu_seqlens[lo:hi + 1]).diff().add(63).div(64, rounding_mode="floor")
    return n.to(torch.int32)[:, None].expand(-1, HV).contiguous().to(device)


def _cover(segs) -> tuple[int, int] | None:
    return (min(segs), max(segs) + 1) if segs else None


def _on_heads(heads: slice | None, HV: int, *xs, dim: int = 2):
    """``xs`` on the value heads ``heads`` (their q/k heads for q and k), contiguous; as they are for None."""
    return list(xs) if heads is None else [heads_of(x, heads, HV, dim).contiguous() for x in xs]


def _width(heads: slice | None, HV: int) -> int:
    """Value heads in ``heads`` (all HV for None)."""
    return HV if heads is None else heads.stop - heads.start


class GDNQLACore:
    """Gated DeltaNet on flash-qla: one log-decay per head (``g`` ``[1, T, HV]``), cumsummed in fp32."""
    fused = True                 # output and backward_rest run their own passes: a pass only for what leaves
    head_slices = True           # a pass on a head group copies its heads' inputs (see the module docstring)
    # a pass is one scan per head and sequence, latency-bound at the heads a rank holds: a group's pass
    # takes about as long as all heads', so the pipeline does not pay (measured: benchmarks/reports/)
    min_group_heads = None
    # a pass reads every state row of its range, or none (None to the kernel) where all are zero: with
    # many documents a range holds hundreds of rows, and a rank that receives no state (or sends no
    # gradient back) then neither fills nor reads them
    state_reads = "nonzero"

    def prepare(self, q, k, v, g, beta, plan, scale, use_qk_l2norm, live=None) -> Prepared:
        K = _kernels()
        q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
        _, _, cu = _cu(plan, 0, plan.num_segments, str(k.device))
        qr = kr = None
        # k's norm and the triangular solve (which reads no gate) go first: the solve is the step's first
        # long kernel, and while it runs the host issues q's norm and the gate's cumsum, which the GPU
        # would otherwise wait for on a slow host (one H100: benchmarks/results/gaps_h100x1.txt; level
        # on an H200 pair's host, benchmarks/results/prepare_order_h200x2.csv)
        if use_qk_l2norm:
            k, kr = K.l2norm_fwd(k)
        A = K.kkt_solve(k=k, b=beta, chunk_size=64, cu_seqlens=cu)
        if use_qk_l2norm:
            q, qr = K.l2norm_fwd(q)
        # the backward's gate gradient comes out in g's dtype, and flash-qla needs it in fp32
        gc = K.chunk_local_cumsum(g.float().contiguous(), chunk_size=64, cu_seqlens=cu)
        return Prepared((q, k, v, gc, beta, qr, kr, A), plan, scale, use_qk_l2norm, live=live)

    def _range(self, P, lo, hi):
        """(q, k, v, A, g, beta) on the tokens of segments [lo, hi), and the range's cu_seqlens: the
        saved tensors themselves where the range is the whole stream, as the output's and the
        backward's are (six slices a call are host time on a step that can be host-bound)."""
        q, k, v, g, beta, _, _, A = P.saved
        a, b, cu = _cu(P.plan, lo, hi, str(q.device))
        xs = (q, k, v, A, g, beta)
        return (list(xs) if b - a == q.shape[1] else [x[:, a:b] for x in xs]), cu

    def states(self, P: Prepared, h0) -> States:
        return States(h0)           # the fused forward runs each segment from its initial state

    def state(self, P: Prepared, st: States, segs, h0, heads=None):
        """Final states of ``segs`` (rows of the others undefined): a pass over the segments whose
        final state a successor takes, from their initial states in ``h0``."""
        HV = h0.shape[1]
        need = _cover([s for s in segs if P.plan.succ[s] is not None])
        if not need:
            return h0.new_empty(len(segs), _width(heads, HV), *h0.shape[2:])
        lo, hi = need
        (_, k, v, A, g, beta), cu = self._range(P, lo, hi)
        k, v, A, g, beta = _on_heads(heads, HV, k, v, A, g, beta)
        h0 = _on_heads(heads, HV, h0[lo:hi], dim=1)[0] if may_be_nonzero(P, lo, hi) else None
        _, ht, _ = _kernels().fused_gdr_h(k=k, v=v, a=A, g=g, b=beta, initial_state=h0,
                                          output_final_state=True, output_h=False, cu_seqlens=cu)
        return self._rows(ht, segs, lo, hi)

    @staticmethod
    def _rows(rows, segs, lo, hi):
        """A row per segment of ``segs`` from ``rows`` (one per segment of [lo, hi); segments outside it undefined)."""
        if tuple(segs) == tuple(range(lo, hi)):
            return rows
        out = rows.new_empty(len(segs), *rows.shape[1:])
        pos = [j for j, s in enumerate(segs) if lo <= s < hi]
        out.index_copy_(0, index_tensor(pos, out.device),
                        rows.index_select(0, index_tensor([segs[j] - lo for j in pos], out.device)))
        return out

    def output(self, P, st: States, lo, hi):
        (q, k, v, A, g, beta), cu = self._range(P, lo, hi)
        o, _, _ = _kernels().fused_gdr_fwd(q=q, k=k, v=v, a=A, g=g, b=beta, scale=P.scale,
                                           initial_state=st.h0[lo:hi] if may_be_nonzero(P, lo, hi) else None,
                                           output_final_state=False,
                                           output_h=False, cu_seqlens=cu)
        return o

    def maps(self, P, segs):
        """[H | M] fp32 of ``segs`` from one of flash-qla's state passes over the range that covers them
        (:func:`_maps_pass`)."""
        lo, hi = _cover(segs)
        (_, k, v, A, g, beta), cu = self._range(P, lo, hi)
        H, M = _kernels().maps_pass(k, v, A, g, beta, cu, _chunks(P.plan, lo, hi, v.shape[2], str(v.device)))
        return self._rows(torch.cat([H, M], -1), segs, lo, hi)

    def backward_prepare(self, P, lo, hi, h0, do) -> Backward:
        """The chunk states from the initial states (the fused backward reads them), while the
        final-state gradients travel."""
        (q, k, v, A, g, beta), cu = self._range(P, lo, hi)
        do = do[:, slice(*P.plan.token_range(lo, hi))]
        h, _, _ = _kernels().fused_gdr_h(k=k, v=v, a=A, g=g, b=beta, output_final_state=False, output_h=True,
                                         initial_state=h0 if may_be_nonzero(P, lo, hi) else None, cu_seqlens=cu)
        return Backward(lo, hi, (q, k, v, g, beta, A, do, h))      # dht: set by backward_state

    def backward_state(self, P: Prepared, B: Backward, segs, dht, heads=None):
        """Initial-state gradients of ``segs`` (rows of the others undefined): a pass over the
        segments whose gradient leaves (a predecessor's, or the user's initial state's). ``dht`` (every
        head) is kept for ``backward_rest``."""
        B.dht, HV = dht, dht.shape[1]
        need = _cover([s for s in segs if P.live is None or s in P.live])
        if not need:
            return dht.new_empty(len(segs), _width(heads, HV), *dht.shape[2:])
        lo, hi = need
        (q, k, _, A, g, beta), cu = self._range(P, lo, hi)
        a = P.plan.token_range(B.lo, B.hi)[0]
        do = B.xs[6][:, slice(*(t - a for t in P.plan.token_range(lo, hi)))]
        q, k, A, g, beta, do = _on_heads(heads, HV, q, k, A, g, beta, do)
        dht = _on_heads(heads, HV, dht[lo - B.lo:hi - B.lo], dim=1)[0] if may_be_nonzero(P, lo, hi, grad=True) else None
        _, dh0 = _kernels().fused_gdr_dh(q=q, k=k, a=A, g=g, b=beta, do=do, dht=dht,
                                         output_dh0=True, output_dh=False, scale=P.scale, cu_seqlens=cu)
        return self._rows(dh0, segs, lo, hi)

    def backward_rest(self, P, B: Backward):
        if B.dht is None:
            raise RuntimeError("backward_rest before backward_state: the final-state gradients are unknown")
        K = _kernels()
        q, k, v, g, beta, A, do, h = B.xs
        _, _, cu = _cu(P.plan, B.lo, B.hi, str(q.device))
        dht = B.dht if may_be_nonzero(P, B.lo, B.hi, grad=True) else None
        dq, dk, dv, dg, db, _ = K.fused_gdr_bwd(q=q, k=k, v=v, a=A, g=g, b=beta, do=do, dht=dht, h=h,
                                                scale=P.scale, cu_seqlens=cu)
        H, HV = k.shape[2], v.shape[2]
        if HV > H:       # grouped value heads: q/k gradients summed per q/k head, by flash-qla's kernel
            # (torch's sum over the group dimension is slower: benchmarks/reports/, the one-sequence profile)
            dq, dk = K.group_reduce_vector(dq, H), K.group_reduce_vector(dk, H)
        dg = K.chunk_local_cumsum(dg, chunk_size=64, reverse=True, cu_seqlens=cu, zero_last_chunk=True)
        return dq, dk, dv, dg, db

    def finish(self, P: Prepared, grads):
        dq, dk, dv, dg, db = grads
        if P.use_qk_l2norm:
            q, k, _, _, _, qr, kr = P.saved[:7]
            dq, dk = _kernels().l2norm_bwd(q, qr, dq), _kernels().l2norm_bwd(k, kr, dk)
        return dq, dk, dv, dg, db

    def single_device(self, q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                      cu_seqlens_cpu):
        # flash-qla's own call (with its intra-GPU split), not fla's: fla hands it GDN only while its
        # backend switch (FLA_FLASH_QLA) is on, and this core was picked to run flash-qla's kernels
        return _kernels().chunk_gated_delta_rule(q, k, v, g.float(), beta, scale=scale, initial_state=initial_state,
                                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                 cu_seqlens=cu_seqlens)[0]


def core(device: torch.device, dtype: torch.dtype, kda: bool, head_dims: tuple[int, int]) -> GDNQLACore:
    """flash-qla's GDN core, after the environment check for this problem."""
    check_qla(device, dtype, kda, head_dims)
    return GDNQLACore()


def qla_worth(plan: KCPPlan, value_heads: int) -> bool:
    """Whether flash-qla's fused kernels beat fla's on this plan. qla runs a segment's state pass and
    its output as one scan per head, so a rank's time is at least its longest segment's scan: with
    few heads and one long segment a rank it is latency-bound (heads x chains below
    ``CALIBRATION.qla_min_chains``). On per-document zigzag its state passes cover the whole range between
    the segments that need them, which loses with many documents (``qla_max_interleaved``)."""
    return _qla_worth(plan.global_cu_seqlens, plan.layout, plan.world_size, value_heads)


@functools.lru_cache(maxsize=256)
def _qla_worth(cu_seqlens: tuple[int, ...], layout: str, world_size: int, value_heads: int) -> bool:
    plans = all_plans(cu_seqlens, layout, world_size)
    chains = min(p.num_local_tokens / max(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])) for p in plans)
    if value_heads * chains < CALIBRATION.qla_min_chains:
        return False
    return layout != "zigzag_per_doc" or max(p.num_segments for p in plans) <= CALIBRATION.qla_max_interleaved


def qla_max_segment(plan: KCPPlan, value_heads: int) -> int:
    """Where flash-qla's scans are latency-bound enough that the split's extra passes pay (heads x
    chains below ``qla_split_below``: one or two long segments a rank, even at 64 heads), the part
    length (a multiple of the 64-token chunk) that splits the busiest rank's stream into
    ``qla_split_chains`` scans; 0 where no split is needed or none pays (a step too small to be
    anything but host-bound, or no segment longer than that part or ``qla_split_min_part``). Parts are at
    least ``qla_split_min_part`` long, or a ``qla_split_max_parts``-th of the sequence where that is
    shorter: every part's state travels in the all-gather to every rank and steps its fold, so
    shorter parts paid on the GPU runs where the sequence held 16 of them (W = 2 and 4) and lost
    where it held 64 (W = 8, predicted; benchmarks/reports/). On one long sequence, flash-qla's own
    intra-GPU split (``autocp.decide``, its fitted kernel-time model) picks parts of the same order.
    The constants: :class:`megatron_kcp.calibration.Calibration`."""
    return _qla_max_segment(plan.global_cu_seqlens, plan.layout, plan.world_size, value_heads)


@functools.lru_cache(maxsize=256)
def _qla_max_segment(cu_seqlens: tuple[int, ...], layout: str, world_size: int, value_heads: int) -> int:
    C = CALIBRATION
    plans = all_plans(cu_seqlens, layout, world_size)
    longest = max(max(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])) for p in plans)
    chains = min(p.num_local_tokens for p in plans) / longest
    tokens = max(p.num_local_tokens for p in plans)
    if value_heads * chains >= C.qla_split_below or tokens * value_heads < C.qla_split_min_work or \
            layout == "zigzag_per_doc" and max(p.num_segments for p in plans) > C.qla_max_interleaved:
        return 0
    part = -(-tokens * value_heads // (C.qla_split_chains * 64)) * 64
    if max(part, C.qla_split_min_part) >= longest:
        return 0
    return max(part, min(C.qla_split_min_part, -(-cu_seqlens[-1] // (C.qla_split_max_parts * 64)) * 64))


registry.register(registry.CoreEntry(
    name="qla", label="flash-qla", runs_on="GDN on Hopper and Blackwell with flash-qla installed (K = V = 128)",
    runs=lambda p: p.cuda and environment.qla_runs(p.device, p.dtype, p.kda, p.head_dims),
    build=lambda device, dtype, kda, head_dims: core(device, dtype, kda, head_dims), priority=30,
    min_group_heads=GDNQLACore.min_group_heads, worth=lambda p: qla_worth(p.plan, p.value_heads),
    gather_maps=False, split=lambda p: qla_max_segment(p.plan, p.value_heads), saves=CALIBRATION.qla_saves))
