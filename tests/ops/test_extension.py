"""A new local core and a new exchange strategy are one file and one registration line each
(tests/ops/toy_core.py, tests/ops/toy_strategy.py): the dispatch picks them where their traits and costs make
them the pick and refuses the strategy elsewhere, the op runs them to the oracle's numbers on CP ranks, and
with them unregistered every pick of tests/ops/test_dispatch.py is today's again."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.kernels.registry import CORES
from megatron_kcp.ops import dispatch
from megatron_kcp.parallel.registry import EXCHANGES
from megatron_kcp.problem import Problem
from megatron_kcp.testing.cases import plan_for, random_inputs, shard
from megatron_kcp.testing.checks import TOL, compare_with_oracle, cp_group
from megatron_kcp.testing.distributed import spawn
from tests.ops import toy_core, toy_strategy
from tests.ops.test_dispatch import AUTO, OVERRIDES, decided


def test_toy_core_is_picked_where_it_runs_and_is_worth_it(monkeypatch):
    """Ranked above the reference, it runs GDN on the CPU where a rank holds at least MIN_SHARE tokens; the
    reference keeps KDA and the short shares, fla's kernels the GPU."""
    gdn = ("gdn", 2, "contiguous", 10, 32768, 32, "cpu")
    with CORES.registered(toy_core.ENTRY):
        assert decided(monkeypatch, *gdn) == ("toy", "gather", 0, "")
        assert decided(monkeypatch, "gdn", 4, "contiguous", 1, 131072, 32, "cpu") == ("toy", "relay", 0, "")
        assert decided(monkeypatch, "gdn", 2, "zigzag_per_doc", 100, 32768, 32, "cpu") == ("toy", "cp2hp", 0, "")
        assert decided(monkeypatch, "kda", *gdn[1:]) == ("reference", "gather", 0, "")
        assert decided(monkeypatch, "gdn", 2, "contiguous", 1, 2 * (toy_core.MIN_SHARE - 4), 2, "cpu") == \
            ("reference", "gather", 0, "")
        assert decided(monkeypatch, *gdn[:-1], "hopper") == ("fla", "gather", 0, "")
        assert decided(monkeypatch, *gdn, backend="toy") == ("toy", "gather", 0, "")
        assert decided(monkeypatch, *gdn, backend="flash") == "error: unknown KCP backend 'flash': choose one of " \
            "('auto', 'reference', 'toy', 'fla', 'qla')"           # the registered cores, by priority
    assert decided(monkeypatch, *gdn) == ("reference", "gather", 0, "")
    assert decided(monkeypatch, *gdn, backend="toy") == "error: unknown KCP backend 'toy': choose one of " \
        "('auto', 'reference', 'fla', 'qla')"


def test_toy_strategy_is_picked_where_applicable_and_cheapest_and_refused_elsewhere(monkeypatch):
    """On the contiguous layout of more than one rank it undercuts the relay (a tenth cheaper) and, where it is
    cheaper than the all-gather too, is the pick, on any core; where the all-gather is cheaper (a long chain of 8
    ranks), the all-gather stays. Named where it does not apply, its refusal is the error."""
    with EXCHANGES.registered(toy_strategy.TOY):
        assert decided(monkeypatch, "gdn", 2, "contiguous", 10, 32768, 32, "cpu") == \
            ("reference", "toy-relay", 0, "")
        assert decided(monkeypatch, "gdn", 4, "contiguous", 1, 131072, 32, "hopper") == ("fla", "toy-relay", 0, "")
        assert decided(monkeypatch, "gdn", 8, "contiguous", 1, 262144, 32, "cpu") == ("reference", "gather", 0, "")
        assert decided(monkeypatch, "gdn", 2, "zigzag", 1, 32768, 32, "cpu") == ("reference", "relay", 0, "")
        assert decided(monkeypatch, "gdn", 2, "contiguous", 10, 32768, 32, "cpu", strategy="toy-relay") == \
            ("reference", "toy-relay", 0, "")
        for where, args in ((("gdn", 2, "zigzag", 1, 32768, 32, "cpu"), {}),
                            (("gdn", 1, "contiguous", 10, 32768, 32, "cpu"), {}),
                            (("gdn", 2, "contiguous", 10, 32768, 32, "cpu"), {"max_segment": 1024})):
            assert decided(monkeypatch, *where, strategy="toy-relay", **args) == f"error: {toy_strategy.REFUSAL}"
        assert decided(monkeypatch, "gdn", 2, "contiguous", 10, 32768, 32, "cpu", strategy="ring").endswith(
            "choose one of ('auto', 'relay', 'gather', 'cp2hp', 'convert', 'fla-cp', 'toy-relay')")
    assert decided(monkeypatch, "gdn", 2, "contiguous", 10, 32768, 32, "cpu") == ("reference", "gather", 0, "")
    assert decided(monkeypatch, "gdn", 2, "contiguous", 10, 32768, 32, "cpu", strategy="toy-relay").startswith(
        "error: unknown KCP exchange strategy 'toy-relay'")


