"""The CP run against the single-process oracle, and KCP with its exchange switched off: what the
equivalence tests of the ops (CPU and GPU) share."""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.distributed as dist

from megatron_kcp.ops import kcp
from megatron_kcp.kernels import reference as R
from megatron_kcp.parallel import halo, relayout
from megatron_kcp.parallel.exchanges import EXCHANGES
from megatron_kcp.parallel.strategy import StateExchange
from megatron_kcp.testing.cases import plan_for, shard
from megatron_kcp.testing.distributed import rel_err

TESTED_STRATEGIES = ("relay", "gather")
TOL = 1e-5
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def cp_group():
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def compare_with_oracle(cu, xs, h0, layout, strategy, use_qk_l2norm, group, seed, backend="reference",
                        max_segment=None):
    """Errors of this rank's KCP run against the single-process oracle (all-reduced max over ranks)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(1, cu[-1], *xs[2].shape[2:], generator=gen)
    ref = [x.clone().requires_grad_() for x in xs + ([h0] if h0 is not None else [])]
    o_ref, _ = R.chunk_gated_delta_rule_fp64(*ref[:5], initial_state=ref[5] if h0 is not None else None,
                                             use_qk_l2norm=use_qk_l2norm, cu_seqlens=torch.tensor(cu))
    ref_grads = torch.autograd.grad(o_ref, ref, do)
    plan = plan_for(cu, layout, W, r)
    loc = [x.clone().requires_grad_() for x in shard(plan, *xs)]
    init = [h0.clone().requires_grad_()] if h0 is not None else []
    o = kcp.gated_delta_rule(*loc, plan, group, initial_state=init[0] if init else None, use_qk_l2norm=use_qk_l2norm,
                             backend=backend, strategy=strategy, max_segment=max_segment)
    grads = torch.autograd.grad(o, loc + init, shard(plan, do)[0])
    errs = {"o": rel_err(o, shard(plan, o_ref)[0])}
    for name, gl, gr in zip(NAMES[1:], grads, ref_grads):
        errs[name] = rel_err(gl, shard(plan, gr)[0])
    if init:
        dh0 = grads[5].clone()
        dist.all_reduce(dh0, group=group)
        errs["dh0"] = rel_err(dh0, ref_grads[5])
    worst = torch.tensor(list(errs.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(errs, worst.tolist()))


def conv_errors(cu, layout, seed, group, x=None):
    W, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    D, ks = 5, 4
    x = torch.randn(1, cu[-1], D, generator=gen) if x is None else x
    w, b = torch.randn(D, ks, generator=gen), torch.randn(D, generator=gen)
    dy = torch.randn(1, cu[-1], D, generator=gen)
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    y_ref = kcp.causal_conv1d(*ref, plan=plan_for(cu, "contiguous", 1, 0, ks), backend="reference")
    ref_grads = torch.autograd.grad(y_ref, ref, dy)
    plan = plan_for(cu, layout, W, r, ks)
    xl = shard(plan, x)[0].requires_grad_()
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = kcp.causal_conv1d(xl, wl, bl, plan=plan, group=group, backend="reference")
    dx, dw, db = torch.autograd.grad(y, (xl, wl, bl), shard(plan, dy)[0])
    dist.all_reduce(dw, group=group)
    dist.all_reduce(db, group=group)
    errs = {"y": rel_err(y, shard(plan, y_ref)[0]), "dx": rel_err(dx, shard(plan, ref_grads[0])[0]),
            "dw": rel_err(dw, ref_grads[1]), "db": rel_err(db, ref_grads[2])}
    worst = torch.tensor(list(errs.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(errs, worst.tolist()))


class NoExchange(StateExchange):
    """Every piece from a zero state (the user's where a sequence starts) and no state gradient from
    later pieces: KCP with its exchange switched off."""
    name = "off"

    def forward(self, core, P, plan, group, h0):
        n, st = plan.num_segments, core.states(P, h0)
        core.state(P, st, range(n), h0)
        return core.output(P, st, 0, n), None

    def backward(self, core, P, plan, group, h0, do, _):
        n = plan.num_segments
        B = core.backward_prepare(P, 0, n, h0, do)
        dh0 = core.backward_state(P, B, range(n), torch.zeros_like(h0))
        return core.backward_rest(P, B), dh0


def _off(original):
    """A NoExchange that the dispatch picks where it would pick ``original`` (its name, rules and costs)."""
    off = NoExchange()
    for attr in ("applicable", "cost", "pick", "refusal"):
        setattr(off, attr, getattr(original, attr))
    off.name, off.order = original.name, original.order
    return off


def exchange_off(*names: str, conv_halo: bool = True):
    """Swap in NoExchange for the strategies ``names`` (default ``relay``) and, with ``conv_halo``, a
    zero conv halo; restored by the returned callable."""
    swaps = contextlib.ExitStack()
    swaps.enter_context(EXCHANGES.swapped(*(_off(EXCHANGES[n]) for n in names or ("relay",))))
    if conv_halo:
        swaps.callback(halo_off())
    return swaps.close


def halo_off():
    """Every conv piece reads a zero halo (restored by the returned callable)."""
    exchange = halo.halos
    halo.halos = lambda xs, plan, group: (xs, tuple(x.new_zeros(plan.num_pieces * plan.halo_len, x.shape[1])
                                                    for x in xs))

    def restore():
        halo.halos = exchange
    return restore


def rolled_by_one_document():
    """relayout.positions with the target layout's stream rolled by the first document: a permutation
    that is wrong by one document (forward and backward consistent)."""
    real = relayout.positions

    def positions(cu_, layout, W, tp, rank):
        p = real(cu_, layout, W, tp, rank)
        return (p + cu_[1]) % cu_[-1] if layout == "contiguous" else p
    return mock.patch.object(relayout, "positions", positions)
