"""KCP with the layout conversion (per-document zigzag -> contiguous -> back) equals the single-process
oracle, forward and every input gradient, on packs of 1 to 300 documents; and on inputs whose state
outlives a piece, the same comparison fails with the exchange switched off, or with the conversion
off by one document. Where the op's default converts and the heads divide, it moves to head shards
(cp2hp): the same, with that all-to-all's token order off by one document as the control."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.parallel import relayout
from megatron_kcp.testing.cases import docs_cu, long_memory_inputs
from megatron_kcp.testing.checks import TOL, compare_with_oracle, cp_group, exchange_off, rolled_by_one_document
from megatron_kcp.testing.distributed import spawn


def _convert(docs, kda_cases, controls):
    group = cp_group()
    W = dist.get_world_size(group)
    for n in docs:
        cu = docs_cu(n, W)
        for kda in kda_cases:
            xs = long_memory_inputs(torch.Generator().manual_seed(n), cu, 2, 4, 16, 8, kda)
            errs = compare_with_oracle(cu, xs, None, "zigzag_per_doc", "convert", True, group, seed=n)
            assert max(errs.values()) <= TOL, (n, kda, errs)
            if not controls:
                continue
            for inner in ("relay", "gather"):
                restore = exchange_off(inner)
                try:
                    with mock.patch.dict("os.environ", {"KCP_STRATEGY": inner}):
                        off = compare_with_oracle(cu, xs, None, "zigzag_per_doc", "convert", True, group, seed=n)
                finally:
                    restore()
                assert off["o"] > 10 * TOL, (n, kda, inner, off)
            if n == 1:
                continue                     # rolling the stream by its one document moves nothing
            relayout.route.cache_clear()
            with rolled_by_one_document():
                wrong = compare_with_oracle(cu, xs, None, "zigzag_per_doc", "convert", True, group, seed=n)
            relayout.route.cache_clear()
            assert min(wrong.values()) > 10 * TOL, (n, kda, wrong)


def test_convert_matches_single_process_with_negative_controls():
    spawn(_convert, 2, (10,), (False, True), True)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_convert_matches_single_process_1_to_300_documents(world_size):
    spawn(_convert, world_size, (1, 10, 100, 300), (False, True), world_size == 4)


def test_decision_follows_kcp_convert_within_a_process(monkeypatch):
    """The cached decision is keyed by the override: toggling KCP_CONVERT takes effect at once."""
    from megatron_kcp.ops import dispatch
    from megatron_kcp.plan import build_plan
    plan = build_plan(docs_cu(100, 2), "zigzag_per_doc", 2, 0)
    q, v = torch.zeros(1, plan.num_local_tokens, 2, 8), torch.zeros(1, plan.num_local_tokens, 2, 8)
    g = torch.zeros(1, plan.num_local_tokens, 2)
    for forced, layout in (("0", ""), ("1", "contiguous"), ("0", "")):
        monkeypatch.setenv("KCP_CONVERT", forced)
        assert dispatch.decide(plan, q, v, g).layout == layout


def _to_heads(kda_cases):
    from megatron_kcp.ops import dispatch
    from megatron_kcp.parallel import cp2hp
    from megatron_kcp.plan import build_plan
    group = cp_group()
    W, r = dist.get_world_size(group), dist.get_rank(group)
    cu = docs_cu(100, W)
    plan = build_plan(cu, "zigzag_per_doc", W, r)
    for kda in kda_cases:
        xs = long_memory_inputs(torch.Generator().manual_seed(7), cu, 2, 4, 16, 8, kda)
        loc = [x[:, :plan.num_local_tokens] for x in xs]
        h0 = torch.randn(len(cu) - 1, 4, 16, 8, generator=torch.Generator().manual_seed(8))
        assert dispatch.decide(plan, loc[0], loc[2], loc[3]).strategy == "cp2hp"
        assert dispatch.decide(plan, loc[0], loc[2], loc[3], initial_state=h0).layout == "contiguous"
        errs = compare_with_oracle(cu, xs, None, "zigzag_per_doc", "auto", True, group, seed=9, backend="auto")
        assert max(errs.values()) <= TOL, (kda, errs)
        seeded = compare_with_oracle(cu, xs, h0, "zigzag_per_doc", "auto", True, group, seed=9, backend="auto")
        assert max(seeded.values()) <= TOL, (kda, seeded)

        def rolled(plan, device):         # the rows arrive one document late; o goes back to the right rows
            order = cp2hp.TokenOrder(plan, device)
            order.inv = torch.roll(order.inv, cu[1])
            return order
        with mock.patch.object(cp2hp, "token_order", rolled):
            wrong = compare_with_oracle(cu, xs, None, "zigzag_per_doc", "auto", True, group, seed=9, backend="auto")
        assert wrong["o"] > 10 * TOL, (kda, wrong)


def test_the_default_converts_to_head_shards_where_the_heads_divide():
    """The default's pick on 100 documents at W = 2 (2 q/k and 4 value heads): head shards, equal to the
    oracle forward and backward; with an initial state (cp2hp takes none) the contiguous layout."""
    spawn(_to_heads, 2, (False, True))


def test_head_shards_only_where_nothing_rules_them_out(monkeypatch):
    """Heads that do not divide W, a named backend, ``KCP_CONVERT=1`` or ``KCP_STRATEGY`` keep the
    contiguous layout; one document (nothing to convert) stays."""
    from megatron_kcp.ops import dispatch
    from megatron_kcp.plan import build_plan
    monkeypatch.delenv("KCP_CONVERT", raising=False)
    monkeypatch.delenv("KCP_STRATEGY", raising=False)

    def pick(n, W, heads=(2, 4), **kw):
        plan = build_plan(docs_cu(n, W), "zigzag_per_doc", W, 0)
        T = plan.num_local_tokens
        q, v, g = torch.zeros(1, T, heads[0], 16), torch.zeros(1, T, heads[1], 8), torch.zeros(1, T, heads[1])
        d = dispatch.decide(plan, q, v, g, **kw)
        return d.strategy if d.strategy == "cp2hp" else d.layout
    assert pick(100, 2) == "cp2hp" and pick(100, 4, heads=(4, 8)) == "cp2hp"
    assert pick(100, 4) == "contiguous"                     # 2 q/k heads over 4 ranks
    assert pick(100, 2, backend="reference") == "contiguous"
    assert pick(1, 2) == ""
    monkeypatch.setenv("KCP_CONVERT", "1")
    assert pick(100, 2) == "contiguous"
    monkeypatch.delenv("KCP_CONVERT")
    monkeypatch.setenv("KCP_STRATEGY", "gather")
    assert pick(100, 2) == "contiguous"
