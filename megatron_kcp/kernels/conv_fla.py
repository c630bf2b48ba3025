"""fla's short causal conv over a packed local stream, each segment that continues a sequence starting
from its halo (:mod:`megatron_kcp.parallel.halo`) as fla's conv initial state."""
from __future__ import annotations

import functools

import torch

from megatron_kcp.plan import KCPPlan, index_tensor


class _HaloToState(torch.autograd.Function):
    """Halo rows ``[P * (ks - 1), D]`` -> fla's conv initial states ``[num_segments, D, ks]`` (zero where a
    segment starts its sequence); backward: the states' gradient back onto the halo rows."""

    @staticmethod
    def forward(ctx, rows_in, plan: KCPPlan):
        ctx.plan, ctx.shape = plan, rows_in.shape
        return halo_state(rows_in, plan)

    @staticmethod
    def backward(ctx, dstate):
        segs, pieces = halo_segments(ctx.plan)
        plan = ctx.plan
        dhalo = dstate.new_zeros(plan.num_pieces, plan.halo_len, ctx.shape[1])
        if segs:
            rows = dstate[..., 1:].index_select(0, index_tensor(segs, dstate.device))
            dhalo.index_copy_(0, index_tensor(pieces, dstate.device), rows.transpose(1, 2))
        return dhalo.view(ctx.shape), None


@functools.lru_cache(maxsize=64)
def halo_segments(plan: KCPPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(segments that continue a sequence from an earlier piece, the piece each starts)."""
    starts = {s: p for p, (s, _) in enumerate(plan.pieces)}
    pairs = [(i, starts[s]) for i, s in enumerate(plan.seg_start) if s in starts and plan.pred[i] is not None]
    return tuple(i for i, _ in pairs), tuple(p for _, p in pairs)


def halo_state(rows_in: torch.Tensor, plan: KCPPlan) -> torch.Tensor:
    """Halo rows ``[P * (ks - 1), D]`` -> fla's conv initial states ``[num_segments, D, ks]`` (zero where a
    segment starts its sequence)."""
    segs, pieces = halo_segments(plan)
    state = rows_in.new_zeros(plan.num_segments, rows_in.shape[1], plan.conv_kernel_size)
    if segs:
        rows = rows_in.view(plan.num_pieces, plan.halo_len, -1).index_select(0, index_tensor(pieces, rows_in.device))
        state[..., 1:].index_copy_(0, index_tensor(segs, rows_in.device), rows.transpose(1, 2))
    return state


@functools.lru_cache(maxsize=64)
def _equal_segments(plan: KCPPlan) -> bool:
    cu = plan.cu_seqlens
    return len({b - a for a, b in zip(cu, cu[1:])}) == 1


def local_conv(x, weight, bias, activation, plan: KCPPlan, rows):
    """fla's conv over the local segments, each continuing segment starting from its halo.

    Args:
        x: ``[1, T, D]``, this rank's stream; weight: ``[D, kernel_size]``; bias: ``[D]`` or None.
        rows: the halo rows ``[pieces * (kernel_size - 1), D]`` (:mod:`megatron_kcp.parallel.halo`;
            None: no CP). Every rank passes them where CP runs (zeros where no segment continues): the
            halo's gradient then reaches the backward collective on every rank, which all must join.
    Returns:
        ``[1, T, D]``. Segments of one length (a rank's zigzag pieces, Megatron's ``[s, b]`` rows) go
        as a batch of rows, whose backward kernel is faster than fla's varlen one.
    """
    from fla.modules.causal_conv1d import causal_conv1d as conv
    state = _HaloToState.apply(rows, plan).contiguous() if rows is not None else None
    if _equal_segments(plan):
        n = plan.num_segments
        y, _ = conv(x.view(n, -1, x.shape[-1]), weight, bias, initial_state=state, activation=activation)
        return y.view(x.shape)
    y, _ = conv(x, weight, bias, initial_state=state, activation=activation,
                cu_seqlens=plan.cu_seqlens_tensor(x.device), cu_seqlens_cpu=plan.cu_seqlens_tensor())
    return y
