"""The short conv's halo: the ``kernel_size - 1`` tokens before each local piece, from other ranks.

Each piece's first tokens need the tokens before it in the same sequence, which live at the tail of
earlier pieces (of one or several ranks when pieces are short). Ranks all-gather the tails of their
pieces; backward sums every rank's halo gradient back onto the tails' owners with one
reduce-scatter. Tokens never cross a sequence boundary: a halo row before a sequence start is zero.
"""
from __future__ import annotations

import functools

import torch

from megatron_kcp.parallel.comm import all_gather, reduce_scatter
from megatron_kcp.parallel.plan import KCPPlan


@functools.lru_cache(maxsize=32)
def _tail_rows(plan: KCPPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(local row of each piece's last ``halo_len`` tokens, whether the piece has that token): a piece
    shorter than the halo reads row 0 there, masked to zero."""
    hl = plan.halo_len
    rows, off = [], 0
    for s, e in plan.pieces:
        n = e - s
        rows += [off + n - hl + j for j in range(hl)]
        off += n
    rows = torch.tensor(rows, dtype=torch.long)
    return rows.clamp(min=0), (rows >= 0)[:, None]


@functools.lru_cache(maxsize=32)
def _halo_rows(plan: KCPPlan) -> torch.Tensor:
    """Row of every halo token in the flattened all-gathered tails (the last row: zeros)."""
    P, hl = plan.num_pieces, plan.halo_len
    zero = plan.world_size * P * hl
    return torch.tensor([(r * P + q) * hl + row if r >= 0 else zero for r, q, row in plan.halo_src],
                        dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _on(plan: KCPPlan, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tail rows, their mask, halo rows) on ``device``, copied once: a copy per call would sync the host."""
    rows, has = _tail_rows(plan)
    return rows.to(device), has.to(device), _halo_rows(plan).to(device)


class HaloExchange(torch.autograd.Function):
    """The local stream ``[T, D]`` -> the halo rows ``[pieces * (kernel_size - 1), D]`` of its pieces,
    in piece order (zero where no token of the same sequence is there). Only the tails are read and
    written: the stream, the conv's whole input, is never copied."""

    @staticmethod
    def forward(ctx, x, plan: KCPPlan, group):
        tails_idx, has, src = _on(plan, str(x.device))
        hl, P = plan.halo_len, plan.num_pieces
        tails = x.index_select(0, tails_idx).masked_fill_(~has, 0).view(P, hl, -1)
        gathered = all_gather(tails, group) if plan.world_size > 1 else tails[None]
        gathered = torch.cat([gathered.flatten(0, 2), x.new_zeros(1, x.shape[1])])
        ctx.plan, ctx.group, ctx.T = plan, group, x.shape[0]
        return gathered[src]

    @staticmethod
    def backward(ctx, dhalo):
        plan = ctx.plan
        tails_idx, has, src = _on(plan, str(dhalo.device))
        W, P, hl = plan.world_size, plan.num_pieces, plan.halo_len
        dall = dhalo.new_zeros(W * P * hl + 1, dhalo.shape[1]).index_add_(0, src, dhalo)[:-1]
        dtails = reduce_scatter(dall.view(W, P * hl, -1), ctx.group) if W > 1 else dall
        dtails = dtails.reshape(P * hl, -1).masked_fill(~has, 0)
        return dhalo.new_zeros(ctx.T, dhalo.shape[1]).index_add_(0, tails_idx, dtails), None, None


def halo(x: torch.Tensor, plan: KCPPlan, group) -> torch.Tensor:
    """``HaloExchange.apply(x, plan, group)``: the halo rows of the local stream ``x`` ``[T, D]``."""
    return HaloExchange.apply(x, plan, group)
