"""The cost model (megatron_kcp.parallel.cost_model), no GPU: the exchange it chooses, the relay's head groups, the
layout move, and the properties its formulas must keep (zero where nothing moves, monotone in what is moved and
in the link, every rank's plan of a problem priced alike, the overrides)."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron_kcp.options import Options
from megatron_kcp.parallel import cost_model, relay
from megatron_kcp.plan import LAYOUTS, all_plans, build_plan
from megatron_kcp.problem import Problem
from megatron_kcp.testing.cases import docs_cu

# plans with nothing to exchange, a short chain, a long one
ONE_SEQ = (0, 1 << 17)
MANY = docs_cu(100, 8)           # padded for W = 2, 4 and 8
OP = 2 * 64 * ((4 * 128 + 1) * 2 + 4)        # the op's bytes a token (q, k, v, g, beta, o and their gradients)


def exchange(plan, heads: int = 64, strategy: str | None = None) -> str:
    """The exchange the dispatch takes for ``plan`` in its own layout (``KCP_CONVERT=0``) on the CPU, with
    ``KCP_STRATEGY=strategy``: the cheapest of the registered strategies that apply (their ``cost``, which is
    :func:`cost_model.costs`)."""
    from megatron_kcp.ops.dispatch import decide_problem
    return decide_problem(Problem(plan, torch.device("cpu"), torch.float32, False, (128, 128), heads, heads,
                                  options=Options(strategy=strategy, convert="0"))).strategy


def test_strategy_choice():
    """The exchange the cost model (megatron_kcp.parallel.cost_model) prices cheaper: the all-gather where no
    transition map is needed, else the cheaper of the relay's chain and the maps; every rank of a plan
    chooses alike; ``KCP_STRATEGY`` overrides."""
    def picks(cu, layout, W, strategy=None):
        out = {exchange(build_plan(cu, layout, W, r), strategy=strategy) for r in range(W)}
        assert len(out) == 1, f"ranks disagree: {out}"
        return out.pop()
    docs = (0, 40, 100, 160, 256)
    assert picks(docs, "contiguous", 2) == "gather"          # each document crosses at most one edge
    assert picks(docs, "zigzag", 2) == "gather"
    assert picks(docs, "zigzag_per_doc", 2) == "relay"        # rank 1 continues every document both ways
    assert picks((0, 32768), "zigzag", 2) == "relay"          # one sequence: the middle rank needs M
    assert picks((0, 256), "zigzag", 2) == "gather"           # ... but 256 tokens of M cost less than a hop
    long = (0, 262144)
    assert picks(long, "contiguous", 4) == "relay"            # a chain of 3 x 64k tokens against maps over 64k
    assert picks(long, "contiguous", 8) == "gather"           # a chain of 7 x 32k: latency
    assert picks(docs, "contiguous", 2, "relay") == "relay"


def test_strategy_model_against_the_predicted_steps():
    """The cost model against what it was fitted to: the one-GPU predictions of every W = 2 to 64 case
    with both strategies (tests/fixtures/predict_h200x1.csv, simulate_w2_h200x1.csv). It must take the faster
    one, or one within 5%, in 73 of the 78 cases, and never lose more than 20%."""
    from tests.fixtures import frozen
    cases = {}
    for name in ("predict_h200x1.csv", "simulate_w2_h200x1.csv"):
        for r in frozen.rows(name):
            if not r["note"] and r["backend"] == "fla":
                key = tuple(r[c] for c in ("model", "tokens", "docs", "heads", "layout", "W"))
                cases.setdefault(key, {})[r["strategy"]] = float(r["pred_ms"])
    losses = []
    for (model, T, docs, H, layout, W), ms in cases.items():
        W = int(W)
        pick = exchange(build_plan(frozen.cu_seqlens(docs, int(T), pad=2 * W), layout, W, 0), int(H))
        losses.append(ms[pick] / min(ms.values()) - 1)
    assert len(losses) == 78
    assert sum(x <= 0.05 for x in losses) >= 73 and max(losses) < 0.20, sorted(losses)[-6:]


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


def test_cost_model_converts_many_documents_and_ranks_agree():
    """The decision reads only what every rank shares; with many documents it converts, and at the
    mixer level (d_model per token) sooner than at the op level (q, k, v, g, beta and o)."""
    hundred = docs_cu(100, 2)
    hidden = 4 * 2048 * 2                                       # four all-to-alls of bf16 d_model = 2048
    op = 2 * 64 * ((4 * 128 + 1) * 2 + 4)
    assert cost_model.relayout_pays(hundred, "zigzag_per_doc", 2, 64, 128, hidden, 4)
    assert cost_model.relayout_pays(hundred, "zigzag_per_doc", 2, 64, 128, op, 4)
    assert not cost_model.relayout_pays(hundred, "contiguous", 2, 64, 128, hidden, 4)
    assert not cost_model.relayout_pays(hundred, "zigzag_per_doc", 1, 64, 128, hidden, 4)
    single = (0, 32768)
    assert cost_model.relayout_pays(single, "zigzag_per_doc", 2, 64, 128, hidden / 3, 4 / 3)
    assert not cost_model.relayout_pays(single, "zigzag_per_doc", 2, 64, 128, op, 4)
    with mock.patch.dict("os.environ", {"KCP_CONVERT": "0"}):
        assert not cost_model.relayout_pays(hundred, "zigzag_per_doc", 2, 64, 128, hidden, 4)
    with mock.patch.dict("os.environ", {"KCP_CONVERT": "yes"}), pytest.raises(ValueError, match="use 1"):
        cost_model.relayout_pays(hundred, "zigzag_per_doc", 2, 64, 128, hidden, 4)


@pytest.mark.parametrize("cu,W", [(ONE_SEQ, 4), (MANY, 4), ((0, 256), 2)])
def test_nothing_costs_on_one_rank_or_without_a_move(cu, W):
    """One rank exchanges nothing and has no cut; a move to the layout one is in, or on one rank, gains 0."""
    for layout in LAYOUTS:
        assert cost_model.layout_cost(cu, layout, 1, 64, 128) == 0.0
        assert cost_model.cuts(cu, layout, 1) == 0 and cost_model.relay_chain(cu, layout, 1) == (0, 0)
        assert cost_model.relayout_net(cu, layout, W, 64, 128, OP, 4, target=layout) == 0.0
        assert cost_model.relayout_net(cu, layout, 1, 64, 128, OP, 4) == 0.0
        assert not cost_model.relayout_pays(cu, layout, 1, 64, 128, 0.0, 0, options=cost_model.Options())


@pytest.mark.parametrize("W", [2, 4, 8])
def test_one_sequence_on_the_contiguous_layout(W):
    """One sequence over W ranks in order: W - 1 cuts, a chain of W - 1 hops over every rank but the last's
    tokens; a transition map only from three ranks on (a middle rank's segment continues both ways)."""
    T = 1 << 16
    assert cost_model.cuts((0, T), "contiguous", W) == W - 1
    assert cost_model.relay_chain((0, T), "contiguous", W) == ((W - 1) * T // W, W - 1)
    assert cost_model.needs_maps((0, T), "contiguous", W) == (W > 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exchange_costs_grow_with_what_they_move(layout):
    """More tokens of one sequence cost each exchange at least as much; more heads (larger slots) cost the
    all-gather more and leave the relay's chain (priced at the measured heads) as it is."""
    for W in (2, 4):
        prev = (0.0, 0.0)
        for T in (1 << 12, 1 << 14, 1 << 16, 1 << 18):
            now = cost_model.costs((0, T), layout, W)
            assert now[0] >= prev[0] and now[1] >= prev[1], (layout, W, T, prev, now)
            prev = now
        few, many = cost_model.costs(MANY, layout, W, heads=16), cost_model.costs(MANY, layout, W, heads=64)
        assert many[0] == few[0] and many[1] > few[1]
        assert cost_model.layout_cost(MANY, layout, W, 64, 128) >= cost_model.layout_cost(MANY, layout, W, 16, 128)


def test_the_pick_is_the_cheaper_exchange():
    """Where maps are needed, the dispatch takes the cheaper of the two modelled costs (a tie: the relay)."""
    for cu in (ONE_SEQ, MANY, (0, 256), (0, 4096, 8192)):
        for layout in LAYOUTS:
            for W in (2, 4, 8):
                plan = build_plan(cu, layout, W, 0)
                pick = exchange(plan)
                if not cost_model.needs_maps(cu, layout, W):
                    assert pick == "gather"
                    continue
                r, g = cost_model.costs(cu, layout, W)
                assert pick == ("relay" if r <= g else "gather"), (cu, layout, W, r, g)


def test_layout_move_cost_is_monotone_and_its_limits():
    """A move costs more with more bytes and messages and less with a faster link; moving nothing from the
    per-document layout of many documents pays, moving without bound never does, and a core saving in the
    target makes it pay sooner."""
    base = cost_model.relayout_cost(MANY[-1], 4, OP, 4)
    assert cost_model.relayout_cost(MANY[-1], 4, 2 * OP, 4) > base
    assert cost_model.relayout_cost(MANY[-1], 4, OP, 8) > base
    assert cost_model.relayout_cost(MANY[-1], 4, OP, 4, bandwidth=2 * cost_model.RELAYOUT_BW) < base
    assert cost_model.relayout_cost(2 * MANY[-1], 4, OP, 4) > base
    none = cost_model.Options()
    assert cost_model.relayout_pays(MANY, "zigzag_per_doc", 4, 64, 128, 0.0, 0, options=none)
    assert not cost_model.relayout_pays(MANY, "zigzag_per_doc", 4, 64, 128, 1e12, 4, options=none)
    nets = [cost_model.relayout_net(MANY, "zigzag_per_doc", 4, 64, 128, OP, 4, core_saves=s) for s in (0, 1e-3, 1e-2)]
    assert nets[0] > nets[1] > nets[2] and nets[0] - nets[2] == pytest.approx(1e-2)


def test_core_saving_is_antisymmetric_and_linear():
    """Between equal cores nothing; the other way round the opposite; in proportion to the tokens and heads."""
    one = cost_model.core_saving("fla", "qla", 1000, 32, 128)
    assert one > 0 and cost_model.core_saving("qla", "fla", 1000, 32, 128) == -one
    assert cost_model.core_saving("fla", "fla", 1000, 32, 128) == 0
    assert cost_model.core_saving("fla", "qla", 4000, 32, 128) == pytest.approx(4 * one)
    assert cost_model.core_saving("fla", "qla", 1000, 64, 128) == pytest.approx(2 * one)


def test_head_groups_grow_with_the_chain(monkeypatch):
    """A longer chain never takes fewer head groups; a core whose passes do not shrink with the heads keeps one."""
    monkeypatch.delenv("KCP_RELAY_GROUPS", raising=False)
    depths = [cost_model.pipeline_depth(build_plan((0, T), "contiguous", 8, 0), 512, 512, 128)
              for T in (1 << 6, 1 << 8, 1 << 10, 1 << 12, 1 << 15, 1 << 21)]
    assert depths == sorted(depths) and depths[0] < depths[-1], depths
    assert cost_model.pipeline_depth(build_plan((0, 1 << 21), "contiguous", 8, 0), 512, 512, 128, None) == 1
