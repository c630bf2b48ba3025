"""One rank's CP step as an autograd Function: a local core under a state-exchange strategy."""
from __future__ import annotations

import functools

import torch

from megatron_kcp.kernels.core import Prepared, zeroed_states
from megatron_kcp.plan import KCPPlan, index_tensor


class KCPStep(torch.autograd.Function):
    """o of this rank's shard, equal to the single-device run, forward and backward.

    Keeps for the backward the core's prepared tensors and the initial states that can be nonzero
    (received ones, and the user's where a sequence starts): the strategy refills the rest.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, init, plan: KCPPlan, group, scale, use_qk_l2norm, core, strategy):
        starts = [i for i in range(plan.num_segments) if plan.pred[i] is None]
        live = sorted({c.segment for c in plan.recv_fwd} | (set(starts) if init is not None else set()))
        P = core.prepare(q, k, v, g, beta, plan, scale, use_qk_l2norm, live=frozenset(live))
        h0 = zeroed_states(core, P, (plan.num_segments, v.shape[2], q.shape[3], v.shape[3]), q.device)
        ix = functools.partial(index_tensor, device=h0.device)      # no list indexing: it syncs the host
        if init is not None:
            h0.index_copy_(0, ix(starts), init.float().index_select(0, ix([plan.seg_seq[i] for i in starts])))
        o, extra = strategy.forward(core, P, plan, group, h0)
        ctx.save_for_backward(*P.saved, h0.index_select(0, ix(live)), extra)
        ctx.live, ctx.starts, ctx.has_init = live, starts, init is not None
        ctx.dtypes = [x.dtype for x in (q, k, v, g, beta)]
        ctx.plan, ctx.group, ctx.scale, ctx.use_qk_l2norm = plan, group, scale, use_qk_l2norm
        ctx.core, ctx.strategy = core, strategy
        return o

    @staticmethod
    def backward(ctx, do):
        *saved, h0_live, extra = ctx.saved_tensors
        plan, core = ctx.plan, ctx.core
        P = Prepared(tuple(saved), plan, ctx.scale, ctx.use_qk_l2norm, live=frozenset(ctx.live))
        shape = (plan.num_segments, *h0_live.shape[1:])
        if ctx.live or core.state_reads == "all":
            h0 = h0_live.new_zeros(shape)
            h0.index_copy_(0, index_tensor(ctx.live, h0.device), h0_live)
        else:                       # every initial state is zero: the core reads none (LocalCore.state_reads)
            h0 = h0_live.new_empty(shape)
        grads, dh0 = ctx.strategy.backward(core, P, plan, ctx.group, h0, do.contiguous(), extra)
        dq, dk, dv, dg, db = (d.to(t) for d, t in zip(core.finish(P, grads), ctx.dtypes))
        dinit = None
        if ctx.has_init:
            # the user's state enters a sequence only where it starts; elsewhere dh0 flowed to earlier ranks
            dinit = dh0.new_zeros(plan.num_seqs, *dh0.shape[1:])
            ix = functools.partial(index_tensor, device=dh0.device)
            dinit.index_add_(0, ix([plan.seg_seq[i] for i in ctx.starts]), dh0.index_select(0, ix(ctx.starts)))
        return dq, dk, dv, dg, db, dinit, None, None, None, None, None, None
