"""fla's Gluon short-conv kernels over a packed local stream, each continuing segment reading its halo.

fla 0.6.0 ships its short conv twice: Triton kernels (its default) and Gluon kernels that keep a
token window in registers and recompute the activation inside the backward (fla enables them only
by ``FLA_CONV_GLUON`` and only outside distributed runs, where its own CP conv passes states). At
the mixers' shapes they are the faster of the two, forward and backward (BENCHMARKS.md, "The short
conv"). Their forward takes the halo as fla's initial conv state; their
backward takes no state and treats every segment as a sequence start. For each segment that
continues a sequence, :func:`_halo_fix_kernel` then recomputes what the halo changes: the input
gradient of the segment's first ``kernel_size - 1`` tokens, the halo rows' gradient, and the weight
and bias gradients' share of those tokens, written into the partial sums that fla's reduction adds
up, so every gradient is rounded once, as on fla's Triton path.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from megatron_kcp.kernels.conv_fla import halo_segments, halo_state
from megatron_kcp.plan import KCPPlan, index_tensor

BT, BD, BC = 64, 32, 16          # fla's Gluon backward: chunk, channel block, rows a thread unrolls
FIX_BD = 128                     # channels a program of the halo fix takes


@triton.jit
def _taps(x, halo_rows, bos, seg_len, piece, t, o_d, m_d, j, stride_x, D: tl.constexpr, HL: tl.constexpr):
    """Tap ``j`` of rows ``t`` of a segment: the token at ``t - HL + j`` ([len(t), BD] fp32), from the
    halo where that is before the segment, and the same without the halo (as fla's backward saw it)."""
    p = t - HL + j
    m = m_d[None, :]
    own = tl.load(x + (bos + p)[:, None] * stride_x + o_d[None, :], mask=((p >= 0) & (p < seg_len))[:, None] & m,
                  other=0).to(tl.float32)
    before = tl.load(halo_rows + (piece * HL + p + HL)[:, None] * D + o_d[None, :],
                     mask=((p < 0) & (p >= -HL))[:, None] & m, other=0).to(tl.float32)
    return own + before, own


@triton.jit
def _dpre(x, dy, weight, bias, halo_rows, bos, seg_len, piece, t, o_d, m_d, stride_x, stride_dy,
          D: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
          ACTIVATION: tl.constexpr):
    """The gradient at the pre-activation of the ``BR`` rows ``t`` (zero outside the segment): with the
    halo, and as fla's backward computed it, without."""
    HL: tl.constexpr = W - 1
    y = tl.zeros([BR, BLOCK], dtype=tl.float32)
    y0 = tl.zeros([BR, BLOCK], dtype=tl.float32)
    for j in tl.static_range(W):
        w_j = tl.load(weight + o_d * W + j, mask=m_d, other=0).to(tl.float32)[None, :]
        xh, x0 = _taps(x, halo_rows, bos, seg_len, piece, t, o_d, m_d, j, stride_x, D, HL)
        y += xh * w_j
        y0 += x0 * w_j
    g = tl.load(dy + (bos + t)[:, None] * stride_dy + o_d[None, :],
                mask=((t >= 0) & (t < seg_len))[:, None] & m_d[None, :], other=0).to(tl.float32)
    if ACTIVATION == "silu" or ACTIVATION == "swish":
        if HAS_BIAS:
            b = tl.load(bias + o_d, mask=m_d, other=0).to(tl.float32)[None, :]
            y += b
            y0 += b
        # fla's backward recomputes the pre-activation rounded to the input's dtype
        y = y.to(x.dtype.element_ty).to(tl.float32)
        y0 = y0.to(x.dtype.element_ty).to(tl.float32)
        s, s0 = tl.sigmoid(y), tl.sigmoid(y0)
        return g * s * (1 + y * (1 - s)), g * s0 * (1 + y0 * (1 - s0))
    return g, g


@triton.jit
def _halo_fix_kernel(x, dy, weight, bias, halo_rows, segs, dx, dhalo, dw_part, db_part, n_segs, first_part,
                     stride_x, stride_dy, D: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """One program per (channel block, continuing segment): the segment's first ``W - 1`` rows of
    ``dx`` (overwritten), its halo rows' gradient, and its weight and bias gradient corrections
    (partial-sum row ``first_part + segment``)."""
    HL: tl.constexpr = W - 1
    i_d, i_c = tl.program_id(0), tl.program_id(1)
    bos = tl.load(segs + i_c).to(tl.int64)
    seg_len = tl.load(segs + n_segs + i_c).to(tl.int64)
    piece = tl.load(segs + 2 * n_segs + i_c).to(tl.int64)
    o_d = i_d * BLOCK + tl.arange(0, BLOCK)
    m_d = o_d < D
    r = tl.arange(0, BR).to(tl.int64)
    m_r = r < HL
    b_dx = tl.zeros([BR, BLOCK], dtype=tl.float32)
    b_dh = tl.zeros([BR, BLOCK], dtype=tl.float32)
    for j in tl.static_range(W):
        w_j = tl.load(weight + o_d * W + j, mask=m_d, other=0).to(tl.float32)[None, :]
        # dx[s] = sum_j dpre[s + HL - j] w_j; the halo's row k: sum_j dpre[k - j] w_j
        d_dx, _ = _dpre(x, dy, weight, bias, halo_rows, bos, seg_len, piece, r + HL - j, o_d, m_d, stride_x,
                        stride_dy, D, W, BR, BLOCK, HAS_BIAS, ACTIVATION)
        d_dh, _ = _dpre(x, dy, weight, bias, halo_rows, bos, seg_len, piece, r - j, o_d, m_d, stride_x, stride_dy,
                        D, W, BR, BLOCK, HAS_BIAS, ACTIVATION)
        b_dx += d_dx * w_j
        b_dh += d_dh * w_j
    m_dx = (m_r & (r < seg_len))[:, None] & m_d[None, :]
    tl.store(dx + (bos + r)[:, None] * D + o_d[None, :], b_dx.to(dx.dtype.element_ty), mask=m_dx)
    tl.store(dhalo + (piece * HL + r)[:, None] * D + o_d[None, :], b_dh.to(dhalo.dtype.element_ty),
             mask=m_r[:, None] & m_d[None, :])
    # what the first HL rows add to the weight's and bias's gradients with the halo, less what fla added
    d1, d0 = _dpre(x, dy, weight, bias, halo_rows, bos, seg_len, piece, r, o_d, m_d, stride_x, stride_dy,
                   D, W, BR, BLOCK, HAS_BIAS, ACTIVATION)
    keep = m_r[:, None].to(tl.float32)
    d1, d0 = d1 * keep, d0 * keep
    part = first_part + i_c
    for j in tl.static_range(W):
        xh, x0 = _taps(x, halo_rows, bos, seg_len, piece, r, o_d, m_d, j, stride_x, D, HL)
        tl.store(dw_part + part * D * W + o_d * W + j, tl.sum(d1 * xh - d0 * x0, 0), mask=m_d)
    if HAS_BIAS:
        tl.store(db_part + part * D + o_d, tl.sum(d1 - d0, 0), mask=m_d)


@functools.lru_cache(maxsize=64)
def _segments(plan: KCPPlan, device: str):
    """(fla's chunk indices of the local segments, their count, the continuing segments' [start; length;
    halo piece] rows, how many) on ``device``, built once per plan."""
    from fla.ops.utils import prepare_chunk_indices
    cu = plan.cu_seqlens_tensor()
    chunks = prepare_chunk_indices(cu, BT, cu_seqlens_cpu=cu).to(device)
    segs, pieces = halo_segments(plan)
    cu_t = plan.cu_seqlens
    rows = [cu_t[i] for i in segs] + [cu_t[i + 1] - cu_t[i] for i in segs] + list(pieces)
    return chunks, len(chunks), index_tensor(rows, device) if segs else None, len(segs)


class GluonConv(torch.autograd.Function):
    """The conv of the local stream ``x`` ``[1, T, D]`` on fla's Gluon kernels; ``halo_rows``
    ``[pieces * (kernel_size - 1), D]`` or None (no CP)."""

    @staticmethod
    def forward(ctx, x, weight, bias, halo_rows, plan: KCPPlan, activation):
        from fla.modules.causal_conv1d.backends.gluon import causal_conv1d_fwd_gluon
        chunks, _, _, n = _segments(plan, str(x.device))
        state = halo_state(halo_rows, plan) if n else None
        y, _ = causal_conv1d_fwd_gluon(x, weight, bias, initial_state=state, activation=activation,
                                       cu_seqlens=plan.cu_seqlens_tensor(x.device), chunk_indices=chunks)
        ctx.save_for_backward(x, weight, bias, halo_rows)
        ctx.plan, ctx.activation = plan, activation
        return y

    @staticmethod
    def backward(ctx, dy):
        from fla.modules.causal_conv1d.backends.gluon import causal_conv1d_bwd_kernel, causal_conv1d_bwd_kernel_dwdb
        x, weight, bias, halo_rows = ctx.saved_tensors
        plan, act = ctx.plan, ctx.activation
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        chunks, nt, segs, n = _segments(plan, str(x.device))
        _, T, D = x.shape
        W = weight.shape[1]
        dx = torch.empty((1, T, D), dtype=x.dtype, device=x.device)
        dw_part = torch.empty((nt + n, D, W), dtype=torch.float32, device=x.device)
        db_part = torch.empty((nt + n, D), dtype=torch.float32, device=x.device) if bias is not None else None
        causal_conv1d_bwd_kernel[(triton.cdiv(D, BD), nt, 1)](
            x=x, weight=weight, bias=bias, dy=dy, dx=dx, dw_partial=dw_part, db_partial=db_part,
            cu_seqlens=plan.cu_seqlens_tensor(x.device), chunk_indices=chunks, T=T, SXN=x.stride(0),
            SXT=x.stride(1), SYN=dy.stride(0), SYT=dy.stride(1), SYD=dy.stride(2), D=D, W=W, BT=BT, BD=BD, BC=BC,
            ACTIVATION=act, num_warps=4)
        dhalo = None
        if halo_rows is not None:
            dhalo = torch.zeros_like(halo_rows)
            if n:
                _halo_fix_kernel[(triton.cdiv(D, FIX_BD), n)](
                    x, dy, weight, bias, halo_rows, segs, dx, dhalo, dw_part, db_part, n, nt, x.stride(1),
                    dy.stride(1), D=D, W=W, BR=max(2, triton.next_power_of_2(W - 1)), BLOCK=FIX_BD,
                    HAS_BIAS=bias is not None, ACTIVATION=act)
        dw = torch.empty_like(weight)
        db = torch.empty_like(bias) if bias is not None else None
        grid = (triton.cdiv(D * W, BD),)
        causal_conv1d_bwd_kernel_dwdb[grid](dw_part, db_part, dw, db, NP=nt + n, D=D, W=W, BD=BD, num_warps=4)
        return dx, dw, db, dhalo, None, None


def local_conv(x, weight, bias, activation, plan: KCPPlan, rows):
    """fla's Gluon conv over the local segments, each continuing segment reading its halo.

    Args:
        x: ``[1, T, D]``, this rank's stream (its rows may be strided); weight:
            ``[D, kernel_size]`` with kernel_size 2 to 4; bias: ``[D]`` or None.
        rows: the halo rows ``[pieces * (kernel_size - 1), D]`` (:mod:`megatron_kcp.parallel.halo`;
            None: no CP).
    Returns:
        ``[1, T, D]``, contiguous.
    """
    x = x if x.stride(-1) == 1 else x.contiguous()       # the kernels step over channels one by one
    return GluonConv.apply(x, weight.contiguous(), bias, rows, plan, activation)
