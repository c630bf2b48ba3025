"""The relay pipelined over head groups (``KCP_RELAY_GROUPS`` forced): CP ranks (gloo, CPU, reference
core) against the fp64 oracle in the output and every input gradient, GDN (grouped heads) and KDA,
every layout, W = 2 and 4; the pipelined run equal to the unpipelined one bit for bit; a wrong
exchange of group rows caught; the cost model's G and the override's validation."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.ops import kcp
from megatron_kcp.kernels.core_reference import ReferenceCore
from megatron_kcp.parallel import cost_model, relay
from megatron_kcp.plan import LAYOUTS, all_plans, build_plan
from megatron_kcp.testing.cases import long_memory_cu, long_memory_inputs, plan_for, random_cu_seqlens, \
    random_inputs, shard
from megatron_kcp.testing.checks import TOL, compare_with_oracle, cp_group, exchange_off
from megatron_kcp.testing.distributed import rel_err, spawn

H, K, V = 4, 16, 8
MODELS = ((False, 2 * H), (True, H))          # (KDA, value heads): GDN with grouped value heads, KDA without


@contextlib.contextmanager
def groups(G: int | None):
    """``KCP_RELAY_GROUPS=G`` in this process (unset for None), restored after."""
    old = os.environ.pop("KCP_RELAY_GROUPS", None)
    if G is not None:
        os.environ["KCP_RELAY_GROUPS"] = str(G)
    try:
        yield
    finally:
        os.environ.pop("KCP_RELAY_GROUPS", None)
        if old is not None:
            os.environ["KCP_RELAY_GROUPS"] = old


@contextlib.contextmanager
def head_widths():
    """Record the heads of every pass the reference core runs: (direction, value heads in the group)."""
    seen, state, backward_state = [], ReferenceCore.state, ReferenceCore.backward_state

    def width(heads, HV):
        return HV if heads is None else heads.stop - heads.start

    def spy_state(self, P, st, segs, h0, heads=None):
        seen.append(("fwd", width(heads, h0.shape[1])))
        return state(self, P, st, segs, h0, heads)

    def spy_backward_state(self, P, B, segs, dht, heads=None):
        seen.append(("bwd", width(heads, dht.shape[1])))
        return backward_state(self, P, B, segs, dht, heads)
    ReferenceCore.state, ReferenceCore.backward_state = spy_state, spy_backward_state
    try:
        yield seen
    finally:
        ReferenceCore.state, ReferenceCore.backward_state = state, backward_state


def _check(errs, what):
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, f"{what}: {bad}"


def _rotated_receive(receive):
    """``relay._receive`` that puts each group's rows into the next group's heads: a wrong exchange."""
    def wrong(p2p, segs, links, into, heads=None):
        if heads is not None:
            n, HV = heads.stop - heads.start, into.shape[1]
            heads = slice((heads.start + n) % HV, (heads.start + n) % HV + n)
        return receive(p2p, segs, links, into, heads)
    return wrong


def _controls(cu, xs, layout, group, what):
    """The long-memory comparison misses the oracle by at least 10x the tolerance (the output and every
    input gradient) with each group's rows received into the next group's heads, and with the
    exchange off."""
    receive, relay._receive = relay._receive, _rotated_receive(relay._receive)
    try:
        rotated = compare_with_oracle(cu, xs, None, layout, "relay", True, group, seed=1)
    finally:
        relay._receive = receive
    restore = exchange_off()
    try:
        off = compare_with_oracle(cu, xs, None, layout, "relay", True, group, seed=1)
    finally:
        restore()
    for name, errs in (("groups rotated", rotated), ("exchange off", off)):
        weak = {k: v for k, v in errs.items() if not v >= 10 * TOL}
        assert not weak, f"{what} {name}: these still match: {weak} (all: {errs})"
        if dist.get_rank(group) == 0:
            print(f"{what} {name}: " + " ".join(f"{k}:{v:.1e}" for k, v in errs.items()), flush=True)


def _against_oracle(cases, controls=False):
    """For each (layout, kda, G): the relay with G head groups against the oracle on the long-memory
    batch (with ``controls``: and :func:`_controls` on it), and on a random packing with the user's
    initial states; every pass ran on HV / G heads, forward and backward."""
    group = cp_group()
    W = dist.get_world_size(group)
    for layout, kda, G in cases:
        HV, what = dict(MODELS)[kda], f"{layout} W={W} kda={kda} G={G}"
        gen = torch.Generator().manual_seed(7 + W)
        cu = long_memory_cu(gen, W, piece=8)
        xs = long_memory_inputs(gen, cu, H, HV, K, V, kda)
        with groups(G):
            with head_widths() as seen:
                _check(compare_with_oracle(cu, xs, None, layout, "relay", True, group, seed=1), f"{what} long memory")
                rcu = random_cu_seqlens(gen, layout, W, "random")
                rxs = random_inputs(gen, rcu[-1], len(rcu) - 1, H, HV, K, V, kda)
                _check(compare_with_oracle(rcu, rxs[:5], rxs[5], layout, "relay", True, group, seed=2),
                       f"{what} cu={rcu} with initial states")
            if controls:
                _controls(cu, xs, layout, group, what)
        assert {w for _, w in seen} == {HV // G} and {d for d, _ in seen} == {"fwd", "bwd"}, seen


def _cases(depths):
    """Every layout, GDN and KDA, with the depths in ``depths`` taken in turn."""
    cases = [(layout, kda) for layout in LAYOUTS for kda in (False, True)]
    return [(layout, kda, depths[i % len(depths)]) for i, (layout, kda) in enumerate(cases)]


def test_pipelined_relay_matches_oracle_and_a_wrong_exchange_misses():
    """W = 2: every layout, GDN and KDA, G = 2 and 4 in turn; the controls on each long-memory case."""
    spawn(_against_oracle, 2, _cases((2, 4)), True)


def test_pipelined_relay_matches_oracle_on_four_ranks():
    spawn(_against_oracle, 4, _cases((4, 2)))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("G", [2, 4])
def test_pipelined_relay_matches_oracle_every_depth(world_size, G):
    spawn(_against_oracle, world_size, _cases((G,)), True)


def _run(cu, xs, h0, layout, group):
    """(o, dq, dk, dv, dg, dbeta, dh0) of this rank's relay run."""
    plan = plan_for(cu, layout, dist.get_world_size(group), dist.get_rank(group))
    loc = [x.clone().requires_grad_() for x in shard(plan, *xs)]
    init = h0.clone().requires_grad_()
    o = kcp.gated_delta_rule(*loc, plan, group, initial_state=init, use_qk_l2norm=True, backend="reference",
                             strategy="relay")
    do = shard(plan, torch.randn(1, cu[-1], *xs[2].shape[2:], generator=torch.Generator().manual_seed(3),
                                 dtype=xs[2].dtype))[0]
    return (o, *torch.autograd.grad(o, loc + [init], do))


