"""The collectives KCP issues: all-gather, reduce-scatter, point-to-point sends, the all-to-all (even
blocks, and uneven ones for the layout conversion) and the sequence all-gather (both with their adjoints
as autograd Functions).

gloo cannot move CUDA tensors point to point (and the tests run gloo with ranks sharing a GPU),
so on gloo CUDA tensors travel through host memory; NCCL takes them as they are.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[W, *x.shape]`` from every rank of ``group``."""
    W = dist.get_world_size(group)
    out = x.new_empty(W * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(W, *x.shape)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks of ``x`` ``[W, *shape]``; returns this rank's ``[*shape]``."""
    out = x.new_empty(x.shape[1:])
    if dist.get_backend(group) == "gloo":               # gloo has no reduce-scatter
        dist.all_reduce(x, group=group)
        return x[dist.get_rank(group)].clone()
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class P2P:
    """Point-to-point sends and receives of one strategy call. Sends are kept alive until
    :meth:`finish`, so the caller goes on computing; a receive is posted early and waited for
    (``Pending.wait``) where its data is needed, so the work in between overlaps the transfer.
    Plain isend/irecv rather than a batch: a batch's first use must involve every rank of the group,
    and a relay step involves two. Each pair of ranks issues its sends and receives in the same
    (stage) order on both sides, which is all NCCL's point-to-point needs."""

    def __init__(self, group):
        self.group, self.pending, self._gloo = group, [], None

    @property
    def gloo(self) -> bool:
        if self._gloo is None:                  # asked only when something moves (CP = 1 needs no group)
            self._gloo = dist.get_backend(self.group) == "gloo"
        return self._gloo

    def send(self, sends: dict[int, torch.Tensor]) -> None:
        for peer, t in sends.items():
            buf = t.cpu() if self.gloo and t.is_cuda else t.contiguous()
            self.pending += [buf, dist.isend(buf, group=self.group, group_dst=peer)]

    def recv(self, recvs: dict[int, torch.Tensor]) -> "Pending":
        """Post receives into ``recvs[peer]``; they are usable after the returned ``wait()``."""
        posted = []
        for peer, t in recvs.items():
            buf = torch.empty(t.shape, dtype=t.dtype) if self.gloo and t.is_cuda else t
            posted.append((t, buf, dist.irecv(buf, group=self.group, group_src=peer)))
        return Pending(posted)

    def finish(self) -> None:
        for w in self.pending:
            if not isinstance(w, torch.Tensor):
                w.wait()
        self.pending = []


class Pending:
    def __init__(self, posted):
        self.posted = posted

    def wait(self) -> None:
        """On NCCL the current stream waits (the host does not); on gloo the host waits and copies."""
        for t, buf, work in self.posted:
            work.wait()
            if buf is not t:
                t.copy_(buf)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal blocks of ``x`` along dim 0, block j to rank j; returns the blocks received, in rank order."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, send_counts, recv_counts, group) -> torch.Tensor:
    """``x`` ``[n, ...]`` cut into blocks of ``send_counts`` rows, block j to rank j; the blocks received,
    in rank order. gloo moves no CUDA tensors here: they travel through host memory."""
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    if dist.get_backend(group) == "gloo" and x.is_cuda:
        host = torch.empty(out.shape, dtype=out.dtype)
        dist.all_to_all_single(host, x.cpu(), list(recv_counts), list(send_counts), group=group)
        return out.copy_(host)
    dist.all_to_all_single(out, x.contiguous(), list(recv_counts), list(send_counts), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """:func:`all_to_all`; the exchange is its own adjoint, so backward sends the gradient through it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(x, group)

    @staticmethod
    def backward(ctx, dy):
        return all_to_all(dy, ctx.group), None


class AllGatherSeq(torch.autograd.Function):
    """``[W * n, ...]``: every rank's ``[n, ...]`` along dim 0; backward reduce-scatters the gradient,
    so each rank gets the sum of every rank's gradient of its rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None
