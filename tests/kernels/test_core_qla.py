"""CPU: the qla core's logic over flash-qla's kernel contracts (``megatron_kcp/testing/qla_contracts.py``),
and which core and strategy ``dispatch.decide`` picks.

The qla core runs a pass only over the segments whose state (gradient) leaves, feeds the fused
kernels each segment's initial state and final-state gradient, and reduces grouped heads: on CPU
ranks against the oracle, every layout, both strategies it runs, with user initial states, and on
the long-memory batch with the exchange switched off (which must miss). The real kernels are
checked against the same oracle on the GPU (tests/ops/test_kcp_cuda.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_kcp import environment
from megatron_kcp.kernels import core_fla, core_qla
from megatron_kcp.ops import dispatch
from megatron_kcp.plan import LAYOUTS, build_plan, split_segments
from megatron_kcp.testing.distributed import spawn
from megatron_kcp.testing.cases import long_memory_cu, long_memory_inputs, random_cu_seqlens, random_inputs
from megatron_kcp.testing.checks import TOL, compare_with_oracle, cp_group, exchange_off

CU = (0, 1024)


def _qkvg(dtype=torch.bfloat16, K=128, kda=False):
    q = torch.zeros(1, 512, 2, K, dtype=dtype)
    v = torch.zeros(1, 512, 2, K, dtype=dtype)
    g = torch.zeros(1, 512, 2, *((K,) if kda else ()))
    return q, v, g


def pick(plan, backend, strategy="auto", max_segment=None):
    q, v, g = _qkvg()
    d = dispatch.decide(plan, q, v, g, backend, strategy, max_segment)
    return d.core, d.strategy, d.max_segment


def test_decide_picks_the_reference_on_cpu_and_the_relay_where_qla_needs_maps():
    zig, con = build_plan(CU, "zigzag", 2, 1, 4), build_plan(CU, "contiguous", 2, 1, 4)
    assert pick(zig, "auto") == ("reference", "relay", 0)
    # zigzag's middle pieces continue their sequence both ways: the all-gather would need (fla's) maps
    assert pick(zig, "qla", max_segment=0) == ("qla", "relay", 0)
    assert pick(zig, "qla", "relay") == ("qla", "relay", 0)
    assert pick(zig, "qla", "gather", 0) == ("qla", "gather", 0)
    assert pick(con, "qla", max_segment=0) == ("qla", "gather", 0)    # no maps needed
    assert pick(zig, "fla", "gather") == ("fla", "gather", 0)
    # split where asked (the pick splits only where the work is large: below)
    assert pick(zig, "qla", max_segment=64) == ("qla", "gather", 64)
    assert pick(zig, "qla") == ("qla", "relay", 0)
    assert pick(zig, "auto", max_segment=128) == ("reference", "gather", 128)
    with pytest.raises(ValueError, match="strategy='gather'"):
        pick(zig, "qla", "relay", 128)
    with pytest.raises(ValueError, match="unknown KCP backend"):
        pick(zig, "flashqla")


@pytest.mark.parametrize("layout,W,cu,cut", [
    ("zigzag", 4, (0, 65536), 8192), ("zigzag_per_doc", 8, (0, 131072), 8192), ("zigzag", 3, (0, 61440), 10240),
    ("zigzag_per_doc", 16, (0, 131072), 0), ("zigzag", 4, (0, 32768), 0), ("zigzag", 2, (0, 65536), 0),
    ("contiguous", 4, (0, 65536), 0), ("zigzag_per_doc", 4, (0, 65536, 131072), 0)])
def test_fla_cuts_the_zigzag_middle_rank_segment_of_one_sequence(layout, W, cu, cut):
    """fla's core under the all-gather on one zigzag sequence from W = 3 (``core_fla.fla_max_segment``): every
    rank picks the chunk length, which cuts the middle rank's double segment in two at its pieces' edge and
    no other; no rank exports more states. Not on chunks under 8192 tokens (128k over 16 ranks, 32k over 4:
    a rank's step bound by its launches), at W = 2 (the middle rank's exports would double), on the
    contiguous layout, with documents, for the relay and where the caller says 0."""
    plans = [build_plan(cu, layout, W, r, 4) for r in range(W)]
    assert [core_fla.fla_max_segment(p) for p in plans] == [cut] * W
    assert pick(plans[0], "fla", "gather") == ("fla", "gather", cut)
    assert pick(plans[0], "fla", "relay") == ("fla", "relay", 0)
    assert pick(plans[0], "fla", "gather", 0) == ("fla", "gather", 0)
    assert pick(plans[0], "auto", "gather") == ("reference", "gather", 0)
    if cut:
        split = [split_segments(p, cut) for p in plans]
        assert [p.num_segments for p in split] == [p.num_segments for p in plans[:-1]] + [2]
        assert split[-1].cu_seqlens == (0, cut, 2 * cut) and plans[-1].cu_seqlens == (0, 2 * cut)
        assert (split[0].num_slots_fwd, split[0].num_slots_bwd) == (plans[0].num_slots_fwd, plans[0].num_slots_bwd)


@pytest.mark.parametrize("docs,layout,tokens,W,heads,cut", [
    ("single", "contiguous", 32768, 1, 16, 4096), ("single", "contiguous", 65536, 2, 16, 4096),
    ("single", "zigzag", 65536, 2, 16, 4096), ("single", "zigzag_per_doc", 65536, 2, 16, 4096),
    ("single", "contiguous", 32768, 2, 16, 2048), ("single", "zigzag", 32768, 2, 16, 2048),
    ("single", "zigzag", 49152, 2, 16, 3072), ("single", "zigzag", 32768, 4, 32, 2048),
    ("single", "zigzag", 131072, 8, 16, 4096), ("single", "zigzag", 131072, 16, 32, 4096),
    ("single", "contiguous", 32768, 4, 16, 0), ("single", "contiguous", 32768, 8, 64, 0),
    ("single", "contiguous", 32768, 1, 64, 16384),
    ("single", "zigzag_per_doc", 32768, 2, 32, 4096), ("single", "zigzag_per_doc", 32768, 2, 64, 8192),
    ("varlen", "contiguous", 65536, 2, 16, 4096), ("varlen", "contiguous", 65536, 2, 32, 0),
    ("varlen", "contiguous", 65536, 2, 64, 0), ("varlen100", "zigzag_per_doc", 65536, 2, 16, 0)])
def test_qla_splits_one_long_segment_a_rank_at_few_heads(docs, layout, tokens, W, heads, cut):
    """The one-H200 crossovers (``core_qla.qla_max_segment``): a rank with fewer than 80 scans (heads x
    chains; one 16k segment at 16, 32 or 64 heads) has its segments split into parts that give it 128
    (ten documents at 16 heads too: the longest is most of a rank), at least 4096 tokens long unless the
    sequence then holds at most 32 parts (32k or 48k tokens; not 128k over 8 or 16 ranks); 8k a rank,
    or segments of 4096, are bound by the host's launches, and many documents, or ten at 32 heads
    (about 95 scans) or 64, give qla enough scans for the split's extra passes not to pay."""
    from benchmarks.catalogue import cu_seqlens
    plan = build_plan(cu_seqlens(docs, tokens, pad=2 * W), layout, W, 0, 4)
    assert core_qla.qla_max_segment(plan, heads) == cut


