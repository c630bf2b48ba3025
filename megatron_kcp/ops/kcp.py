"""The KCP ops the mixers call: gated delta rule (GDN/KDA) and short conv over CP shards.

``backend="auto"`` runs fla's Triton kernels on CUDA and the pure-PyTorch reference elsewhere;
``"reference"`` or ``"fla"`` force one (tests compare them).
"""
from __future__ import annotations

import torch

from megatron_kcp.ops import conv_reference
from megatron_kcp.ops.kcp_reference import KCPReference
from megatron_kcp.parallel.plan import MAX_HEAD_DIM, KCPPlan

BACKENDS = ("auto", "reference", "fla")


def _backend(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown KCP backend {backend!r}: choose one of {BACKENDS}")
    if backend == "auto":
        return "fla" if x.is_cuda else "reference"
    return backend


def check_inputs(q, k, v, g, beta, plan: KCPPlan, initial_state=None):
    """Shape checks that name the fix; run before any kernel."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must be the packed local stream [1, T, H, K], got {tuple(q.shape)}")
    T, H, K = q.shape[1:]
    HV, V = v.shape[2:]
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        raise ValueError(f"head dims K={K}, V={V}: the chunked kernels support at most {MAX_HEAD_DIM}; "
                         "use more heads of a smaller head dim")
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or HV % H:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k must match q, v must be "
                         "[1, T, HV, V] with HV a multiple of H")
    if g.shape not in ((1, T, HV), (1, T, HV, K)) or beta.shape != (1, T, HV):
        raise ValueError(f"g {tuple(g.shape)} must be [1, T, HV] (GDN) or [1, T, HV, K] (KDA) and beta "
                         f"{tuple(beta.shape)} [1, T, HV] with T={T}, HV={HV}, K={K}")
    if T != plan.num_local_tokens:
        raise ValueError(f"this rank holds {T} tokens but cu_seqlens / CP layout give it {plan.num_local_tokens} "
                         f"(global {plan.num_local_tokens * plan.world_size}): cu_seqlens[-1] must equal "
                         "the local length times the CP size")
    if initial_state is not None and initial_state.shape != (plan.num_seqs, HV, K, V):
        raise ValueError(f"initial_state must be [num_seqs={plan.num_seqs}, {HV}, {K}, {V}], "
                         f"got {tuple(initial_state.shape)}")


def gated_delta_rule(q, k, v, g, beta, plan: KCPPlan, group=None, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, use_qk_l2norm: bool = False,
                     backend: str = "auto") -> torch.Tensor:
    """o ``[1, T, HV, V]`` of this rank's shard; equals the single-device run, forward and backward.

    ``initial_state`` ``[N, HV, K, V]`` holds one state per global sequence (the same on every
    rank); its gradient on each rank is that rank's share (sum over the CP group for the total).
    """
    check_inputs(q, k, v, g, beta, plan, initial_state)
    if _backend(backend, q) == "fla":
        from megatron_kcp.ops import kcp_fla
        return kcp_fla.gated_delta_rule(q, k, v, g, beta, plan, group, scale, initial_state, use_qk_l2norm)
    return KCPReference.apply(q, k, v, g, beta, initial_state, plan, group, scale, use_qk_l2norm)


def causal_conv1d(x, weight, bias=None, activation: str | None = "silu", plan: KCPPlan = None, group=None,
                  backend: str = "auto") -> torch.Tensor:
    """Depthwise causal conv of the packed local stream ``[1, T, D]``, weight ``[D, kernel_size]``."""
    if plan is None:
        raise ValueError("causal_conv1d needs a KCP plan: plan_for_cp_group(cu_seqlens, layout, conv_kernel_size)")
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != plan.num_local_tokens:
        raise ValueError(f"x must be the packed local stream [1, {plan.num_local_tokens}, D], got {tuple(x.shape)}")
    if _backend(backend, x) == "fla":
        from megatron_kcp.ops import kcp_fla
        return kcp_fla.causal_conv1d(x, weight, bias, activation, plan, group)
    return conv_reference.causal_conv1d(x, weight, bias, activation, plan, group)
