"""Short causal depthwise conv1d over a packed local stream, with the CP halo exchange.

Each piece's first tokens need the ``kernel_size - 1`` tokens before it in the same sequence,
which live at the tail of earlier pieces (of one or several ranks when pieces are short).
Ranks all-gather the tails of their pieces; backward sums every rank's halo gradient back onto
the tails' owners with one reduce-scatter. Tokens never cross a sequence boundary.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_kcp.parallel.comm import all_gather, reduce_scatter
from megatron_kcp.parallel.plan import KCPPlan


@functools.lru_cache(maxsize=32)
def _halo_rows(plan: KCPPlan) -> torch.Tensor:
    """Row of every halo token in the flattened all-gathered tails (the last row: zeros)."""
    P, hl = plan.num_pieces, plan.halo_len
    zero = plan.world_size * P * hl
    return torch.tensor([(r * P + q) * hl + row if r >= 0 else zero for r, q, row in plan.halo_src],
                        dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _indices(plan: KCPPlan):
    """(tail rows into [x; 0], conv taps into [x; halo; 0]) for this plan."""
    T, P, hl = plan.num_local_tokens, plan.num_pieces, plan.halo_len
    piece_start, tails = [], []
    off = 0
    for s, e in plan.pieces:
        n = e - s
        piece_start.append(off)
        tails += [off + n - hl + j if n - hl + j >= 0 else T for j in range(hl)]
        off += n
    zero = T + P * hl
    taps = []
    cu = plan.cu_seqlens
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        p = max(j for j, ps in enumerate(piece_start) if ps <= a)
        first_of_piece = piece_start[p] == a
        for t in range(a, b):
            row = []
            for j in range(hl + 1):
                src = t - hl + j
                if src >= a:
                    row.append(src)
                elif first_of_piece:
                    row.append(T + p * hl + hl + (src - a))
                else:
                    row.append(zero)
            taps.append(row)
    return torch.tensor(tails, dtype=torch.long), torch.tensor(taps, dtype=torch.long).view(T, hl + 1)


@functools.lru_cache(maxsize=32)
def _on(plan: KCPPlan, device: str):
    """(tail rows, conv taps, halo rows) on ``device``, copied once: a copy per call would sync the host."""
    tails, taps = _indices(plan)
    return tails.to(device), taps.to(device), _halo_rows(plan).to(device)


class HaloExchange(torch.autograd.Function):
    """Local ``[T, D]`` -> ``[P * (kernel_size - 1), D]`` halo rows (zero where no same-sequence token)."""

    @staticmethod
    def forward(ctx, x, plan: KCPPlan, group):
        tails_idx, _, src = _on(plan, str(x.device))
        hl, P = plan.halo_len, plan.num_pieces
        xz = torch.cat([x, x.new_zeros(1, x.shape[1])])
        tails = xz[tails_idx].view(P, hl, -1)
        gathered = all_gather(tails, group) if plan.world_size > 1 else tails[None]
        gathered = torch.cat([gathered.flatten(0, 2), x.new_zeros(1, x.shape[1])])
        ctx.plan, ctx.group, ctx.T = plan, group, x.shape[0]
        ctx.save_for_backward(src)
        return gathered[src]

    @staticmethod
    def backward(ctx, dhalo):
        src, = ctx.saved_tensors
        plan = ctx.plan
        W, P, hl = plan.world_size, plan.num_pieces, plan.halo_len
        dall = dhalo.new_zeros(W * P * hl + 1, dhalo.shape[1]).index_add_(0, src, dhalo)[:-1]
        dtails = reduce_scatter(dall.view(W, P * hl, -1), ctx.group) if W > 1 else dall
        tails_idx = _on(plan, str(dhalo.device))[0]
        dx = dhalo.new_zeros(ctx.T + 1, dhalo.shape[1]).index_add_(0, tails_idx, dtails)
        return dx[:-1], None, None


def causal_conv1d(x, weight, bias=None, activation: str | None = "silu", plan: KCPPlan | None = None,
                  group=None):
    """x ``[1, T, D]`` (packed local stream), weight ``[D, kernel_size]``, bias ``[D]``."""
    if plan.conv_kernel_size != weight.shape[-1]:
        raise ValueError(f"plan was built for conv kernel size {plan.conv_kernel_size}, weight has {weight.shape[-1]}: "
                         f"build the plan with conv_kernel_size={weight.shape[-1]}")
    x2 = x[0]
    taps = _on(plan, str(x.device))[1]
    parts = [x2]
    if plan.halo_len:
        parts.append(HaloExchange.apply(x2, plan, group))
    parts.append(x2.new_zeros(1, x2.shape[1]))
    xe = torch.cat(parts)
    # one gathered [T, D] view per tap, never the [T, ks, D] window tensor
    y = sum(xe[taps[:, j]] * weight[:, j].to(xe.dtype) for j in range(taps.shape[1]))
    if bias is not None:
        y = y + bias
    if activation in ("silu", "swish"):
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}: use 'silu' or None")
    return y[None]