@pytest.mark.parametrize("docs,layout,heads,worth", [
    ("single", "contiguous", 16, False), ("single", "zigzag", 16, False), ("single", "zigzag_per_doc", 16, False),
    ("varlen", "contiguous", 16, True), ("varlen", "zigzag", 16, True), ("varlen", "zigzag_per_doc", 16, True),
    ("single", "contiguous", 64, True), ("single", "zigzag", 64, True), ("varlen", "zigzag_per_doc", 64, True),
    ("varlen100", "zigzag", 64, True), ("varlen100", "zigzag_per_doc", 64, False)])
def test_auto_takes_qla_where_it_measured_faster(docs, layout, heads, worth):
    """The crossovers of the 2 x H200 runs (benchmarks/reports/): one long segment a rank at 16 heads leaves qla's
    scans latency-bound; documents or 64 heads do not; 200 interleaved segments a rank cost its covering passes."""
    from benchmarks.catalogue import cu_seqlens
    plan = build_plan(cu_seqlens(docs, 32768, pad=4), layout, 2, 0, 4)
    assert core_qla.qla_worth(plan, heads) is worth


@pytest.mark.parametrize("case,match", [
    (dict(kda=True), "GDN only"), (dict(dtype=torch.float32), "bf16 or fp16"), (dict(K=64), "K = V = 128"),
    (dict(), "CUDA GPU")])