def test_unregistered_toys_leave_todays_picks(monkeypatch):
    """With both registered some recorded picks move (the check is not vacuous); unregistered, every recorded
    pick and error of tests/ops/test_dispatch.py is today's, the dispatch's cache of decisions included."""
    cases = [(case[:-1], {}, case[-1]) for case in AUTO] + [(case[:-2], case[-2], case[-1]) for case in OVERRIDES]
    with CORES.registered(toy_core.ENTRY), EXCHANGES.registered(toy_strategy.TOY):
        moved = sum(decided(monkeypatch, *problem, **overrides) != pick for problem, overrides, pick in cases)
    assert moved >= 10, moved
    assert "toy" not in CORES and "toy-relay" not in EXCHANGES
    for problem, overrides, pick in cases:
        assert decided(monkeypatch, *problem, **overrides) == pick, (problem, overrides)


def test_a_change_of_the_registries_forgets_the_cached_decisions():
    """The dispatch caches a decision per problem; registering, swapping or removing an entry forgets them."""
    p = Problem(plan_for((0, 32768), "contiguous", 2, 0), torch.device("cpu"), torch.float32, False, (128, 128),
                32, 32)
    assert dispatch.decide_problem(p) == dispatch.Dispatch("reference", "gather", 0)
    with CORES.registered(toy_core.ENTRY):
        assert dispatch.decide_problem(p) == dispatch.Dispatch("toy", "gather", 0)
        with EXCHANGES.registered(toy_strategy.TOY):
            assert dispatch.decide_problem(p) == dispatch.Dispatch("toy", "toy-relay", 0)
    assert dispatch.decide_problem(p) == dispatch.Dispatch("reference", "gather", 0)


def test_registering_a_taken_or_reserved_name_is_refused():
    with pytest.raises(ValueError, match="a local core named 'reference' is registered already"):
        CORES.register(CORES["reference"])
    with pytest.raises(ValueError, match="an exchange strategy named 'auto' is registered already"):
        EXCHANGES.register(type("Auto", (toy_strategy.ToyRelay,), {"name": "auto"})())
    with pytest.raises(KeyError, match="no exchange strategy named 'toy-relay': registered are ") as e:
        EXCHANGES["toy-relay"]
    assert sorted(str(e.value).strip("'\"").split("registered are ")[1].split(", ")) == sorted(EXCHANGES.names())


def _toys_run_to_the_oracle():
    group = cp_group()
    W, r = dist.get_world_size(group), dist.get_rank(group)
    cu = (0, 200, 2 * toy_core.MIN_SHARE * W - 100, 2 * toy_core.MIN_SHARE * W)
    xs = random_inputs(torch.Generator().manual_seed(3), cu[-1], len(cu) - 1, 2, 4, 8, 6, False)
    with CORES.registered(toy_core.ENTRY), EXCHANGES.registered(toy_strategy.TOY):
        plan = plan_for(cu, "contiguous", W, r)
        q, k, v, g = shard(plan, *xs[:4])
        for h0 in (None, xs[5]):
            assert dispatch.decide(plan, q, v, g, initial_state=h0) == dispatch.Dispatch("toy", "toy-relay", 0)
        for backend, strategy in (("auto", "auto"), ("toy", "toy-relay")):
            toy_core.BUILT.clear()
            errs = compare_with_oracle(cu, xs[:5], xs[5], "contiguous", strategy, True, group, seed=W,
                                       backend=backend)
            assert toy_core.BUILT == [("cpu", False, (8, 6))], toy_core.BUILT
            assert max(errs.values()) <= TOL, (backend, strategy, errs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_toys_run_to_the_oracles_numbers(world_size):
    """The op with the toy core and the toy strategy picked (and named): the output, every input gradient and
    the initial state's gradient match the fp64 oracle to 1e-5, as the reference core under the relay does."""
    spawn(_toys_run_to_the_oracle, world_size)
