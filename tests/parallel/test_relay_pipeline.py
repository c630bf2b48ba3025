"""The relay pipelined over head groups (``KCP_RELAY_GROUPS`` forced): CP ranks (gloo, CPU, reference
core) against the fp64 oracle in the output and every input gradient, GDN (grouped heads) and KDA,
every layout, W = 2 and 4; the pipelined run equal to the unpipelined one bit for bit; a wrong
exchange of group rows caught (the cost model's G: tests/parallel/test_cost_model.py)."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.ops import kcp
from megatron_kcp.kernels.core_reference import ReferenceCore
from megatron_kcp.parallel import relay
from megatron_kcp.plan import LAYOUTS
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