def _bitwise(layouts):
    """The relay with G = 2 and 4 against G = 1, every output and gradient, fp32 and fp64: equal bit for
    bit where every group holds two heads or more. A group of one head in fp64 is let off with 1e-14:
    LAPACK's triangular solve of one matrix (the oracle's WY form, chunks of odd size) rounds
    differently from the same matrix in a batch, so the oracle itself is not batch-invariant there."""
    group = cp_group()
    W = dist.get_world_size(group)
    names = ("o", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for layout in layouts:
        for kda, HV in MODELS:
            for dtype in (torch.float32, torch.float64):
                gen = torch.Generator().manual_seed(11)
                cu = random_cu_seqlens(gen, layout, W, "random")
                xs = random_inputs(gen, cu[-1], len(cu) - 1, H, HV, K, V, kda, dtype=dtype)
                with groups(1):
                    want = _run(cu, xs[:5], xs[5], layout, group)
                for G in (2, 4):
                    with groups(G):
                        got = _run(cu, xs[:5], xs[5], layout, group)
                    what = f"{layout} kda={kda} {dtype} G={G} against G=1"
                    if HV // G == 1 and dtype == torch.float64:
                        errs = {n: rel_err(a, b) for n, a, b in zip(names, got, want)}
                        assert max(errs.values()) <= 1e-14, f"{what}: {errs}"
                    else:
                        differ = [n for n, a, b in zip(names, got, want) if not torch.equal(a, b)]
                        assert not differ, f"{what}: {differ} differ"


def test_pipelined_equals_unpipelined_bit_for_bit():
    spawn(_bitwise, 2, LAYOUTS)


# the cost model: plans with nothing to exchange, a short chain, a long one
ONE_SEQ = (0, 1 << 17)


@pytest.mark.parametrize("cu,layout,W", [(ONE_SEQ, "contiguous", 8), (ONE_SEQ, "zigzag", 4),
                                         ((0, 1000, 1 << 16), "zigzag_per_doc", 4), ((0, 256), "zigzag", 2),
                                         ((0, 4096, 8192), "contiguous", 2), (ONE_SEQ, "contiguous", 1)])
@pytest.mark.parametrize("HV,Hqk", [(64, 64), (32, 16), (4, 4)])
def test_pipeline_depth_is_one_decision_for_every_rank(cu, layout, W, HV, Hqk, monkeypatch):
    """Every rank's plan gives the same G (it reads only what they share), and it divides H."""
    monkeypatch.delenv("KCP_RELAY_GROUPS", raising=False)
    depths = {cost_model.pipeline_depth(p, HV, Hqk, 128) for p in all_plans(cu, layout, W)}
    assert len(depths) == 1 and Hqk % depths.pop() == 0


def test_pipeline_depth_is_one_where_nothing_waits(monkeypatch):
    """No exchange (one rank, sequences cut on rank edges) or a short chain: G = 1; a long chain at many
    heads: G > 1, with each group at least ``MIN_GROUP_HEADS`` heads."""
    monkeypatch.delenv("KCP_RELAY_GROUPS", raising=False)
    for cu, layout, W in [(ONE_SEQ, "contiguous", 1), ((0, 4096, 8192), "contiguous", 2),
                          ((0, 256), "zigzag", 2), ((0, 64, 128, 192, 256), "zigzag_per_doc", 1)]:
        for p in all_plans(cu, layout, W):
            assert cost_model.pipeline_depth(p, 64, 64, 128) == 1, (cu, layout, W)
    plan = build_plan(ONE_SEQ, "contiguous", 8, 3)
    G = cost_model.pipeline_depth(plan, 128, 128, 128)
    assert G > 1 and 128 // G >= cost_model.MIN_GROUP_HEADS
    assert cost_model.pipeline_depth(plan, 64, 64, 128) == 1        # groups too small to fill the GPU
    assert cost_model.pipeline_depth(plan, 4, 4, 128) == 1


def test_flash_qla_core_keeps_one_group_unless_forced(monkeypatch):
    """flash-qla's passes are latency-bound scans (a group's pass takes about as long as all heads'):
    its core says so, and the cost model keeps G = 1 where it would split fla's; KCP_RELAY_GROUPS
    still forces groups (the GPU tests run them)."""
    from megatron_kcp.kernels.core_fla import GDNCore
    from megatron_kcp.kernels.core_qla import GDNQLACore
    monkeypatch.delenv("KCP_RELAY_GROUPS", raising=False)
    plan = build_plan(ONE_SEQ, "contiguous", 8, 3)
    assert cost_model.pipeline_depth(plan, 128, 128, 128, GDNCore.min_group_heads) > 1
    assert cost_model.pipeline_depth(plan, 128, 128, 128, GDNQLACore.min_group_heads) == 1
    monkeypatch.setenv("KCP_RELAY_GROUPS", "4")
    assert cost_model.pipeline_depth(plan, 128, 128, 128, GDNQLACore.min_group_heads) == 4


def test_pipeline_depth_override(monkeypatch):
    """``KCP_RELAY_GROUPS`` wins where it divides H (whole q/k heads a group); anything else is a
    ValueError naming the fix, raised by the relay's check before any kernel."""
    plan = build_plan((0, 64), "contiguous", 2, 0)
    monkeypatch.setenv("KCP_RELAY_GROUPS", "2")
    assert cost_model.pipeline_depth(plan, 8, 4, 16) == 2
    monkeypatch.setenv("KCP_RELAY_GROUPS", "1")
    assert cost_model.pipeline_depth(plan, 8, 4, 16) == 1
    q, v = torch.zeros(1, 32, 4, 16), torch.zeros(1, 32, 8, 16)
    for bad in ("3", "8", "0", "-2", "two", "2.0"):
        monkeypatch.setenv("KCP_RELAY_GROUPS", bad)
        with pytest.raises(ValueError, match=r"must divide the value heads .* use one of 1, 2, 4 \(or unset it"):
            cost_model.pipeline_depth(plan, 8, 4, 16)
        with pytest.raises(ValueError, match="KCP_RELAY_GROUPS"):
            relay.Relay().check(q, v, plan, None)
