"""The all-gather's fold on fla's merge kernel equals the PyTorch fold on every plan's chains, forward
and backward (the kernel run by Triton's interpreter on the CPU: a process of its own, since the
interpreter is chosen when Triton compiles, at import)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import torch
    from fla.ops.cp.chunk_merge import chunk_cp_fwd_bwd_kernel_merge
    from megatron_kcp.parallel import gather
    from megatron_kcp.plan import build_plan

    # one config: the interpreter has no benchmarker for the autotuner
    tuner = chunk_cp_fwd_bwd_kernel_merge.fn
    tuner.configs = [c for c in tuner.configs if c.num_stages == 2 and c.kwargs["BV"] == 32][:1]
    torch.manual_seed(0)
    W, HV = 4, 2
    cases = [("zigzag", (0, 4096), 64, 16, 16), ("zigzag_per_doc", (0, 96, 160, 512), 0, 16, 16),
             ("contiguous", (0, 64, 600, 1024), 64, 16, 16), ("zigzag", (0, 512), 0, 16, 16),
             ("zigzag", (0, 1024), 64, 16, 48)]            # K != V, V not a multiple of the value block
    longest = 0
    for layout, cu, part, K, V in cases:
        for r in range(W):
            plan = build_plan(cu, layout, W, r, max_segment=part)
            for chains, slots in ((plan.recv_fwd, plan.num_slots_fwd), (plan.recv_bwd, plan.num_slots_bwd)):
                if not chains:
                    continue
                g = torch.randn(W, slots, HV, K, V + K) * 0.3
                want = torch.full((plan.num_segments, HV, K, V), float("nan"))
                got = want.clone()
                gather.fold_reference(g, chains, want)
                gather.fold_merge(g, chains, got)
                folded = sorted(c.segment for c in chains)
                assert torch.isnan(got).any(dim=(1, 2, 3)).nonzero().flatten().tolist() == sorted(
                    set(range(plan.num_segments)) - set(folded)), (layout, r)
                err = ((got - want)[folded].abs().max() / want[folded].abs().max()).item()
                assert err < 1e-5, (layout, cu, r, err)
                longest = max(longest, max(len(c.sources) for c in chains))
    print("longest chain", longest)
""")


@pytest.mark.slow      # Triton's interpreter on the CPU; the GPU suite ops_w1 runs the kernel itself
def test_fold_on_flas_merge_kernel_equals_the_pytorch_fold():
    pytest.importorskip("fla")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "longest chain 63" in run.stdout       # 4096 tokens in parts of 64: the chain over every part


@pytest.mark.gpu
@pytest.mark.parametrize("HV", [16, 64])
def test_fold_on_the_gpu_equals_the_fp64_fold(HV):
    """The merge kernel (TF32x3 products) and the PyTorch fold (fp32) against the fold in fp64, on maps
    of the real size (K = V = 128) and a chain of 64 parts (1M tokens at W = 8 in parts of 16384),
    contractive as a gated delta rule's are: the kernel's error is TF32x3's, under 2e-5 of the state
    (fp32's is about 1e-6), two orders and more below what the steps' tests tolerate in fp32 and bf16."""
    import torch

    from megatron_kcp.parallel import gather
    from megatron_kcp.plan import build_plan
    torch.manual_seed(0)
    W, K = 8, 128
    for r in (0, 3, 7):
        plan = build_plan((0, 1 << 20), "zigzag", W, r, max_segment=1 << 14)
        for chains, slots in ((plan.recv_fwd, plan.num_slots_fwd), (plan.recv_bwd, plan.num_slots_bwd)):
            if not chains:
                continue
            g = torch.randn(W, slots, HV, K, 2 * K, dtype=torch.float64, device="cuda")
            g[..., K:] = torch.linalg.qr(g[..., K:])[0] * 0.99     # M: a contraction, as exp(g) (I - beta k k^T)
            outs = [torch.zeros(plan.num_segments, HV, K, K, dtype=torch.float64, device="cuda")]
            gather.fold_reference(g, chains, outs[0])
            for fold in (gather.fold_reference, gather.fold_merge):
                outs.append(torch.zeros(plan.num_segments, HV, K, K, device="cuda"))
                fold(g.float(), chains, outs[-1])
            segs = [c.segment for c in chains]
            exact, ref, merge = (o[segs].double() for o in outs)
            err_ref, err_merge = ((o - exact).abs().max().item() / exact.abs().max().item() for o in (ref, merge))
            print(f"fold W={W} rank {r} HV={HV}, {max(len(c.sources) for c in chains)} steps: relative error "
                  f"fp32 {err_ref:.1e}, merge kernel {err_merge:.1e}")
            assert err_merge < 2e-5, (r, err_ref, err_merge)


def test_fold_of_one_source_chains_takes_the_sources_state():
    """Where every chain has one source (the contiguous layout at W = 2), ``fold`` copies each source's H
    without the merge kernel: equal to the PyTorch fold, and no other row is written."""
    import torch

    from megatron_kcp.parallel import gather
    from megatron_kcp.plan import build_plan
    from megatron_kcp.testing.cases import docs_cu
    torch.manual_seed(0)
    seen = 0
    for r in range(2):
        plan = build_plan(docs_cu(30, 2, seed=1), "contiguous", 2, r)
        for chains, slots in ((plan.recv_fwd, plan.num_slots_fwd), (plan.recv_bwd, plan.num_slots_bwd)):
            if not chains:
                continue
            assert all(len(c.sources) == 1 for c in chains)
            g = torch.randn(2, slots, 2, 4, 4 + 4)
            want = torch.full((plan.num_segments, 2, 4, 4), float("nan"))
            got = want.clone()
            gather.fold_reference(g, chains, want)
            gather.fold(g, chains, got)
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
            seen += 1
    assert seen == 2                     # rank 1's forward, rank 0's backward