def test_qla_refuses_what_it_cannot_run(case, match):
    q, v, g = _qkvg(**case)
    with pytest.raises((ValueError, RuntimeError), match=match):
        environment.check_qla(q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]))
    assert not environment.qla_runs(q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]))


def _qla_cases(layouts, kinds=("random", "single", "edges", "tiny"), piece=None):
    from megatron_kcp.testing import qla_contracts
    qla_contracts.install()
    group = cp_group()
    W = dist.get_world_size(group)
    for layout in layouts:
        for seed, kind in enumerate(kinds):
            gen = torch.Generator().manual_seed(seed)
            cu = random_cu_seqlens(gen, layout, W, kind)
            xs = random_inputs(gen, cu[-1], len(cu) - 1, 2, 4, 8, 6, False)   # grouped heads: HV = 2H
            for strategy, cut in (("auto", None), ("relay", None), ("gather", 0), ("auto", 16)):
                for init in (None, xs[5]):
                    errs = compare_with_oracle(cu, xs[:5], init, layout, strategy, seed % 2 == 0, group, seed,
                                               "qla", cut)
                    bad = {k: v for k, v in errs.items() if not v <= TOL}
                    assert not bad, f"qla {layout} {kind} {strategy} cut={cut} init={init is not None} cu={cu}: {bad}"
        gen = torch.Generator().manual_seed(7 + W)
        cu = long_memory_cu(gen, W, piece=piece or (48 if layout == "zigzag_per_doc" else 140))
        xs = long_memory_inputs(gen, cu, 2, 2, 16, 8, False)
        errs = compare_with_oracle(cu, xs, None, layout, "auto", True, group, W, backend="qla")
        assert max(errs.values()) <= TOL, f"qla {layout} long memory: {errs}"
        restore = exchange_off()
        try:
            off = compare_with_oracle(cu, xs, None, layout, "relay", True, group, W, backend="qla")
        finally:
            restore()
        weak = {k: v for k, v in off.items() if not v >= 10 * TOL}
        assert not weak, f"qla {layout} W={W}: without the exchange these still match: {weak}"


def _poisoned(*args):
    """``_qla_cases`` with every tensor that is allocated and not written NaN (torch's deterministic
    mode fills them): a pass that reads a state row nobody zeroed or wrote shows."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    _qla_cases(*args)


def test_qla_core_matches_oracle_quick():
    """The default tier's: W = 2, every layout, random cuts and the long-memory batch with its control,
    unwritten memory NaN."""
    spawn(_poisoned, 2, LAYOUTS, ("random",), 8)


def _zero_states_passed_as_none():
    """Each rank's fused kernels on many documents in the contiguous layout (one crosses the edge): the
    initial states go to the forward's kernels only where one arrives (rank 1), the final-state
    gradients to the backward's only where one leaves (rank 0); the rest is None."""
    from unittest import mock

    from megatron_kcp.kernels import core_qla

    from megatron_kcp.ops import kcp
    from megatron_kcp.testing import qla_contracts
    from megatron_kcp.testing.cases import docs_cu, plan_for, shard
    qla_contracts.install()
    group, r = cp_group(), dist.get_rank(cp_group())
    cu = docs_cu(20, 2, seed=3)
    xs = random_inputs(torch.Generator().manual_seed(0), cu[-1], len(cu) - 1, 2, 4, 8, 6, False)[:5]
    plan = plan_for(cu, "contiguous", 2, r)
    K = qla_contracts.kernels()
    spies = {n: mock.Mock(side_effect=getattr(K, n)) for n in ("fused_gdr_fwd", "fused_gdr_h", "fused_gdr_bwd")}
    vars(K).update(spies)
    with mock.patch.object(core_qla, "_kernels", lambda: K):
        ys = [x.detach().requires_grad_() for x in shard(plan, *xs)]
        kcp.gated_delta_rule(*ys, plan, group, use_qk_l2norm=True, backend="qla", strategy="gather",
                             max_segment=0).sum().backward()
    states = [c.kwargs["initial_state"] for n in ("fused_gdr_fwd", "fused_gdr_h") for c in spies[n].call_args_list
              if c.kwargs.get("output_h", False) or n == "fused_gdr_fwd"]
    (grads,) = [c.kwargs["dht"] for c in spies["fused_gdr_bwd"].call_args_list]
    assert plan.num_segments > 5 and len(states) == 2, (plan.num_segments, len(states))
    assert all((s is None) == (r == 0) for s in states), [s is None for s in states]
    assert (grads is None) == (r == 1)


