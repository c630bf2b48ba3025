"""The CP plan: layouts, segments, chains, halos, and the errors bad input gets."""
from __future__ import annotations

import pytest
import torch

from megatron_kcp.plan import build_plan, check_cu_seqlens, local_token_index, plan_for_cp_group


@pytest.mark.parametrize("layout,pieces", [
    ("contiguous", [[(0, 6)], [(6, 12)]]),
    ("zigzag", [[(0, 3), (9, 12)], [(3, 6), (6, 9)]]),
    ("zigzag_per_doc", [[(0, 1), (3, 4), (4, 6), (10, 12)], [(1, 2), (2, 3), (6, 8), (8, 10)]]),
])
def test_layout_pieces(layout, pieces):
    for r in range(2):
        assert [list(p) for p in build_plan((0, 4, 12), layout, 2, r).pieces] == [list(p) for p in pieces[r]]


def test_every_token_held_once():
    cu = (0, 8, 40, 48)
    for layout in ("contiguous", "zigzag", "zigzag_per_doc"):
        idx = torch.cat([local_token_index(build_plan(cu, layout, 4, r)) for r in range(4)])
        assert sorted(idx.tolist()) == list(range(48))


def test_chains_single_sequence_zigzag():
    # one sequence over 2 ranks, zigzag: chunk order 0 (r0), 1 (r1), 2 (r1), 3 (r0); rank 1's two
    # chunks are neighbours in the stream, so they run as one segment and exchange nothing between them
    p0, p1 = (build_plan((0, 8), "zigzag", 2, r) for r in range(2))
    assert p0.cu_seqlens == (0, 2, 4) and p0.seg_seq == (0, 0)
    assert p1.cu_seqlens == (0, 4) and p1.seg_seq == (0,)
    # the relay's path: r0 chunk 0 -> r1 chunks 1-2 -> r0 chunk 3, and back
    assert p0.pred == (None, (1, 0)) and p0.succ == ((1, 0), None) and p0.stage == (0, 2)
    assert p1.pred == ((0, 0),) and p1.succ == ((0, 1),) and p1.stage == (1,)
    # the all-gather's folds: chunk 3 folds r0's chunk 0 then r1's chunks 1-2; backward, chunk 0 folds
    # chunk 3 (r0) then chunks 1-2 (r1)
    assert [(c.segment, c.sources) for c in p0.recv_fwd] == [(1, ((0, 0), (1, 0)))]
    assert [(c.segment, c.sources) for c in p0.recv_bwd] == [(0, ((0, 0), (1, 0)))]
    assert [c.sources for c in p1.recv_fwd] == [((0, 0),)] and [c.sources for c in p1.recv_bwd] == [((0, 0),)]


def test_relay_phases():
    from megatron_kcp.parallel.relay import phases

    def rows(steps):
        return [(s.recv, s.send, s.segs, s.span) for s in steps]
    # zigzag: the two pieces of rank 0 are disjoint ranges, each a phase of its own run whole
    p0 = build_plan((0, 8), "zigzag", 2, 0)
    assert rows(phases(p0, backward=False)) == [((), (0,), (0,), (0, 1)), ((1,), (), (1,), (1, 2))]
    assert rows(phases(p0, backward=True)) == [((), (1,), (1,), (1, 2)), ((0,), (), (0,), (0, 1))]
    # per-document zigzag interleaves [front, back] per document: each phase passes its own segments
    # (no span: the rest of the step runs once over everything)
    p0 = build_plan((0, 8, 16), "zigzag_per_doc", 2, 0)
    assert rows(phases(p0, backward=False)) == [((), (0, 2), (0, 2), None), ((1, 3), (), (1, 3), None)]
    assert rows(phases(p0, backward=True)) == [((), (1, 3), (1, 3), None), ((0, 2), (), (0, 2), None)]
    # a whole local document joins the phase whose range follows it: rank 0 holds [0, 3) and [9, 12),
    # segments [0, 2) (its own document), [2, 3) (on to rank 1) and [9, 12) (from rank 1)
    p0 = build_plan((0, 2, 6, 8, 12), "zigzag", 2, 0)
    assert rows(phases(p0, backward=False)) == [((), (1,), (0, 1), (0, 2)), ((2,), (), (2,), (2, 3))]


