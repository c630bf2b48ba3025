"""KCP on CPU ranks (gloo) equals the single-process reference, forward and backward, for both
exchange strategies; and on inputs whose state outlives a piece, the same comparison with the
exchange switched off fails, so these tests see a wrong exchange."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.ops import kcp
from megatron_kcp.plan import LAYOUTS
from megatron_kcp.testing.cases import (long_memory_cu, long_memory_inputs, plan_for, random_cu_seqlens,
                                        random_inputs, shard)
from megatron_kcp.testing.checks import (TESTED_STRATEGIES, TOL, compare_with_oracle, conv_errors,
                                         cp_group, exchange_off)
from megatron_kcp.testing.distributed import spawn

KINDS = ("random", "single", "edges", "tiny")


def _random_cases(layout, seeds):
    group = cp_group()
    W = dist.get_world_size(group)
    for seed in seeds:
        for kind in KINDS:
            for kda in (False, True):
                gen = torch.Generator().manual_seed(seed)
                cu = random_cu_seqlens(gen, layout, W, kind)
                xs = random_inputs(gen, cu[-1], len(cu) - 1, 2, 4 if seed % 3 == 0 else 2, 8, 6, kda)
                for strategy in TESTED_STRATEGIES:
                    errs = compare_with_oracle(cu, xs[:5], xs[5], layout, strategy, seed % 2 == 0, group, seed)
                    bad = {k: v for k, v in errs.items() if not v <= TOL}
                    assert not bad, f"{layout} {kind} {strategy} seed={seed} kda={kda} cu={cu}: {bad}"
            cu = random_cu_seqlens(torch.Generator().manual_seed(seed), layout, W, kind)
            errs = conv_errors(cu, layout, seed, group)
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"conv {layout} {kind} seed={seed}: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kcp_matches_single_process(layout, world_size):
    """Random packings: cuts anywhere, on rank edges, one sequence over all ranks, 1-token pieces."""
    spawn(_random_cases, world_size, layout, [world_size * 10])


def _long_memory(cases, piece=None):
    """For each (layout, kda): both strategies against the oracle, and the control with the exchange off.
    ``piece``: tokens of a zigzag chunk per 2W (None: over 50 documents a rank, see ``long_memory_cu``)."""
    group = cp_group()
    W = dist.get_world_size(group)
    for layout, kda in cases:
        gen = torch.Generator().manual_seed(7 + W)
        # per-document zigzag puts every document on every rank: fewer of them still makes over 50 a rank
        cu = long_memory_cu(gen, W, piece=piece or (48 if layout == "zigzag_per_doc" else 140))
        xs = long_memory_inputs(gen, cu, 2, 2, 16, 8, kda)
        for strategy in TESTED_STRATEGIES:
            errs = compare_with_oracle(cu, xs, None, layout, strategy, True, group, seed=W)
            bad = {k: v for k, v in errs.items() if not v <= TOL}
            assert not bad, f"{layout} W={W} {strategy} kda={kda}: {bad}"
        conv = conv_errors(cu, layout, W, group)
        assert max(conv.values()) <= TOL, f"conv {layout} W={W}: {conv}"
        # the negative control: the same comparisons with the exchange switched off must fail
        restore = exchange_off()
        try:
            off = compare_with_oracle(cu, xs, None, layout, "relay", True, group, seed=W)
            conv_off = conv_errors(cu, layout, W, group)
        finally:
            restore()
        weak = {k: v for k, v in {**off, **{"conv_" + k: v for k, v in conv_off.items() if k in ("y", "dx")}}.items()
                if not v >= 10 * TOL}
        assert not weak, f"{layout} W={W} kda={kda}: without the exchange these still match: {weak} (all: {off})"
        if dist.get_rank(group) == 0:
            print(f"{layout} W={W} {'KDA' if kda else 'GDN'} docs={len(cu) - 1} exchange off: " +
                  " ".join(f"{k}:{v:.1e}" for k, v in {**off, **conv_off}.items()), flush=True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_long_memory_every_layout_and_exchange_is_load_bearing(world_size):
    """The default tier's long-memory check, one set of ranks for every layout, GDN and KDA: a few
    documents per zigzag chunk (one across each chunk edge), slow decay, keys that do not span K. Both
    strategies match the oracle to 1e-5 in the output and every input gradient, and with the exchange
    off they miss by at least 10x that (output, every input gradient, conv output and input gradient)."""
    spawn(_long_memory, world_size, [(layout, kda) for layout in LAYOUTS for kda in (False, True)], 8)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kda", [False, True], ids=["GDN", "KDA"])
def test_long_memory_and_exchange_is_load_bearing(layout, world_size, kda):
    """The same at full size: over 50 documents per rank."""
    spawn(_long_memory, world_size, [(layout, kda)])


def _split_cases(layouts, backend="reference"):
    """Segments cut into parts (``max_segment``) that the all-gather chains: random packings with the
    user's initial states, GDN and KDA, and the long-memory batch, where the same run with the
    exchange (the local fold too) switched off must miss."""
    group = cp_group()
    W = dist.get_world_size(group)
    for layout in layouts:
        for seed, kind in enumerate(("random", "single", "edges")):
            for kda in (False, True) if backend == "reference" else (False,):
                gen = torch.Generator().manual_seed(seed)
                cu = random_cu_seqlens(gen, layout, W, kind)
                xs = random_inputs(gen, cu[-1], len(cu) - 1, 2, 4, 8, 6, kda)
                for cut in (5, 16):
                    errs = compare_with_oracle(cu, xs[:5], xs[5], layout, "auto", seed % 2 == 0, group, seed,
                                               backend, cut)
                    bad = {k: v for k, v in errs.items() if not v <= TOL}
                    assert not bad, f"{backend} {layout} {kind} cut={cut} kda={kda} cu={cu}: {bad}"
        gen = torch.Generator().manual_seed(7 + W)
        cu = long_memory_cu(gen, W, piece=48 if layout == "zigzag_per_doc" else 140)
        xs = long_memory_inputs(gen, cu, 2, 2, 16, 8, False)
        errs = compare_with_oracle(cu, xs, None, layout, "gather", True, group, W, backend, 24)
        assert max(errs.values()) <= TOL, f"{backend} {layout} W={W} cut: {errs}"
        restore = exchange_off("gather")
        try:
            off = compare_with_oracle(cu, xs, None, layout, "gather", True, group, W, backend, 24)
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
    from megatron_kcp.plan import split_segments
    x = torch.zeros(1, plan.num_local_tokens, 3)
    with pytest.raises(ValueError, match="not one split by max_segment"):
        kcp.causal_conv1d(x, torch.zeros(3, 4), plan=split_segments(plan, 24), group=group, backend="reference")


def _convs_cases():
    """``causal_conv1ds`` of three streams (one halo exchange): bit for bit as three ``causal_conv1d``
    calls (three exchanges), output and every gradient; output and input gradients against the
    one-device oracle; the collectives counted; the control: a zero halo misses the oracle."""
    from unittest import mock

    from megatron_kcp.parallel import halo
    from megatron_kcp.testing.checks import halo_off
    from megatron_kcp.testing.distributed import rel_err
    group = cp_group()
    W, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(3)
    for layout, kind in (("zigzag_per_doc", "random"), ("zigzag", "tiny"), ("contiguous", "random")):
        cu = random_cu_seqlens(gen, layout, W, kind)
        widths, ks = (3, 5, 2), 4
        xs = [torch.randn(1, cu[-1], d, generator=gen, dtype=torch.float64) for d in widths]
        ws = [torch.randn(d, ks, generator=gen, dtype=torch.float64) for d in widths]
        bs = [torch.randn(d, generator=gen, dtype=torch.float64) for d in widths[:2]] + [None]
        dys = [torch.randn(1, cu[-1], d, generator=gen, dtype=torch.float64) for d in widths]
        whole, plan = plan_for(cu, "contiguous", 1, 0, ks), plan_for(cu, layout, W, r, ks)

        def run(many):
            loc = [shard(plan, x)[0].requires_grad_() for x in xs]
            w_ = [w.clone().requires_grad_() for w in ws]
            b_ = [b.clone().requires_grad_() if b is not None else None for b in bs]
            calls = {"all_gather": 0, "reduce_scatter": 0}

            def counted(name):
                real = getattr(halo, name)

                def f(*a):
                    calls[name] += 1
                    return real(*a)
                return mock.patch.object(halo, name, f)
            with counted("all_gather"), counted("reduce_scatter"):
                ys = (kcp.causal_conv1ds(loc, w_, b_, plan=plan, group=group, backend="reference") if many else
                      [kcp.causal_conv1d(x, w, b, plan=plan, group=group, backend="reference")
                       for x, w, b in zip(loc, w_, b_)])
                leaves = loc + w_ + [b for b in b_ if b is not None]
                grads = torch.autograd.grad(ys, leaves, [shard(plan, dy)[0] for dy in dys])
            return ys, grads, calls

        ys, grads, calls = run(True)
        ys1, grads1, calls1 = run(False)
        assert all(torch.equal(a, b) for a, b in zip(ys + list(grads), ys1 + list(grads1))), (layout, kind)
        assert calls == dict.fromkeys(calls, 1 if W > 1 else 0), calls
        assert calls1 == dict.fromkeys(calls1, 3 if W > 1 else 0), calls1
        xs_ = [x.clone().requires_grad_() for x in xs]
        oracle = [kcp.causal_conv1d(x, w, b, plan=whole, backend="reference") for x, w, b in zip(xs_, ws, bs)]
        d_oracle = torch.autograd.grad(oracle, xs_, dys)
        errs = [rel_err(y, shard(plan, o)[0]) for y, o in zip(ys, oracle)]
        errs += [rel_err(g, shard(plan, o)[0]) for g, o in zip(grads[:3], d_oracle)]
        assert max(errs) <= TOL, (layout, kind, errs)
        restore = halo_off()
        try:
            off = kcp.causal_conv1ds([shard(plan, x)[0] for x in xs], ws, bs, plan=plan, group=group,
                                     backend="reference")
        finally:
            restore()
        miss = torch.tensor(max(rel_err(y, shard(plan, o)[0]) for y, o in zip(off, oracle)))
        dist.all_reduce(miss, op=dist.ReduceOp.MAX, group=group)
        assert miss >= 10 * TOL, f"{layout} {kind}: a zero halo still matches ({miss:.1e})"
    x = torch.zeros(1, plan.num_local_tokens, 3)
    with pytest.raises(ValueError, match="one weight and one bias"):
        kcp.causal_conv1ds([x, x], [torch.zeros(3, 4)], plan=plan, group=group, backend="reference")
    with pytest.raises(ValueError, match="dtypes differ"):
        kcp.causal_conv1ds([x, x.double()], [torch.zeros(3, 4)] * 2, plan=plan, group=group, backend="reference")


def test_convs_of_a_mixer_share_one_halo_exchange():
    spawn(_convs_cases, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_cut_segments_match_single_process(world_size):
    spawn(_split_cases, world_size, LAYOUTS)


def _cp2hp_cases(layouts):
    """The cp2hp peer (all-to-all to head shards) on random packings and the long-memory batch, every
    layout, GDN and KDA: the same function as the oracle, forward and backward."""
    group = cp_group()
    W = dist.get_world_size(group)
    for layout in layouts:
        for kda in (False, True):
            gen = torch.Generator().manual_seed(5)
            for kind in ("random", "single", "tiny"):
                cu = random_cu_seqlens(gen, layout, W, kind)
                for H, HV in ((W, W), (W, 2 * W)):        # grouped heads (fewer q/k than v), as Qwen3-Next
                    xs = random_inputs(gen, cu[-1], len(cu) - 1, H, HV, 8, 6, kda)[:5]
                    errs = compare_with_oracle(cu, xs, None, layout, "cp2hp", kind != "tiny", group, seed=1)
                    assert max(errs.values()) <= TOL, f"cp2hp {layout} {kind} kda={kda} H={H} HV={HV} cu={cu}: {errs}"
            cu = long_memory_cu(gen, W, piece=48)
            xs = long_memory_inputs(gen, cu, W, W, 16, 8, kda)
            errs = compare_with_oracle(cu, xs, None, layout, "cp2hp", True, group, 2)
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
                    off = compare_with_oracle(cu, xs, None, layout, "cp2hp", True, group, 2)
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


@pytest.mark.slow
def test_cp2hp_matches_single_process():
    spawn(_cp2hp_cases, 2, LAYOUTS)
