"""KCP communication: all-gather of the affine state maps and the fold along a sequence."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kcp.parallel.plan import KCPPlan


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """``[W, *x.shape]`` from every rank of ``group``."""
    W = dist.get_world_size(group)
    out = x.new_empty(W * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(W, *x.shape)


def exchange_states(maps: torch.Tensor, segments: tuple[int, ...], num_slots: int, chains, group,
                    num_local_segs: int, init: torch.Tensor | None = None) -> torch.Tensor:
    """Fold the affine maps ``[A | B]`` (``S_out = B S_in + A``) along each chain.

    ``maps`` holds this rank's exports ``[len(segments), HV, K, V + K]`` (fp32). Returns a
    ``[num_local_segs, HV, K, V]`` fp32 tensor holding the folded state for each receiving
    segment and zeros elsewhere. ``init`` (``[N_global, HV, K, V]``) seeds each chain's fold.
    """
    HV, K, VK = maps.shape[1:]
    V = VK - K
    out = maps.new_zeros(num_local_segs, HV, K, V)
    if num_slots == 0:          # no sequence crosses a piece edge on any rank
        return out
    buf = maps.new_zeros(num_slots, HV, K, VK)
    buf[:len(segments)] = maps
    gathered = all_gather(buf, group)
    for chain in chains:
        S = maps.new_zeros(HV, K, V) if init is None else init[chain.seq].to(maps.dtype)
        for r, slot in chain.sources:
            X = gathered[r, slot]
            S = torch.baddbmm(X[..., :V], X[..., V:], S)
        out[chain.segment] = S
    return out


def fold_forward(maps, plan: KCPPlan, group, init=None):
    """Initial state of every local segment that continues a sequence from an earlier piece."""
    return exchange_states(maps, plan.send_fwd, plan.num_slots_fwd, plan.recv_fwd, group,
                           len(plan.seg_seq), init)


def fold_backward(maps, plan: KCPPlan, group):
    """Final-state gradient of every local segment whose sequence goes on in a later piece."""
    return exchange_states(maps, plan.send_bwd, plan.num_slots_bwd, plan.recv_bwd, group,
                           len(plan.seg_seq))
