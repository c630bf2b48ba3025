"""KCP on CPU ranks (gloo) equals the single-process reference, forward and backward, for both
exchange strategies; and on inputs whose state outlives a piece, the same comparison with the
exchange switched off fails, so these tests see a wrong exchange."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.ops import dispatch, kcp
from megatron_kcp.ops import reference as R
from megatron_kcp.parallel import halo
from megatron_kcp.parallel.strategy import StateExchange
from megatron_kcp.parallel.plan import LAYOUTS
from megatron_kcp.testing.distributed import rel_err, spawn
from megatron_kcp.testing.cases import long_memory_cu, long_memory_inputs, plan_for, random_cu_seqlens, random_inputs, shard

KINDS = ("random", "single", "edges", "tiny")
STRATEGIES = ("relay", "gather")
TOL = 1e-5
NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def _group():
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def _compare(cu, xs, h0, layout, strategy, l2, group, seed, backend="reference", max_segment=None):
    """Errors of this rank's KCP run against the single-process oracle (all-reduced max over ranks)."""
    W, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(1, cu[-1], *xs[2].shape[2:], generator=gen)
    ref = [x.clone().requires_grad_() for x in xs + ([h0] if h0 is not None else [])]
    o_ref, _ = R.chunk_gated_delta_rule_fp64(*ref[:5], initial_state=ref[5] if h0 is not None else None,
                                        use_qk_l2norm=l2, cu_seqlens=torch.tensor(cu))
    ref_grads = torch.autograd.grad(o_ref, ref, do)
    plan = plan_for(cu, layout, W, r)
    loc = [x.clone().requires_grad_() for x in shard(plan, *xs)]
    init = [h0.clone().requires_grad_()] if h0 is not None else []
    o = kcp.gated_delta_rule(*loc, plan, group, initial_state=init[0] if init else None, use_qk_l2norm=l2,
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


def _conv_errors(cu, layout, seed, group, x=None):
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


def _random_cases(layout, seeds):
    group = _group()
    W = dist.get_world_size(group)
    for seed in seeds:
        for kind in KINDS:
            for kda in (False, True):
                gen = torch.Generator().manual_seed(seed)
                cu = random_cu_seqlens(gen, layout, W, kind)
                xs = random_inputs(gen, cu[-1], len(cu) - 1, 2, 4 if seed % 3 == 0 else 2, 8, 6, kda)
                for strategy in STRATEGIES:
                    errs = _compare(cu, xs[:5], xs[5], layout, strategy, seed % 2 == 0, group, seed)
                    bad = {k: v for k, v in errs.items() if not v <= TOL}
                    assert not bad, f"{layout} {kind} {strategy} seed={seed} kda={kda} cu={cu}: {bad}"
            errs = _conv_errors(random_cu_seqlens(torch.Generator().manual_seed(seed), layout, W, kind), layout,
                                seed, group)
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"conv {layout} {kind} seed={seed}: {bad}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kcp_matches_single_process(layout, world_size):
    """Random packings: cuts anywhere, on rank edges, one sequence over all ranks, 1-token pieces."""
    spawn(_random_cases, world_size, layout, [world_size * 10])


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


def _exchange_off(name="relay"):
    """Swap in NoExchange for the strategy ``name`` and a zero conv halo (restored by the returned callable)."""
    strategy, exchange = dispatch.STRATEGIES[name], halo.halo
    dispatch.STRATEGIES[name] = NoExchange()
    halo.halo = lambda x, plan, group: x.new_zeros(plan.num_pieces * plan.halo_len, x.shape[1])

    def restore():
        dispatch.STRATEGIES[name], halo.halo = strategy, exchange
    return restore


def _long_memory(layout, kda):
    group = _group()
    W = dist.get_world_size(group)
    gen = torch.Generator().manual_seed(7 + W)
    # per-document zigzag puts every document on every rank: fewer of them still makes over 50 a rank
    cu = long_memory_cu(gen, W, piece=48 if layout == "zigzag_per_doc" else 140)
    xs = long_memory_inputs(gen, cu, 2, 2, 16, 8, kda)
    for strategy in STRATEGIES:
        errs = _compare(cu, xs, None, layout, strategy, True, group, seed=W)
        bad = {k: v for k, v in errs.items() if not v <= TOL}
        assert not bad, f"{layout} W={W} {strategy} kda={kda}: {bad}"
    conv = _conv_errors(cu, layout, W, group)
    assert max(conv.values()) <= TOL, f"conv {layout} W={W}: {conv}"
    # the negative control: the same comparisons with the exchange switched off must fail
    restore = _exchange_off()
    try:
        off = _compare(cu, xs, None, layout, "relay", True, group, seed=W)
        conv_off = _conv_errors(cu, layout, W, group)
    finally:
        restore()
    weak = {k: v for k, v in {**off, **{"conv_" + k: v for k, v in conv_off.items() if k in ("y", "dx")}}.items()
            if not v >= 10 * TOL}
    assert not weak, f"{layout} W={W} kda={kda}: without the exchange these still match: {weak} (all: {off})"
    if dist.get_rank(group) == 0:
        print(f"{layout} W={W} {'KDA' if kda else 'GDN'} exchange off: " +
              " ".join(f"{k}:{v:.1e}" for k, v in {**off, **conv_off}.items()), flush=True)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kda", [False, True], ids=["GDN", "KDA"])
def test_long_memory_and_exchange_is_load_bearing(layout, world_size, kda):
    """Over 50 documents per rank, slow decay, keys that do not span K: both strategies match the
    oracle to 1e-5 in the output and every input gradient, and with the exchange off they miss by
    at least 10x that (output, every input gradient, conv output and input gradient)."""
    spawn(_long_memory, world_size, layout, kda)


def _split_cases(layouts, backend="reference"):
    """Segments cut into parts (``max_segment``) that the all-gather chains: random packings with the
    user's initial states, GDN and KDA, and the long-memory batch, where the same run with the
    exchange (the local fold too) switched off must miss."""
    group = _group()
    W = dist.get_world_size(group)
    for layout in layouts:
        for seed, kind in enumerate(("random", "single", "edges")):
            for kda in (False, True) if backend == "reference" else (False,):
                gen = torch.Generator().manual_seed(seed)
                cu = random_cu_seqlens(gen, layout, W, kind)
                xs = random_inputs(gen, cu[-1], len(cu) - 1, 2, 4, 8, 6, kda)
                for cut in (5, 16):
                    errs = _compare(cu, xs[:5], xs[5], layout, "auto", seed % 2 == 0, group, seed, backend, cut)
                    bad = {k: v for k, v in errs.items() if not v <= TOL}
                    assert not bad, f"{backend} {layout} {kind} cut={cut} kda={kda} cu={cu}: {bad}"
        gen = torch.Generator().manual_seed(7 + W)
        cu = long_memory_cu(gen, W, piece=48 if layout == "zigzag_per_doc" else 140)
        xs = long_memory_inputs(gen, cu, 2, 2, 16, 8, False)
        errs = _compare(cu, xs, None, layout, "gather", True, group, W, backend, 24)
        assert max(errs.values()) <= TOL, f"{backend} {layout} W={W} cut: {errs}"
        restore = _exchange_off("gather")
        try:
            off = _compare(cu, xs, None, layout, "gather", True, group, W, backend, 24)
        finally:
            restore()
        weak = {k: v for k, v in off.items() if not v >= 10 * TOL}
        assert not weak, f"{backend} {layout} W={W} cut: without the exchange these still match: {weak}"
    # what cannot run on a cut plan fails before any kernel, naming the fix
    plan = plan_for(cu, layouts[0], W, dist.get_rank(group))
    loc = shard(plan, *xs)
    with pytest.raises(ValueError, match="strategy='gather'"):
        kcp.gated_delta_rule(*loc, plan, group, backend=backend, strategy="relay", max_segment=24)
    with pytest.raises(ValueError, match="max_segment must be >= 0"):
        kcp.gated_delta_rule(*loc, plan, group, backend=backend, max_segment=-1)
    from megatron_kcp.parallel.plan import split_segments
    x = torch.zeros(1, plan.num_local_tokens, 3)
    with pytest.raises(ValueError, match="not one split by max_segment"):
        kcp.causal_conv1d(x, torch.zeros(3, 4), plan=split_segments(plan, 24), group=group, backend="reference")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cut_segments_match_single_process(world_size):
    spawn(_split_cases, world_size, LAYOUTS)


def _cp2hp_cases(layouts):
    """The cp2hp peer (all-to-all to head shards) on random packings and the long-memory batch, every
    layout, GDN and KDA: the same function as the oracle, forward and backward."""
    group = _group()
    W = dist.get_world_size(group)
    for layout in layouts:
        for kda in (False, True):
            gen = torch.Generator().manual_seed(5)
            for kind in ("random", "single", "tiny"):
                cu = random_cu_seqlens(gen, layout, W, kind)
                xs = random_inputs(gen, cu[-1], len(cu) - 1, W, W, 8, 6, kda)[:5]
                errs = _compare(cu, xs, None, layout, "cp2hp", kind != "tiny", group, seed=1)
                assert max(errs.values()) <= TOL, f"cp2hp {layout} {kind} kda={kda} cu={cu}: {errs}"
            cu = long_memory_cu(gen, W, piece=48)
            xs = long_memory_inputs(gen, cu, W, W, 16, 8, kda)
            errs = _compare(cu, xs, None, layout, "cp2hp", True, group, 2)
            assert max(errs.values()) <= TOL, f"cp2hp {layout} long memory kda={kda}: {errs}"
            if layout != "contiguous":       # the control: tokens left in rank order, not stream order
                from megatron_kcp.parallel import cp2hp
                init = cp2hp.TokenOrder.__init__

                def rank_order(self, *args):
                    init(self, *args)
                    self.inv = torch.arange(len(self.inv))
                cp2hp.TokenOrder.__init__ = rank_order
                cp2hp.token_order.cache_clear()
                try:
                    off = _compare(cu, xs, None, layout, "cp2hp", True, group, 2)
                finally:
                    cp2hp.TokenOrder.__init__ = init
                    cp2hp.token_order.cache_clear()
                assert min(off["o"], off["dq"], off["dk"]) >= 10 * TOL, f"cp2hp {layout}: misorder not seen: {off}"
    # what it cannot do fails before any exchange, naming the fix
    plan = plan_for((0, 8 * W), "zigzag", W, dist.get_rank(group))
    xs = [x[:, :8] for x in random_inputs(torch.Generator().manual_seed(0), 8 * W, 1, 3, 3, 8, 6, False)[:5]]
    with pytest.raises(ValueError, match="divisible by the CP size"):
        kcp.gated_delta_rule(*xs, plan, group, backend="reference", strategy="cp2hp")
    xs = [x[:, :8] for x in random_inputs(torch.Generator().manual_seed(0), 8 * W, 1, W, W, 8, 6, False)[:5]]
    with pytest.raises(ValueError, match="takes no initial_state"):
        kcp.gated_delta_rule(*xs, plan, group, initial_state=torch.zeros(1, W, 8, 6), backend="reference",
                             strategy="cp2hp")


def test_cp2hp_matches_single_process():
    spawn(_cp2hp_cases, 2, LAYOUTS)
