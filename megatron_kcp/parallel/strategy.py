"""Which exchange a plan uses: relay (latency: state passes in sequence) or all-gather (work: the
transition maps). ``choose`` is the cost model; ``KCP_STRATEGY=relay|gather`` overrides it.

Where no rank holds a segment that continues its sequence both ways, the all-gather needs no
transition map (every export is a true state) and every rank exports and folds at once: it is
taken. Elsewhere ``costs`` weighs, per direction, the relay's longest chain (the state passes of a
sequence's pieces before its last, one after another, and a message per hop) against the
all-gather's slowest rank (a map pass over each segment that continues both ways, a state pass
over each that only exports) plus the ring all-gather of the exchange slots. Fitted to the
one-GPU predictions of W = 2 to 64 (``simulate.py`` on one H200, GDN at 32k and 256k tokens, KDA
at 32k and 128k, H = 64, every layout, one sequence and 10 documents; BENCHMARKS.md): it takes the
faster strategy, or one within 5% of it, in 73 of 78 cases (the rule before it, relay up to
W = 4: 63), and loses at most 17%, in per-document zigzag at W >= 8, where both run at
efficiency <= 0.04. The choice moves with the map pass's cost (``MAP_PASS``, 4.4 state passes,
``kernel_costs.py``), hardly with the state pass's (any of 2e-8 to 8e-8 s per token).
"""
from __future__ import annotations

import functools
import os

from megatron_kcp.parallel.plan import KCPPlan, build_plan

STRATEGIES = ("auto", "relay", "gather")
STATE_PASS = 4e-8     # s per token of a state pass (fla, H200, H = 64: 0.65 ms for 16k tokens)
MAP_PASS = 4.4        # a transition-map pass against a state pass over the same tokens
ALPHA, BW = 60e-6, 332e9   # the 2 x H200 NVLink fit (s per message, bytes / s)


@functools.lru_cache(maxsize=64)
def needs_maps(cu_seqlens: tuple[int, ...], layout: str, world_size: int) -> bool:
    """Whether some rank holds a segment that continues its sequence both ways. Computed from what
    every rank shares (the global cu_seqlens, layout and W), so that all ranks choose alike."""
    for r in range(world_size):
        p = build_plan(cu_seqlens, layout, world_size, r)
        if any(a and b for a, b in zip(p.pred, p.succ)):
            return True
    return False


@functools.lru_cache(maxsize=256)
def costs(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int = 64,
          head_dim: int = 128) -> tuple[float, float]:
    """Modelled seconds per direction that (relay, all-gather) add to a step, from what every rank shares."""
    plans = [build_plan(cu_seqlens, layout, world_size, r) for r in range(world_size)]
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
    forced = os.environ.get("KCP_STRATEGY")
    if forced:
        if forced not in STRATEGIES[1:]:
            raise ValueError(f"KCP_STRATEGY={forced!r}: use relay or gather (or unset it for the cost model)")
        return forced
    cu, layout, W = plan.global_cu_seqlens, plan.layout, plan.world_size
    if not needs_maps(cu, layout, W):
        return "gather"
    relay, gather = costs(cu, layout, W, heads)
    return "relay" if relay <= gather else "gather"
