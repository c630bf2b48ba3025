"""The short conv's halo: the ``kernel_size - 1`` tokens before each local piece, from other ranks.

Each piece's first tokens need the tokens before it in the same sequence, which live at the tail of
earlier pieces (of one or several ranks when pieces are short). Ranks all-gather the tails of their
pieces, of all a mixer's conv inputs at once (:func:`halos`); backward sums every rank's halo gradient
back onto the tails' owners with one reduce-scatter. Tokens never cross a sequence boundary: a halo
row before a sequence start is zero.
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
    """Local streams ``[T, D_i]`` -> the halo rows ``[pieces * (kernel_size - 1), D_i]`` of their pieces,
    in piece order (zero where no token of the same sequence is there), all streams' tails in one
    all-gather forward and one reduce-scatter backward. Only the tails are read: a stream, a conv's
    whole input, is never copied; backward hands autograd each stream's input gradient as a zero-filled
    ``[T, D_i]`` with the tails' rows in it, for it to add to the conv's own."""

    @staticmethod
    def forward(ctx, plan: KCPPlan, group, *xs):
        tails_idx, has, src = _on(plan, str(xs[0].device))
        hl, P = plan.halo_len, plan.num_pieces
        tails = _cat([x.index_select(0, tails_idx) for x in xs]).masked_fill_(~has, 0).view(P, hl, -1)
        gathered = all_gather(tails, group) if plan.world_size > 1 else tails[None]
        gathered = torch.cat([gathered.flatten(0, 2), tails.new_zeros(1, tails.shape[-1])])
        ctx.plan, ctx.group, ctx.T, ctx.widths = plan, group, xs[0].shape[0], [x.shape[1] for x in xs]
        return _split(gathered[src], ctx.widths)

    @staticmethod
    def backward(ctx, *dhalos):
        plan = ctx.plan
        dhalo = _cat(dhalos)
        tails_idx, has, src = _on(plan, str(dhalo.device))
        W, P, hl = plan.world_size, plan.num_pieces, plan.halo_len
        dall = dhalo.new_zeros(W * P * hl + 1, dhalo.shape[1]).index_add_(0, src, dhalo)[:-1]
        dtails = reduce_scatter(dall.view(W, P * hl, -1), ctx.group) if W > 1 else dall
        dtails = dtails.reshape(P * hl, -1).masked_fill(~has, 0)
        return None, None, *(dhalo.new_zeros(ctx.T, d.shape[1]).index_add_(0, tails_idx, d)
                             for d in dtails.split(ctx.widths, 1))


def _cat(parts) -> torch.Tensor:
    """The channels of ``parts`` side by side (one part: itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _split(rows: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, ...]:
    """``rows`` cut by channels into contiguous parts (the conv kernels read a halo's rows densely)."""
    return (rows,) if len(widths) == 1 else tuple(r.contiguous() for r in rows.split(widths, 1))


def halos(xs, plan: KCPPlan, group) -> tuple[torch.Tensor, ...]:
    """The halo rows of each local stream ``[T, D_i]`` of ``xs`` (one dtype and device), in one
    exchange each way: a mixer with several convs (KDA's q, k and v) pays one collective, not one a conv."""
    if len({(x.dtype, x.device, x.shape[0]) for x in xs}) != 1:
        raise ValueError("halos: the streams must share their dtype, device and token count, got "
                         f"{[(x.dtype, str(x.device), x.shape[0]) for x in xs]}")
    return HaloExchange.apply(plan, group, *xs)


def halo(x: torch.Tensor, plan: KCPPlan, group) -> torch.Tensor:
    """The halo rows of the local stream ``x`` ``[T, D]`` (:func:`halos` of one stream)."""
    return halos([x], plan, group)[0]
