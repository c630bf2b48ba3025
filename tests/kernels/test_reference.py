"""The chunked reference equals the token-by-token recurrence, and KCP at CP=1 equals both."""
from __future__ import annotations

import pytest
import torch

from megatron_kcp.ops import kcp
from megatron_kcp.kernels import reference as R
from megatron_kcp.plan import build_plan
from megatron_kcp.testing.distributed import rel_err
from megatron_kcp.testing.cases import random_inputs


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("l2,gva", [(False, False), (True, True)])
def test_chunk_equals_naive(kda, l2, gva):
    gen = torch.Generator().manual_seed(7 + kda)
    cu = (0, 5, 70, 200)
    xs = [x.double().requires_grad_() for x in random_inputs(gen, 200, 3, 2, 4 if gva else 2, 16, 8, kda)]
    do = torch.randn(1, 200, xs[2].shape[2], 8, generator=gen, dtype=torch.float64)
    dht = torch.randn(3, *xs[5].shape[1:], generator=gen, dtype=torch.float64)
    outs = []
    for fn in (R.recurrent_gated_delta_rule_fp64, R.chunk_gated_delta_rule_fp64):
        o, ht = fn(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm=l2,
                   cu_seqlens=torch.tensor(cu))
        outs.append([o, ht, *torch.autograd.grad((o, ht), xs, (do, dht))])
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-10


def test_batched_equals_varlen():
    gen = torch.Generator().manual_seed(3)
    xs = random_inputs(gen, 2 * 70, 2, 2, 2, 8, 8, kda=True)
    o_var, _ = R.chunk_gated_delta_rule_fp64(*xs[:5], initial_state=xs[5], cu_seqlens=torch.tensor([0, 70, 140]))
    batched = [x.view(2, 70, *x.shape[2:]) for x in xs[:5]]
    o_b, _ = R.chunk_gated_delta_rule_fp64(*batched, initial_state=xs[5])
    assert rel_err(o_b.reshape(o_var.shape), o_var) < 1e-6


def test_affine_state_map():
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, h0 = random_inputs(gen, 130, 1, 2, 2, 16, 8, kda=True, dtype=torch.float64)
    hm = R.affine_state_map(k, g, beta, v)
    _, ht = R.chunk_gated_delta_rule_fp64(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(hm[..., 8:] @ h0[0] + hm[..., :8], ht[0]) < 1e-10


@pytest.mark.parametrize("kda", [False, True])
def test_cp1_equals_reference(kda):
    """World size 1 runs the same KCP machinery (no exchange) and equals the plain reference."""
    gen = torch.Generator().manual_seed(11)
    cu = (0, 3, 90, 96)
    xs = [x.requires_grad_() for x in random_inputs(gen, 96, 3, 2, 2, 8, 8, kda=kda)]
    plan = build_plan(cu, "contiguous", 1, 0, 4)
    o = kcp.gated_delta_rule(*xs[:5], plan, initial_state=xs[5], backend="reference")
    o_ref, _ = R.chunk_gated_delta_rule_fp64(*xs[:5], initial_state=xs[5], cu_seqlens=torch.tensor(cu))
    do = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad(o, xs, do), torch.autograd.grad(o_ref, xs, do)):
        assert rel_err(a, b) < 1e-6


def test_bad_inputs_raise_before_compute():
    gen = torch.Generator().manual_seed(0)
    plan = build_plan((0, 64), "contiguous", 1, 0)
    q, k, v, g, beta, _ = random_inputs(gen, 64, 1, 1, 1, 8, 8, kda=False)
    with pytest.raises(ValueError, match="at most 256"):
        big = torch.zeros(1, 64, 1, 512)
        kcp.gated_delta_rule(big, big, v, g, beta, plan)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] must equal"):
        kcp.gated_delta_rule(q, k, v, g, beta, build_plan((0, 32), "contiguous", 1, 0))
    with pytest.raises(ValueError, match="unknown KCP backend"):
        kcp.gated_delta_rule(q, k, v, g, beta, plan, backend="cuda")
