"""The layout conversion moves every row to the rank and row its position has in the other layout,
and its backward is the same permutation the other way (routes checked without processes; the
all-to-all itself on gloo ranks, with and without the TP split of sequence parallelism)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.parallel.relayout import positions, route
from megatron_kcp.testing.distributed import spawn

CU = (0, 8, 24, 40, 48, 96)       # five documents, each a multiple of 2 * W * TP for W * TP <= 4


def _convert_by_hand(cu, source, target, W, tp):
    """Every rank's rows after the routes' all-to-all, played out in one process."""
    G = W * tp
    rows = [positions(cu, source, W, tp, r) for r in range(G)]
    routes = [route(cu, source, target, W, tp, r) for r in range(G)]
    sent = [list(rows[r][routes[r].send_rows].split(list(routes[r].send_counts))) for r in range(G)]
    return [torch.cat([sent[s][d] for s in range(G)])[routes[d].recv_rows] for d in range(G)]


@pytest.mark.parametrize("W,tp", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("source,target", [("zigzag_per_doc", "contiguous"), ("contiguous", "zigzag_per_doc"),
                                           ("zigzag", "contiguous"), ("zigzag_per_doc", "zigzag")])
def test_routes_put_every_position_where_the_target_layout_holds_it(source, target, W, tp):
    moved = _convert_by_hand(CU, source, target, W, tp)
    for r in range(W * tp):
        assert torch.equal(moved[r], positions(CU, target, W, tp, r)), (r, moved[r])


def test_sequence_parallel_split_must_divide():
    with pytest.raises(ValueError, match="pad the packed sequence to a multiple of 2 \\* CP \\* TP"):
        positions((0, 12), "zigzag_per_doc", 2, 4, 0)


def _all_to_all(tp):
    from megatron_kcp.parallel.relayout import relayout
    G, rank = dist.get_world_size(), dist.get_rank()
    W = G // tp
    src, dst = positions(CU, "zigzag_per_doc", W, tp, rank), positions(CU, "contiguous", W, tp, rank)
    x = torch.randn(CU[-1], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(CU[-1], dtype=torch.bfloat16)                 # another dtype in the same all-to-all
    xl = x[src].clone().requires_grad_()
    y, y_ids = relayout([xl, ids[src]], CU, "zigzag_per_doc", "contiguous", dist.group.WORLD, tp)
    assert torch.equal(y, x[dst]) and torch.equal(y_ids, ids[dst])
    dy = torch.randn(CU[-1], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y.backward(dy[dst])
    assert torch.equal(xl.grad, dy[src])
    back, = relayout([y.detach()], CU, "contiguous", "zigzag_per_doc", dist.group.WORLD, tp)
    assert torch.equal(back, x[src])


@pytest.mark.parametrize("world_size,tp", [(2, 1), (4, 2)])
def test_relayout_moves_rows_and_gradients_exactly(world_size, tp):
    spawn(_all_to_all, world_size, tp)
