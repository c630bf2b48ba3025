"""The short conv's halo: the ``kernel_size - 1`` tokens before each local piece, from other ranks.

Each piece's first tokens need the tokens before it in the same sequence, which live at the tail of
earlier pieces (of one or several ranks when pieces are short). Ranks all-gather the tails of their
pieces, of all a mixer's conv inputs at once (:func:`halos`); backward sums every rank's halo gradient
back onto the tails' owners with one reduce-scatter, and adds it in place to the tail rows of the
input gradient the conv computed: never a ``[T, D]`` pass of its own. Tokens never cross a sequence
boundary: a halo row before a sequence start is zero.
"""
from __future__ import annotations

import functools

import torch

from megatron_kcp.parallel.comm import all_gather, reduce_scatter
from megatron_kcp.plan import KCPPlan


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


class _TailGrads:
    """The tails' gradients ``[pieces * (kernel_size - 1), D_i]`` of one exchange, from its backward to
    :class:`_Streams`'s (None until then)."""
    __slots__ = ("grads",)

    def __init__(self):
        self.grads = None


class _Streams(torch.autograd.Function):
    """The streams ``[T, D_i]`` as they are (views, no copy), for the conv and the exchange to read.
    Their gradient is the conv's input gradient, which this node receives once the exchange's
    backward has run too (both read these views); it adds the tails' gradients to its tail rows in
    place. The conv's input gradient is a tensor the conv's backward made, used by nothing else."""

    @staticmethod
    def forward(ctx, plan: KCPPlan, box: _TailGrads, *xs):
        ctx.plan, ctx.box, ctx.T = plan, box, xs[0].shape[0]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *dxs):
        tails = ctx.box.grads
        ctx.box.grads = None
        if tails is not None:
            tails_idx = _on(ctx.plan, str(tails[0].device))[0]
            dxs = tuple((dx if dx is not None else d.new_zeros(ctx.T, d.shape[1])).index_add_(0, tails_idx, d)
                        for dx, d in zip(dxs, tails))
        return None, None, *dxs


class HaloExchange(torch.autograd.Function):
    """Local streams ``[T, D_i]`` -> the halo rows ``[pieces * (kernel_size - 1), D_i]`` of their pieces,
    in piece order (zero where no token of the same sequence is there), all streams' tails in one
    all-gather forward and one reduce-scatter backward. Only the tails are read: a stream, a conv's
    whole input, is never copied. Backward hands the tails' gradients to ``box`` (for
    :class:`_Streams`), not autograd: a dense ``[T, D_i]`` gradient would cost a zero-fill and an add
    over the conv's whole input."""

    @staticmethod
    def forward(ctx, plan: KCPPlan, group, box: _TailGrads, *xs):
        tails_idx, has, src = _on(plan, str(xs[0].device))
        hl, P = plan.halo_len, plan.num_pieces
        tails = _cat([x.index_select(0, tails_idx) for x in xs]).masked_fill_(~has, 0).view(P, hl, -1)
        gathered = all_gather(tails, group) if plan.world_size > 1 else tails[None]
        gathered = torch.cat([gathered.flatten(0, 2), tails.new_zeros(1, tails.shape[-1])])
        ctx.plan, ctx.group, ctx.box, ctx.widths = plan, group, box, [x.shape[1] for x in xs]
        return _split(gathered[src], ctx.widths)

    @staticmethod
    def backward(ctx, *dhalos):
        plan = ctx.plan
        dhalo = _cat(dhalos)
        has, src = _on(plan, str(dhalo.device))[1:]
        W, P, hl = plan.world_size, plan.num_pieces, plan.halo_len
        dall = dhalo.new_zeros(W * P * hl + 1, dhalo.shape[1]).index_add_(0, src, dhalo)[:-1]
        dtails = reduce_scatter(dall.view(W, P * hl, -1), ctx.group) if W > 1 else dall
        ctx.box.grads = dtails.reshape(P * hl, -1).masked_fill(~has, 0).split(ctx.widths, 1)
        return (None,) * (3 + len(ctx.widths))


def _cat(parts) -> torch.Tensor:
    """The channels of ``parts`` side by side (one part: itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _split(rows: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, ...]:
    """``rows`` cut by channels into contiguous parts (the conv kernels read a halo's rows densely)."""
    return (rows,) if len(widths) == 1 else tuple(r.contiguous() for r in rows.split(widths, 1))


def halos(xs, plan: KCPPlan, group) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The local streams ``[T, D_i]`` of ``xs`` (one dtype and device) for the conv to read, and their
    halo rows, in one exchange each way: a mixer with several convs (KDA's q, k and v) pays one
    collective, not one a conv. The streams returned hold the same values; the conv must read them,
    not ``xs``, for the tails' gradients to reach ``xs``."""
    if len({(x.dtype, x.device, x.shape[0]) for x in xs}) != 1:
        raise ValueError("halos: the streams must share their dtype, device and token count, got "
                         f"{[(x.dtype, str(x.device), x.shape[0]) for x in xs]}")
    box = _TailGrads()
    streams = _Streams.apply(plan, box, *xs)
    return streams, HaloExchange.apply(plan, group, box, *streams)
