"""KCP on CPU ranks (gloo) equals the single-process reference, forward and backward."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.ops import kcp
from megatron_kcp.ops import reference as R
from megatron_kcp.parallel import exchange
from megatron_kcp.parallel.plan import LAYOUTS
from tests.distributed import rel_err, spawn
from tests.parallel.cases import plan_for, random_cu_seqlens, random_inputs, shard

KINDS = ("random", "single", "edges", "tiny")
TOL = 1e-5


def _gdr_case(layout, kind, seed, kda, gva, group):
    W, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    cu = random_cu_seqlens(gen, layout, W, kind)
    H, HV, K, V = 2, 4 if gva else 2, 8, 6
    xs = random_inputs(gen, cu[-1], len(cu) - 1, H, HV, K, V, kda)
    do = torch.randn(1, cu[-1], HV, V, generator=gen)
    l2 = seed % 2 == 0
    # single-process oracle over the whole stream
    ref = [x.clone().requires_grad_() for x in xs]
    o_ref, _ = R.chunk_gated_delta_rule(*ref[:5], initial_state=ref[5], use_qk_l2norm=l2,
                                        cu_seqlens=torch.tensor(cu))
    ref_grads = torch.autograd.grad(o_ref, ref, do)
    # CP run on this rank's shard
    plan = plan_for(cu, layout, W, r)
    loc = [x.clone().requires_grad_() for x in shard(plan, *xs[:5])]
    h0 = xs[5].clone().requires_grad_()
    o = kcp.gated_delta_rule(*loc, plan, group, initial_state=h0, use_qk_l2norm=l2, backend="reference")
    grads = torch.autograd.grad(o, loc + [h0], shard(plan, do)[0])
    dh0 = grads[5].clone()
    dist.all_reduce(dh0, group=group)
    errs = {"o": rel_err(o, shard(plan, o_ref)[0]), "dh0": rel_err(dh0, ref_grads[5])}
    for name, gl, gr in zip("q k v g beta".split(), grads, ref_grads):
        errs["d" + name] = rel_err(gl, shard(plan, gr)[0])
    return cu, errs


def _conv_case(layout, kind, seed, group):
    W, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    cu = random_cu_seqlens(gen, layout, W, kind)
    D, ks = 5, 4
    x = torch.randn(1, cu[-1], D, generator=gen)
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
    return cu, {"y": rel_err(y, shard(plan, y_ref)[0]), "dx": rel_err(dx, shard(plan, ref_grads[0])[0]),
                "dw": rel_err(dw, ref_grads[1]), "db": rel_err(db, ref_grads[2])}


def _run_all(layout, seeds):
    from megatron.core import parallel_state as ps
    group = ps.get_context_parallel_group()
    for seed in seeds:
        for kind in KINDS:
            for kda in (False, True):
                cu, errs = _gdr_case(layout, kind, seed, kda, gva=seed % 3 == 0, group=group)
                bad = {k: v for k, v in errs.items() if not v <= TOL}
                assert not bad, f"{layout} {kind} seed={seed} kda={kda} cu={cu}: {bad}"
            cu, errs = _conv_case(layout, kind, seed, group)
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"conv {layout} {kind} seed={seed} cu={cu}: {bad}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kcp_matches_single_process(layout, world_size):
    spawn(_run_all, world_size, layout, [world_size * 10 + i for i in range(2)])


def _exchange_disabled(layout):
    from megatron.core import parallel_state as ps
    group = ps.get_context_parallel_group()

    def no_fold(maps, plan, group, *a):
        return maps.new_zeros(len(plan.seg_seq), maps.shape[1], maps.shape[2], maps.shape[3] - maps.shape[2])
    exchange_fwd, exchange_bwd = exchange.fold_forward, exchange.fold_backward
    import megatron_kcp.ops.kcp_reference as kr
    kr.fold_forward = kr.fold_backward = no_fold
    try:
        _, errs = _gdr_case(layout, "single", 3, kda=True, gva=False, group=group)
    finally:
        kr.fold_forward, kr.fold_backward = exchange_fwd, exchange_bwd
    errs = torch.tensor([errs["o"], errs["dk"]])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)
    assert (errs > 1e-2).all(), f"a run without the state exchange still matched: {errs}"


def test_exchange_is_load_bearing():
    """The equivalence test can fail: with the folds replaced by zeros, o and dk are wrong."""
    spawn(_exchange_disabled, 2, "zigzag")
