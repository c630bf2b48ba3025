"""flash-qla's kernel contracts, as ``core_qla`` calls them, over the fp64 reference: the qla core's
CPU stand-in (flash-qla runs on Hopper and Blackwell only).

What each kernel must return is all the core relies on, so the core's own logic (which segments a
pass covers, which rows leave, where gradients land, grouped heads) is tested on CPU ranks against
the oracle; the GPU tests check the real kernels against the same oracle. Two liberties, both
invisible to the core: the gate stays per token (the cumsum and its reverse are identities, which
cancel as the real pair does), and the chunk states ``h`` are the initial states they come from.
``fused_gdr_dh`` gets zero values: the initial-state gradient does not depend on v, and its
contract takes none. An initial state or final-state gradient passed as None is zero, as in the kernels.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_kcp.kernels import reference as R


def _run(q, k, v, g, b, scale, h0, cu):
    o, ht = R.chunk_gated_delta_rule_fp64(q, k, v, g, b, scale=scale, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu)
    return o, ht


def _grouped(x, v):
    """q/k heads expanded to v's, so their gradients come out per value head, as flash-qla's do."""
    return x.repeat_interleave(v.shape[2] // x.shape[2], dim=2)


def _states(k, v, cu, state=None):
    """``state``, or zero states (one per sequence) where the core passes None, as the kernels take it."""
    return k.new_zeros(len(cu) - 1, v.shape[2], k.shape[3], v.shape[3], dtype=torch.float32) if state is None else state


def fused_gdr_h(k, v, a, g, b, initial_state=None, output_final_state=True, output_h=True, cu_seqlens=None):
    initial_state = _states(k, v, cu_seqlens, initial_state)
    _, ht = _run(k, k, v, g, b, None, initial_state, cu_seqlens)
    return (initial_state.clone() if output_h else None), (ht.float() if output_final_state else None), None


def maps_pass(k, v, a, g, b, cu_seqlens, num_chunks):
    """(H, M): the final states from zero states, and the maps from identity states without the values."""
    _, H, _ = fused_gdr_h(k, v, a, g, b, output_h=False, cu_seqlens=cu_seqlens)
    n, HV, K = len(cu_seqlens) - 1, v.shape[2], k.shape[3]
    eye = torch.eye(K, dtype=torch.float32).expand(n, HV, K, K).contiguous()
    _, M, _ = fused_gdr_h(k, v.new_zeros(*v.shape[:3], K), a, g, b, eye, output_h=False, cu_seqlens=cu_seqlens)
    return H, M


def fused_gdr_fwd(q, k, v, a, g, b, scale=None, initial_state=None, output_final_state=True, output_h=False,
                  cu_seqlens=None):
    o, ht = _run(q, k, v, g, b, scale, _states(k, v, cu_seqlens, initial_state), cu_seqlens)
    return o, None, ht.float() if output_final_state else None


def _grads(q, k, v, g, b, scale, h0, do, dht, cu):
    leaves = [x.detach().double().requires_grad_() for x in (_grouped(q, v), _grouped(k, v), v, g, b, h0)]
    with torch.enable_grad():
        o, ht = _run(*leaves[:5], scale, leaves[5], cu)
        grads = torch.autograd.grad((o, ht), leaves, (do.double(), dht.double()))
    return [d.to(x.dtype) for d, x in zip(grads, (v, v, v, g, b, h0))]


def fused_gdr_dh(q, k, a, g, b, do, dht=None, output_dh0=True, output_dh=True, scale=None, cu_seqlens=None):
    dht = _states(k, do, cu_seqlens, dht)
    dh0 = _grads(q, k, torch.zeros_like(do), g, b, scale, torch.zeros_like(dht), do, dht, cu_seqlens)[5]
    return None, dh0 if output_dh0 else None


def fused_gdr_bwd(q, k, v, a, g, b, do, dht, h, scale=None, cu_seqlens=None):
    return tuple(_grads(q, k, v, g, b, scale, h, do, _states(k, v, cu_seqlens, dht), cu_seqlens))


def l2norm_fwd(x):
    rstd = torch.rsqrt(x.double().pow(2).sum(-1, keepdim=True) + 1e-6)
    return (x * rstd).to(x.dtype), rstd.squeeze(-1)


def l2norm_bwd(y, rstd, dy):
    y64, dy64 = y.double(), dy.double()
    return ((dy64 - y64 * (dy64 * y64).sum(-1, keepdim=True)) * rstd.unsqueeze(-1)).to(dy.dtype)


def group_reduce_vector(x, Hg):
    return x.view(*x.shape[:2], Hg, x.shape[2] // Hg, x.shape[3]).sum(3)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """flash-qla's top-level call (its intra-GPU split is invisible to a caller)."""
    return R.chunk_gated_delta_rule_fp64(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
                                         cu_seqlens=None if cu_seqlens is None else cu_seqlens.cpu())


def kernels() -> SimpleNamespace:
    return SimpleNamespace(
        chunk_local_cumsum=lambda g, chunk_size=64, cu_seqlens=None, reverse=False, zero_last_chunk=False: g.clone(),
        kkt_solve=lambda k, b, chunk_size=64, cu_seqlens=None: k.new_zeros(*b.shape, chunk_size),
        fused_gdr_h=fused_gdr_h, maps_pass=maps_pass, fused_gdr_fwd=fused_gdr_fwd, fused_gdr_dh=fused_gdr_dh,
        fused_gdr_bwd=fused_gdr_bwd,
        group_reduce_vector=group_reduce_vector, prepare_varlen_metadata=lambda cu, cu_cpu: cu, l2norm_fwd=l2norm_fwd,
        l2norm_bwd=l2norm_bwd, chunk_gated_delta_rule=chunk_gated_delta_rule)


def install() -> None:
    """Make ``backend='qla'`` run the qla core over these contracts in this process."""
    from megatron_kcp.kernels import core_qla
    from megatron_kcp.kernels.core_qla import GDNQLACore
    core_qla._kernels = kernels
    core_qla._cu.cache_clear()
    core_qla.core = lambda *args: GDNQLACore()
