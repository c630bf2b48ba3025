"""Which state exchange a plan uses: relay (latency: state passes one rank after another) or all-gather
(work: the transition maps), from what every rank shares, so that all ranks choose alike.
``KCP_STRATEGY=relay|gather`` overrides the choice.

Where no rank holds a segment that continues its sequence both ways, the all-gather needs no
transition map (every export is a true state) and every rank exports and folds at once: it is
taken. Elsewhere :func:`costs` weighs, per direction, the relay's longest chain (the state passes of
a sequence's pieces before its last, one after another, and a message per hop) against the
all-gather's slowest rank (a map pass over each segment that continues both ways, a state pass over
each that only exports) plus the ring all-gather of the exchange slots. The constants are fitted on
one-GPU timings of each rank's work (``benchmarks/simulate.py``, ``benchmarks/kernel_costs.py``);
the choice moves with the map pass's cost, hardly with the state pass's.
"""
from __future__ import annotations

import functools
import os

from megatron_kcp.parallel.plan import KCPPlan, all_plans

STRATEGIES = ("relay", "gather")
STATE_PASS = 4e-8          # s per token of a state pass (fla, H200, H = 64)
MAP_PASS = 4.4             # a transition-map pass against a state pass over the same tokens
ALPHA, BW = 60e-6, 332e9   # the link: s per message, bytes / s (NVLink, H200)


@functools.lru_cache(maxsize=64)
def needs_maps(cu_seqlens: tuple[int, ...], layout: str, world_size: int) -> bool:
    """Whether some rank holds a segment that continues its sequence both ways."""
    return any(a and b for p in all_plans(cu_seqlens, layout, world_size) for a, b in zip(p.pred, p.succ))


@functools.lru_cache(maxsize=256)
def costs(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int = 64,
          head_dim: int = 128) -> tuple[float, float]:
    """Modelled seconds per direction that (relay, all-gather) add to a step."""
    plans = all_plans(cu_seqlens, layout, world_size)
    pieces, gather = {}, 0.0
    for p in plans:
        work = 0.0
        for i, n in enumerate(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])):
            pieces.setdefault(p.seg_seq[i], []).append((p.stage[i], n))
            if p.succ[i] is not None:
                work += (MAP_PASS if p.pred[i] is not None else 1.0) * STATE_PASS * n
        gather = max(gather, work)
    slot = heads * head_dim * 2 * head_dim * 4             # fp32 [H, K, V + K]
    gather += (world_size - 1) * (ALPHA + plans[0].num_slots_fwd * slot / BW)
    relay = max(sum(n for _, n in sorted(c)[:-1]) * STATE_PASS + (len(c) - 1) * ALPHA for c in pieces.values())
    return relay, gather


def choose(plan: KCPPlan, heads: int = 64) -> str:
    """``relay`` or ``gather`` for this plan (``KCP_STRATEGY`` overrides)."""
    forced = os.environ.get("KCP_STRATEGY")
    if forced:
        if forced not in STRATEGIES:
            raise ValueError(f"KCP_STRATEGY={forced!r}: use relay or gather (or unset it for the cost model)")
        return forced
    cu, layout, W = plan.global_cu_seqlens, plan.layout, plan.world_size
    if not needs_maps(cu, layout, W):
        return "gather"
    relay, gather = costs(cu, layout, W, heads)
    return "relay" if relay <= gather else "gather"
