"""The state rows a step zeroes: every row for a core that reads every row, only the rows a pass reads
(:func:`megatron_kcp.parallel.core.state_rows`) for a ``sparse_states`` core. Whether fla's core reads
no other row is a GPU test (``tests/ops/test_kcp_cuda.py::test_cp_reads_no_unzeroed_state_rows``)."""
from __future__ import annotations

import pytest
import torch

from megatron_kcp.parallel.core import Prepared, state_rows, zeroed_states
from megatron_kcp.parallel.plan import build_plan
from megatron_kcp.testing.cases import docs_cu


class _Core:
    def __init__(self, sparse: bool):
        self.sparse_states = sparse


@pytest.mark.parametrize("layout", ["contiguous", "zigzag_per_doc"])
@pytest.mark.parametrize("rank", [0, 1])
def test_state_rows_are_the_live_segments_and_those_with_a_successor(layout, rank):
    plan = build_plan(docs_cu(30, 2, seed=1), layout, 2, rank)
    received = frozenset(c.segment for c in plan.recv_fwd)
    P = Prepared((), plan, 1.0, False, live=received)
    rows = state_rows(P)
    assert set(rows) == received | {s for s in range(plan.num_segments) if plan.succ[s] is not None}
    assert state_rows(Prepared((), plan, 1.0, False)) == tuple(range(plan.num_segments))   # live unknown: all
    if layout == "contiguous":          # one document crosses the rank edge: one row of ~16
        assert len(rows) == 1 and plan.num_segments > 10


@pytest.mark.parametrize("sparse", [False, True])
def test_zeroed_states_zero_every_row_a_pass_reads(sparse):
    plan = build_plan(docs_cu(30, 2, seed=1), "contiguous", 2, 1)
    P = Prepared((), plan, 1.0, False, live=frozenset(c.segment for c in plan.recv_fwd))
    torch.use_deterministic_algorithms(True, warn_only=True)      # torch.empty -> NaN: unzeroed rows show
    try:
        h0 = zeroed_states(_Core(sparse), P, (plan.num_segments, 2, 4, 4), "cpu")
    finally:
        torch.use_deterministic_algorithms(False)
    zero = [s for s in range(plan.num_segments) if bool((h0[s] == 0).all())]
    assert zero == (list(range(plan.num_segments)) if sparse is False else list(state_rows(P)))
