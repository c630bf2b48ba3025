"""The state rows a step zeroes (``LocalCore.state_reads``): every row for a core that reads every row,
only the rows a pass reads (:func:`megatron_kcp.kernels.core.state_rows`) for fla's, none of a tensor
where no row can be nonzero for flash-qla's. Whether the cores read no other row: the poisoned CP
suites (``tests/kernels/test_core_qla.py`` on the CPU, ``tests/ops/test_kcp_cuda.py::
test_cp_reads_no_unzeroed_state_rows`` on the GPU)."""
from __future__ import annotations

import pytest
import torch

from megatron_kcp.kernels.core import Prepared, may_be_nonzero, state_rows, zeroed_states
from megatron_kcp.plan import build_plan
from megatron_kcp.testing.cases import docs_cu


class _Core:
    def __init__(self, reads: str):
        self.state_reads = reads


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


def _zero_rows(reads, rank, grad):
    plan = build_plan(docs_cu(30, 2, seed=1), "contiguous", 2, rank)
    P = Prepared((), plan, 1.0, False, live=frozenset(c.segment for c in plan.recv_fwd))
    torch.use_deterministic_algorithms(True, warn_only=True)      # torch.empty -> NaN: unzeroed rows show
    try:
        h0 = zeroed_states(_Core(reads), P, (plan.num_segments, 2, 4, 4), "cpu", grad)
    finally:
        torch.use_deterministic_algorithms(False)
    return plan, P, [s for s in range(plan.num_segments) if bool((h0[s] == 0).all())]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("reads", ["all", "rows"])
def test_zeroed_states_zero_every_row_a_pass_reads(reads, rank, grad):
    plan, P, zero = _zero_rows(reads, rank, grad)
    assert zero == (list(range(plan.num_segments)) if reads == "all" else list(state_rows(P)))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_zeroed_states_skip_a_tensor_that_is_all_zero(rank, grad):
    """Contiguous layout at W = 2: rank 0 receives no state, rank 1 sends no state gradient back."""
    plan, P, zero = _zero_rows("nonzero", rank, grad)
    skipped = rank == (1 if grad else 0)
    assert zero == ([] if skipped else list(range(plan.num_segments)))
    assert may_be_nonzero(P, 0, plan.num_segments, grad) is not skipped
