"""Moving a packed stream from one CP layout to another: one all-to-all of its rows, exact both ways.

Megatron hands every layer a packed batch in the per-document zigzag layout (each document cut into
2W chunks, rank r holding chunks r and 2W-1-r): right for softmax attention, which balances its
quadratic work that way, and the worst layout for a linear mixer, every document of which becomes a
chain over all ranks. A linear mixer runs fastest in a document-aligned layout, where at most W - 1
documents cross a rank edge (``contiguous``). Moving between the two is a permutation of the global
token stream: each rank sends every row to the rank that holds its position in the other layout,
one ``all_to_all_single`` with uneven splits, and the adjoint (the backward) is the same permutation
the other way.

Under sequence parallelism a CP rank's TP ranks hold one TP-th each of its local stream (Megatron's
SP split along the sequence), so a row may have to move to another TP rank too: the conversion
then runs over the tensor-and-context-parallel group, whose rank ``cp * TP + tp`` holds the ``tp``-th
TP-th of CP rank ``cp``'s stream (megatron-core orders that group TP-fastest; :func:`check_tp_cp_group`
verifies it). Without SP the TP ranks of a CP rank hold the same rows and each converts in its CP group.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_kcp.parallel import comm
from megatron_kcp.plan import check_cu_seqlens, layout_pieces


@dataclass(frozen=True)
class Route:
    """One rank's part of a conversion: what it sends to whom and where what it receives goes."""
    send_rows: torch.Tensor      # local rows in send order: grouped by destination rank, each group in its order
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_rows: torch.Tensor      # for each target row, its position among the received rows
    tokens: int                  # rows after the conversion


def positions(cu: tuple[int, ...], layout: str, world_size: int, tp: int, rank: int) -> torch.Tensor:
    """Global stream position of every row rank ``rank`` of the ``world_size * tp`` ranks holds: its CP
    rank's pieces in local order, then its TP-th of them (``rank = cp * tp + tp_rank``)."""
    cp_rank, tp_rank = divmod(rank, tp)
    pos = torch.cat([torch.arange(s, e) for s, e in layout_pieces(layout, cu, world_size, cp_rank)])
    if len(pos) % tp:
        raise ValueError(f"CP rank {cp_rank} holds {len(pos)} tokens, which sequence parallelism cannot split over "
                         f"TP = {tp}: pad the packed sequence to a multiple of 2 * CP * TP")
    return pos.chunk(tp)[tp_rank]


@functools.lru_cache(maxsize=64)
def route(cu_seqlens: tuple[int, ...], source: str, target: str, world_size: int, tp: int, rank: int) -> Route:
    """This rank's :class:`Route` from layout ``source`` to ``target`` (CPU index tensors, built once)."""
    cu, G = check_cu_seqlens(cu_seqlens), world_size * tp
    T = cu[-1]
    src = [positions(cu, source, world_size, tp, r) for r in range(G)]
    dst = [positions(cu, target, world_size, tp, r) for r in range(G)]
    owner, row = torch.empty(T, dtype=torch.long), torch.empty(T, dtype=torch.long)
    for r, p in enumerate(dst):
        owner[p], row[p] = r, torch.arange(len(p))
    src_owner = torch.empty(T, dtype=torch.long)
    for r, p in enumerate(src):
        src_owner[p] = r
    mine, wanted = src[rank], dst[rank]
    # send: my rows grouped by destination, each group in the destination's row order
    send_rows = torch.argsort(owner[mine] * T + row[mine])
    # receive: rows arrive grouped by source in my (target) row order, so sorting my rows by source gives
    # the arrival order; its inverse is where each target row sits among the arrivals
    arrival = torch.argsort(src_owner[wanted] * T + torch.arange(len(wanted)))
    return Route(send_rows, tuple(torch.bincount(owner[mine], minlength=G).tolist()),
                 tuple(torch.bincount(src_owner[wanted], minlength=G).tolist()), torch.argsort(arrival), len(wanted))


@functools.lru_cache(maxsize=64)
def _on(r: Route, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return r.send_rows.to(device), r.recv_rows.to(device)


def move(xs, r: Route, group) -> list[torch.Tensor]:
    """The rows of each of ``xs`` ``[n, ...]`` (this rank's, in the source layout) -> ``[r.tokens, ...]``
    (target), in one all-to-all: the rows of tensors of any dtypes travel side by side as bytes, so
    every value arrives bit for bit."""
    send, recv = _on(r, str(xs[0].device))
    raw = [x.reshape(x.shape[0], -1).contiguous().view(torch.uint8) for x in xs]
    packed = raw[0] if len(raw) == 1 else torch.cat(raw, 1)
    got = comm.all_to_all_rows(packed.index_select(0, send), r.send_counts, r.recv_counts, group).index_select(0, recv)
    parts = [got] if len(raw) == 1 else got.split([b.shape[1] for b in raw], 1)
    return [p.contiguous().view(x.dtype).view(r.tokens, *x.shape[1:]) for p, x in zip(parts, xs)]


class Relayout(torch.autograd.Function):
    """Rows ``[n, ...]`` of several tensors from layout ``source`` to ``target``; backward moves their
    gradients back the same way."""

    @staticmethod
    def forward(ctx, args, group, *xs):
        cu, source, target, W, tp, rank = args
        ctx.back, ctx.group, ctx.meta = (cu, target, source, W, tp, rank), group, [(x.shape[1:], x.dtype) for x in xs]
        return tuple(move(xs, route(*args), group))

    @staticmethod
    def backward(ctx, *grads):
        some = next(g for g in grads if g is not None)
        grads = [g if g is not None else torch.zeros(some.shape[0], *s, dtype=t, device=some.device)
                 for g, (s, t) in zip(grads, ctx.meta)]
        return (None, None, *move(grads, route(*ctx.back), ctx.group))


def relayout(xs, cu_seqlens: tuple[int, ...], source: str, target: str, group, tp: int = 1) -> list[torch.Tensor]:
    """Each of ``xs`` ``[n, ...]`` (this rank's rows in layout ``source``) in layout ``target``, with
    autograd, in one all-to-all. ``group``: the CP group (``tp = 1``), or under sequence parallelism the
    tensor-and-context-parallel group with ``tp`` the TP size. The tensors themselves where the layouts
    agree."""
    xs = list(xs)
    if source == target:
        return xs
    G = dist.get_world_size(group)
    if G % tp:
        raise ValueError(f"relayout over a group of {G} ranks with TP = {tp}: pass the tensor-and-context-parallel "
                         "group under sequence parallelism, the CP group with tp=1 otherwise")
    args = (tuple(cu_seqlens), source, target, G // tp, tp, dist.get_rank(group))
    return list(Relayout.apply(args, group, *xs))


def check_tp_cp_group(group, cp_rank: int, tp_rank: int, tp: int) -> None:
    """The tensor-and-context-parallel group orders its ranks TP-fastest, as :func:`positions` assumes."""
    if dist.get_rank(group) != cp_rank * tp + tp_rank:
        raise RuntimeError(f"the tensor-and-context-parallel group puts CP rank {cp_rank}, TP rank {tp_rank} at "
                           f"{dist.get_rank(group)}, not {cp_rank * tp + tp_rank}: the layout conversion needs "
                           "megatron-core's TP-fastest order: build the groups with "
                           "parallel_state.initialize_model_parallel and its default order 'tp-cp-ep-dp-pp'")
