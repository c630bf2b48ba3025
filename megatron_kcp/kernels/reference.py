"""Pure-PyTorch gated delta rule (GDN and KDA): the CPU path and the oracle.

One recurrence covers both models: the gate ``g`` is a natural-log decay of shape
``[B, T, HV]`` (GDN, one per head) or ``[B, T, HV, K]`` (KDA, one per key dim)::

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T,    o_t = scale * S_t^T q_t

Arguments follow fla's ``chunk_gated_delta_rule`` / ``chunk_kda``: q, k ``[B, T, H, K]``,
v ``[B, T, HV, V]`` (HV a multiple of H), beta ``[B, T, HV]``, states ``[N, HV, K, V]``.
Everything is computed in fp64 and cast back to v's dtype; backward is autograd through the same arithmetic.
"""
from __future__ import annotations

import torch

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp64, heads expanded to HV, gate per key dim, q scaled."""
    H, K, HV = q.shape[2], q.shape[3], v.shape[2]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of q/k heads ({H})")
    # fp64 throughout: the oracle must be well below the rounding of what it checks
    q, k, v, g, beta = (x.to(torch.float64) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if g.dim() == 3:
        g = g.unsqueeze(-1).expand(*g.shape, K)
    scale = K ** -0.5 if scale is None else scale
    return q * scale, k, v, g, beta


def _sequences(cu_seqlens, B, T):
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if B != 1:
        raise ValueError(f"varlen input (cu_seqlens given) must have batch size 1, got {B}")
    cu = cu_seqlens.tolist()
    return [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]


def _over_sequences(seq_fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                    cu_seqlens):
    """Run ``seq_fn(q, k, v, g, beta, S) -> (o, S)`` on every sequence (batch row or varlen piece)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    B, T, HV, K = k.shape
    o, finals = [], []
    for n, (b, s, e) in enumerate(_sequences(cu_seqlens, B, T)):
        S = v.new_zeros(HV, K, v.shape[-1]) if initial_state is None else initial_state[n].to(v.dtype)
        on, S = seq_fn(q[b, s:e], k[b, s:e], v[b, s:e], g[b, s:e], beta[b, s:e], S)
        o.append(on)
        finals.append(S)
    o = torch.cat(o).view(B, T, HV, -1).to(dtype)
    return o, (torch.stack(finals) if output_final_state else None)


def _recurrent_seq(q, k, v, g, beta, S):
    out = []
    for t in range(k.shape[0]):
        S = S * g[t].exp()[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum('hk,hkv->hv', k[t], S))
        S = S + k[t][..., None] * u[:, None, :]
        out.append(torch.einsum('hk,hkv->hv', q[t], S))
    return torch.stack(out), S


def recurrent_gated_delta_rule_fp64(q, k, v, g, beta, scale=None, initial_state=None,
                                    output_final_state=False, use_qk_l2norm=False, cu_seqlens=None):
    """Token-by-token recurrence: the oracle for everything else."""
    return _over_sequences(_recurrent_seq, q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm, cu_seqlens)


def _chunk_seq(q, k, v, g, beta, S, chunk_size):
    """Chunked WY form over one sequence: q, k, g [T, HV, K], v [T, HV, V], beta [T, HV]."""
    out = []
    for c in range(0, k.shape[0], chunk_size):
        qc, kc, vc, bc = (x[c:c + chunk_size].transpose(0, 1) for x in (q, k, v, beta))
        gc = g[c:c + chunk_size].transpose(0, 1).cumsum(1)         # [HV, C, K] log of Gamma_r
        C = kc.shape[1]
        causal = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        strict = causal.tril(-1)
        # decay from token j to token i (j <= i) per key dim, as differences so nothing overflows
        dec = (gc[:, :, None, :] - gc[:, None, :, :]).masked_fill(~causal[..., None], 0).exp()
        A = torch.einsum('hik,hjk,hijk->hij', kc, kc, dec) * bc[..., None]
        A = A.masked_fill(~strict, 0)
        eye = torch.eye(C, dtype=k.dtype, device=k.device)
        Tinv = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        kg = kc * gc.exp()                                          # Gamma_r * k_r
        w = Tinv @ (bc[..., None] * kg)                             # [HV, C, K]
        u = Tinv @ (bc[..., None] * vc)                             # [HV, C, V]
        U = u - w @ S                                               # delta-rule new values
        qk = torch.einsum('hik,hjk,hijk->hij', qc, kc, dec).masked_fill(~causal, 0)
        out.append((qc * gc.exp()) @ S + qk @ U)
        kd = kc * (gc[:, -1:] - gc).exp()                           # k_r * Gamma_C / Gamma_r
        S = gc[:, -1].exp()[..., None] * S + kd.transpose(1, 2) @ U
    return torch.cat(out, 1).transpose(0, 1), S


def chunk_gated_delta_rule_fp64(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                use_qk_l2norm=False, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """Chunked (WY) form, chunks never crossing a sequence; same contract as the naive oracle."""
    return _over_sequences(lambda *x: _chunk_seq(*x, chunk_size), q, k, v, g, beta, scale, initial_state,
                           output_final_state, use_qk_l2norm, cu_seqlens)


def affine_state_map(k, g, beta, v, use_qk_l2norm=False, chunk_size=CHUNK_SIZE):
    """The affine map S_out = M S_in + H of one sequence, as ``[HV, K, V + K]`` = [H | M] (fp64).

    The recurrence is affine in (S, v) column by column, so one pass with values [v | 0] from
    the initial state [0 | I] yields [H | M]. q plays no part; k's shape stands in for it.
    """
    T, HV, K = v.shape[1], v.shape[2], k.shape[-1]
    vz = v.to(torch.float64)
    vz = torch.cat([vz, vz.new_zeros(1, T, HV, K)], -1)
    eye = torch.eye(K, dtype=vz.dtype, device=v.device).expand(HV, K, K)
    S0 = torch.cat([vz.new_zeros(HV, K, v.shape[-1]), eye], -1)
    _, S = chunk_gated_delta_rule_fp64(k, k, vz, g, beta, initial_state=S0[None], output_final_state=True,
                                       use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
    return S[0]
