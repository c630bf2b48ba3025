"""fla's own CP call as the op's step (``strategy="fla-cp"``): what it runs and what it refuses, with the
fix, before any kernel. Its numbers are fla's: the GPU CP suite compares it with one GPU
(``tests/ops/test_kcp_cuda.py``); fla's kernels do not run on the CPU."""
from __future__ import annotations

import pytest
import torch

from benchmarks.common import cu_seqlens
from megatron_kcp.ops import dispatch
from megatron_kcp.parallel.fla_cp import FlaCP
from megatron_kcp.parallel.plan import all_plans

CUDA = torch.device("cuda")          # only decided on: nothing runs


def _decide(W, device=CUDA, backend="auto", max_segment=None, strategy="fla-cp"):
    plan = all_plans(cu_seqlens("varlen100", 32768, pad=2 * W), "contiguous", W)[0]
    dispatch._decide.cache_clear()
    return dispatch._decide(plan, device, torch.bfloat16, True, (128, 128), 32, 32, backend, strategy, max_segment,
                            (None, None), True)


def test_fla_cp_runs_fla_kernels_whole_and_only_where_asked():
    assert _decide(2) == dispatch.Dispatch("fla", "fla-cp", 0)
    assert _decide(4, backend="fla") == dispatch.Dispatch("fla", "fla-cp", 0)
    assert _decide(1).strategy == "none"                      # one rank: nothing to exchange
    assert _decide(2, strategy="auto").strategy != "fla-cp"
    assert "fla's own CP call" in _decide(2).describe()


def test_fla_cp_refuses_what_it_cannot_run_and_names_the_fix():
    with pytest.raises(ValueError, match="backend 'auto' or 'fla'"):
        _decide(2, backend="reference")
    with pytest.raises(ValueError, match="on CUDA"):
        _decide(2, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="no max_segment"):
        _decide(2, max_segment=1024)
    plan = all_plans(cu_seqlens("varlen100", 32768, pad=4), "contiguous", 2)[0]
    q = v = torch.zeros(1, plan.num_local_tokens, 2, 16)
    FlaCP().check(q, v, plan, None)
    with pytest.raises(ValueError, match="runs the contiguous layout"):
        FlaCP().check(q, v, all_plans(plan.global_cu_seqlens, "zigzag_per_doc", 2)[0], None)
    with pytest.raises(ValueError, match="no initial_state"):
        FlaCP().check(q, v, plan, torch.zeros(plan.num_seqs, 2, 16, 16))
    from megatron_kcp.parallel import fla_cp
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fla_cp, "capturing", lambda: True)
        with pytest.raises(ValueError, match="CUDA graph capture"):
            FlaCP().check(q, v, plan, None)


def test_fla_cp_hands_fla_the_plans_stream_and_the_ops_arguments(monkeypatch):
    """What the strategy passes fla (its kernels stood in): the CP context of the plan's global stream
    in the contiguous layout over the op's group, built once per plan; the call with that context, the
    op's scale and l2norm, the gate in fp32, and nothing fla's CP call refuses (initial state, final
    state, a cu_seqlens of its own)."""
    import fla.ops.cp
    import fla.ops.kda

    from megatron_kcp.ops.core_fla import KDACore
    from megatron_kcp.parallel import fla_cp
    built, calls = [], []

    def build_cp_context(cu, group, cu_seqlens_cpu, layout):
        built.append((cu.tolist(), group, cu_seqlens_cpu.tolist(), layout))
        return "context"

    def chunk_kda(q, k, v, g, beta, **kw):
        calls.append((g.dtype, kw))
        return v * 2, None
    monkeypatch.setattr(fla.ops.cp, "build_cp_context", build_cp_context)
    monkeypatch.setattr(fla.ops.kda, "chunk_kda", chunk_kda)
    fla_cp.context.cache_clear()
    plan = all_plans(cu_seqlens("varlen", 4096, pad=4), "contiguous", 2)[1]
    T = plan.num_local_tokens
    q, k = torch.randn(1, T, 2, 8), torch.randn(1, T, 2, 8)
    v, g, beta = torch.randn(1, T, 2, 8), torch.randn(1, T, 2, 8, dtype=torch.bfloat16), torch.rand(1, T, 2)
    for _ in range(2):
        o = FlaCP().apply(KDACore(), q, k, v, g, beta, plan, "group", scale=0.25, initial_state=None,
                          use_qk_l2norm=True)
    assert torch.equal(o, v * 2)
    cu = list(plan.global_cu_seqlens)
    assert built == [(cu, "group", cu, "contiguous")]
    assert calls[0] == (torch.float32, dict(output_final_state=False, scale=0.25, use_qk_l2norm_in_kernel=True,
                                            cp_context="context"))
    fla_cp.context.cache_clear()