def test_rank_counts():
    # 4 ranks x 8 tokens, sequences [0, 5) [5, 30) [30, 32): rank 1 continues seq 1 from rank 0 and
    # hands it on to ranks 2 and 3; it receives 3 conv tokens
    plans = [build_plan((0, 5, 30, 32), "contiguous", 4, r, conv_kernel_size=4) for r in range(4)]
    assert [(p.pre_num_ranks, p.post_num_ranks, p.num_conv_halo_tokens) for p in plans] == \
        [(0, 3, 0), (1, 2, 3), (2, 1, 3), (3, 0, 3)]


def test_halo_spans_ranks_when_pieces_are_short():
    # pieces of 1 token, kernel 4: rank 3's halo comes from ranks 0, 1, 2
    plan = build_plan((0, 4), "contiguous", 4, 3, conv_kernel_size=4)
    assert plan.halo_src == ((0, 0, 2), (1, 0, 2), (2, 0, 2))
    plan = build_plan((0, 2, 4), "contiguous", 4, 3, conv_kernel_size=4)
    assert plan.halo_src == ((-1, 0, 0), (-1, 0, 0), (2, 0, 2))          # never across a sequence start


@pytest.mark.parametrize("cu,match", [
    ((1, 8), "start at 0"),
    ((0, 8, 8, 16), "strictly increasing"),
    ((0, 9, 4), "strictly increasing"),
    (torch.tensor([0.0, 8.0]), "integer"),
])
def test_bad_cu_seqlens(cu, match):
    with pytest.raises(ValueError, match=match):
        check_cu_seqlens(cu)


@pytest.mark.parametrize("layout,cu,match", [
    ("contiguous", (0, 10), "multiple of 4"),
    ("zigzag", (0, 12), "multiple of 2\\*CP = 8"),
    ("zigzag_per_doc", (0, 8, 12), "document \\[8, 12\\)"),
    ("ring", (0, 8), "unknown CP layout"),
])
def test_bad_layout_split(layout, cu, match):
    with pytest.raises(ValueError, match=match):
        build_plan(cu, layout, 4, 0)


def test_missing_cp_group():
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        plan_for_cp_group((0, 8))


def test_cu_seqlens_tensor_read_once_and_again_when_changed():
    """Every layer of a step plans from the same cu_seqlens tensor, read (a host sync on CUDA) once; a
    changed or new tensor must be read again, never a stale plan."""
    t = torch.tensor([0, 4, 8])
    assert check_cu_seqlens(t) == (0, 4, 8)
    assert check_cu_seqlens(t) == (0, 4, 8)
    t[1] = 2                                            # in place: its version moves
    assert check_cu_seqlens(t) == (0, 2, 8)
    assert check_cu_seqlens(torch.tensor([0, 6, 8])) == (0, 6, 8)
    assert check_cu_seqlens(torch.tensor([[0, 3, 8]])) == (0, 3, 8)     # Megatron's (1, n)
    with torch.inference_mode():
        assert check_cu_seqlens(torch.tensor([0, 5, 8])) == (0, 5, 8)


def test_cu_seqlens_on_the_gpu_refused_under_graph_capture():
    """A CUDA graph would replay the plan of the batch it captured: device cu_seqlens (which the plan must
    read on the host) are refused while capturing, with the fix; host values, which the caller keeps
    fixed, are not."""
    from unittest import mock
    with mock.patch("megatron_kcp.plan.capturing", return_value=True):
        with pytest.raises(ValueError, match="CUDA graph is captured.*never change"):
            check_cu_seqlens(torch.tensor([0, 4, 8], device="meta"))
        assert check_cu_seqlens(torch.tensor([0, 4, 8])) == (0, 4, 8)
        assert check_cu_seqlens((0, 4, 8)) == (0, 4, 8)
