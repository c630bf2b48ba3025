"""CPU: the launch geometry core_fla hands fla's sequence-grid kernels (no kernel runs here).

A ``Selection`` is checked against what fla's state kernels do with it: a program with cu_seqlens
pair (bos, eos) walks the chunks of [bos, eos) when eos > bos, writing chunk states from its chunk
offset on, and otherwise only moves its initial-state row to its final-state row.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_kcp.kernels import core_fla
from megatron_kcp.kernels.core import Prepared
from megatron_kcp.plan import build_plan

CU = (0, 100, 164, 165, 300, 301, 500, 620, 640, 900)


def _walk(sel):
    """What each program of one launch does: (program, token range walked, first chunk written)."""
    cu, off = sel.cu.tolist(), sel.offsets.tolist()
    return [(p, (cu[p], cu[p + 1]), off[p]) for p in range(sel.num_programs) if cu[p + 1] > cu[p]]


@pytest.mark.parametrize("lo,hi", [(0, 9), (2, 7)])
def test_selection_walks_exactly_the_chosen_segments(lo, hi):
    plan = build_plan(CU, "contiguous", 1, 0, 1)
    off = core_fla._chunk_offsets(plan, lo, hi)
    base = plan.cu_seqlens[lo]
    every = range(lo, hi)
    for r in range(1, hi - lo + 1):
        for segs in itertools.combinations(every, r):
            sel = core_fla._selection(plan, lo, hi, segs, "cpu")
            walked = _walk(sel)
            want = [((plan.cu_seqlens[s] - base, plan.cu_seqlens[s + 1] - base), off[s - lo]) for s in segs]
            assert sorted(w[1:] for w in walked) == sorted(want), segs
            # every chosen segment's final-state row comes from its own program, fed its own initial state
            rows = list(range(sel.num_programs)) if sel.rows is None else sel.rows.tolist()
            src = list(range(sel.src.start, sel.src.stop)) if isinstance(sel.src, slice) else sel.src.tolist()
            cu = sel.cu.tolist()
            for s, p in zip(segs, rows):
                assert (cu[p], cu[p + 1]) == (plan.cu_seqlens[s] - base, plan.cu_seqlens[s + 1] - base)
                assert src[p] == s - lo
            # programs between runs walk nothing; one per gap between runs
            runs = len(core_fla._runs(segs))
            assert sel.num_programs == len(segs) + runs - 1
            assert (sel.rows is None) == (runs == 1)


def test_passes_skip_state_rows_nobody_needs():
    plan = build_plan(CU, "contiguous", 2, 0, 1)
    n = plan.num_segments
    P = Prepared((), plan, 1.0, False, live=frozenset())
    rows, free, at = core_fla._by_state_rows(P, range(n))
    # rank 0 of two: only the segment its sequence continues from on rank 1 hands a state on
    assert rows == tuple(i for i in range(n) if plan.succ[i] is not None) and len(rows) == 1
    assert set(rows) | set(free) == set(range(n)) and not set(rows) & set(free)
    assert at == rows                          # positions in range(n) are the segments themselves
    P.live = frozenset({0})
    assert core_fla._by_state_rows(P, range(n))[0] == tuple(sorted({0, *rows}))
    # a part of the range: positions are within the part
    part = tuple(range(1, n))
    rows, free, at = core_fla._by_state_rows(P, part)
    assert [part[j] for j in at] == list(rows) and 0 not in rows + free
    P.live = None                              # unknown: every segment reads and writes its rows
    assert core_fla._by_state_rows(P, range(n)) == (tuple(range(n)), (), tuple(range(n)))


def test_rows_in_order_of_the_range():
    """A pass over some rows of a range returns a row per segment of the range, each in its place."""
    like = torch.zeros(4, 2)
    out = torch.tensor([[1.0, 1.0], [3.0, 3.0]])
    full = core_fla._in_order(out, (1, 3), 4, like)
    assert full.shape == (4, 2) and full[1].tolist() == [1.0, 1.0] and full[3].tolist() == [3.0, 3.0]
    assert core_fla._in_order(out, (0, 1), 2, like) is out     # every row: the pass's own tensor