def test_zero_states_reach_the_kernels_as_none():
    spawn(_zero_states_passed_as_none, 2)


def _head_shards_call_flash_qla():
    """cp2hp on the qla core: flash-qla's own call, once a step, on the whole stream of this rank's
    head shards; forward and every gradient equal the oracle."""
    from unittest import mock

    from megatron_kcp.kernels import core_qla
    from megatron_kcp.testing import qla_contracts
    from megatron_kcp.testing.cases import docs_cu
    qla_contracts.install()
    group = cp_group()
    cu = docs_cu(30, 2, seed=1)
    xs = random_inputs(torch.Generator().manual_seed(2), cu[-1], len(cu) - 1, 2, 4, 8, 6, False)[:5]
    K = qla_contracts.kernels()
    spy = K.chunk_gated_delta_rule = mock.Mock(side_effect=qla_contracts.chunk_gated_delta_rule)
    with mock.patch.object(core_qla, "_kernels", lambda: K):
        errs = compare_with_oracle(cu, xs, None, "zigzag_per_doc", "cp2hp", True, group, 3, "qla")
    assert max(errs.values()) <= TOL, errs
    (call,) = spy.call_args_list
    assert call.args[0].shape[1:3] == (cu[-1], 1), call.args[0].shape       # the whole stream, H / W heads
    assert call.kwargs["cu_seqlens"].tolist() == list(cu)


def test_head_shards_on_the_qla_core_call_flash_qla():
    spawn(_head_shards_call_flash_qla, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_qla_core_matches_oracle(world_size):
    spawn(_qla_cases, world_size, LAYOUTS)


def _start_passes():
    """Each rank's forward state passes (``core.state`` calls) on one split sequence, with the start
    through the maps pass and without; the results must agree."""
    from unittest import mock

    from megatron_kcp.ops import kcp
    from megatron_kcp.kernels.core_qla import GDNQLACore
    from megatron_kcp.parallel.exchanges import EXCHANGES
    from megatron_kcp.parallel.gather import AllGather
    from megatron_kcp.testing import qla_contracts
    from megatron_kcp.testing.cases import plan_for, shard

    class OwnStarts(AllGather):                 # every sequence start its own state pass
        def _through_maps(self, core, P, done, middle):
            return []
    qla_contracts.install()
    group = cp_group()
    cu = (0, 512)
    xs = random_inputs(torch.Generator().manual_seed(0), cu[-1], 1, 2, 4, 8, 6, False)[:5]
    plan = plan_for(cu, "contiguous", 2, dist.get_rank(group))
    runs = {}
    for ride in (True, False):
        swap = () if ride else (OwnStarts(),)
        with EXCHANGES.swapped(*swap), \
                mock.patch.object(GDNQLACore, "state", autospec=True, side_effect=GDNQLACore.state) as spy:
            o = kcp.gated_delta_rule(*shard(plan, *xs), plan, group, use_qk_l2norm=True, backend="qla",
                                     strategy="gather", max_segment=64)
        runs[ride] = (spy.call_count, o)
    # rank 0's first part starts the sequence; its other parts continue it both ways, so a maps pass runs
    assert runs[True][0] == 0, runs[True][0]
    assert runs[False][0] == (1 if dist.get_rank(group) == 0 else 0), runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-6, atol=1e-6)


def test_sequence_start_rides_the_maps_pass():
    """On the fused core a sequence start from a zero state exports through the maps pass that its
    rank runs anyway: no state pass of its own (``AllGather._through_maps``), the same output."""
    spawn(_start_passes, 2)
