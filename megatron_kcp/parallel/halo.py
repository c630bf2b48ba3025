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
def _tail_rows(plan: KCPPlan) -> torch.Tensor:
    """Local row of each piece's last ``halo_len`` tokens (``T``, a zero row, where the piece is shorter)."""
    T, hl = plan.num_local_tokens, plan.halo_len
    rows, off = [], 0
    for s, e in plan.pieces:
        n = e - s
        rows += [off + n - hl + j if n - hl + j >= 0 else T for j in range(hl)]
        off += n
    return torch.tensor(rows, dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _halo_rows(plan: KCPPlan) -> torch.Tensor:
    """Row of every halo token in the flattened all-gathered tails (the last row: zeros)."""
    P, hl = plan.num_pieces, plan.halo_len
    zero = plan.world_size * P * hl
    return torch.tensor([(r * P + q) * hl + row if r >= 0 else zero for r, q, row in plan.halo_src],
                        dtype=torch.long)


@functools.lru_cache(maxsize=32)
def _on(plan: KCPPlan, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(tail rows, halo rows) on ``device``, copied once: a copy per call would sync the host."""
    return _tail_rows(plan).to(device), _halo_rows(plan).to(device)


class HaloExchange(torch.autograd.Function):
    """The local stream ``[T, D]`` -> the halo rows ``[pieces * (kernel_size - 1), D]`` of its pieces,
    in piece order (zero where no token of the same sequence is there)."""

    @staticmethod
    def forward(ctx, x, plan: KCPPlan, group):
        tails_idx, src = _on(plan, str(x.device))
        hl, P = plan.halo_len, plan.num_pieces
        xz = torch.cat([x, x.new_zeros(1, x.shape[1])])
        tails = xz[tails_idx].view(P, hl, -1)
        gathered = all_gather(tails, group) if plan.world_size > 1 else tails[None]
        gathered = torch.cat([gathered.flatten(0, 2), x.new_zeros(1, x.shape[1])])
        ctx.plan, ctx.group, ctx.T = plan, group, x.shape[0]
        return gathered[src]

    @staticmethod
    def backward(ctx, dhalo):
        plan = ctx.plan
        tails_idx, src = _on(plan, str(dhalo.device))
        W, P, hl = plan.world_size, plan.num_pieces, plan.halo_len
        dall = dhalo.new_zeros(W * P * hl + 1, dhalo.shape[1]).index_add_(0, src, dhalo)[:-1]
        dtails = reduce_scatter(dall.view(W, P * hl, -1), ctx.group) if W > 1 else dall
        dx = dhalo.new_zeros(ctx.T + 1, dhalo.shape[1]).index_add_(0, tails_idx, dtails)
        return dx[:-1], None, None


def halo(x: torch.Tensor, plan: KCPPlan, group) -> torch.Tensor:
    """``HaloExchange.apply(x, plan, group)``: the halo rows of the local stream ``x`` ``[T, D]``."""
    return HaloExchange.apply(x, plan, group)
