"""KCP with the layout conversion (per-document zigzag -> contiguous -> back) equals the single-process
oracle, forward and every input gradient, on packs of 1 to 300 documents; and on inputs whose state
outlives a piece, the same comparison fails with the exchange switched off, or with the conversion
off by one document."""
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
    from megatron_kcp.parallel.plan import build_plan
    plan = build_plan(docs_cu(100, 2), "zigzag_per_doc", 2, 0)
    q, v = torch.zeros(1, plan.num_local_tokens, 2, 8), torch.zeros(1, plan.num_local_tokens, 2, 8)
    g = torch.zeros(1, plan.num_local_tokens, 2)
    for forced, layout in (("0", ""), ("1", "contiguous"), ("0", "")):
        monkeypatch.setenv("KCP_CONVERT", forced)
        assert dispatch.decide(plan, q, v, g).layout == layout
