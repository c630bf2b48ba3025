"""Short causal depthwise conv1d over a packed local stream, in PyTorch: the CPU path and the oracle.

Each token reads the ``kernel_size - 1`` tokens before it in its sequence; a piece's first tokens
read them from the halo (:mod:`megatron_kcp.parallel.halo`).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_kcp.plan import KCPPlan


@functools.lru_cache(maxsize=32)
def _taps(plan: KCPPlan) -> torch.Tensor:
    """``[T, kernel_size]``: the row of each tap of each token in ``[x; halo; 0]``."""
    T, P, hl = plan.num_local_tokens, plan.num_pieces, plan.halo_len
    piece_start, off = [], 0
    for s, e in plan.pieces:
        piece_start.append(off)
        off += e - s
    zero = T + P * hl
    taps = []
    cu = plan.cu_seqlens
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        p = max(j for j, ps in enumerate(piece_start) if ps <= a)
        first_of_piece = piece_start[p] == a
        for t in range(a, b):
            row = []
            for j in range(hl + 1):
                src = t - hl + j
                if src >= a:
                    row.append(src)
                elif first_of_piece:
                    row.append(T + p * hl + hl + (src - a))
                else:
                    row.append(zero)
            taps.append(row)
    return torch.tensor(taps, dtype=torch.long).view(T, hl + 1)


@functools.lru_cache(maxsize=32)
def _taps_on(plan: KCPPlan, device: str) -> torch.Tensor:
    return _taps(plan).to(device)


def local_conv(x, weight, bias, activation, plan: KCPPlan, rows):
    """Depthwise causal conv of the packed local stream with the CP halo.

    Args:
        x: ``[1, T, D]``, this rank's stream; weight: ``[D, kernel_size]``; bias: ``[D]`` or None.
        activation: ``"silu"`` / ``"swish"`` or None.
        rows: the halo rows ``[pieces * (kernel_size - 1), D]`` (:mod:`megatron_kcp.parallel.halo`; None:
            a plan without a halo).
    Returns:
        ``[1, T, D]``.
    """
    x2 = x[0]
    taps = _taps_on(plan, str(x.device))
    parts = [x2] + ([rows] if rows is not None else [])
    parts.append(x2.new_zeros(1, x2.shape[1]))
    xe = torch.cat(parts)
    # one gathered [T, D] view per tap, never the [T, ks, D] window tensor
    y = sum(xe[taps[:, j]] * weight[:, j].to(xe.dtype) for j in range(taps.shape[1]))
    if bias is not None:
        y = y + bias
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y[None]
