"""Which exchange a plan uses: relay (latency: state passes in sequence) or all-gather (work: the
transition maps). ``choose`` is the cost model; ``KCP_STRATEGY=relay|gather`` overrides it.

The rule: where no sequence has a piece that continues it both ways on some rank, the all-gather
needs no transition map at all (every export is a true state) and every rank exports and folds at
once; where a map is needed (zigzag's middle rank, every document of per-document zigzag, a long
document over several ranks), its pass costs about 4.4 state passes and the relay is ahead while
its chain is short; beyond W = 4 the chain's latency grows with W and the all-gather takes over.
Measured at W = 2 (2 x H200, H = 64, 32k tokens, GDN and KDA, BENCHMARKS.md): the rule takes the
faster strategy, or one within 2%, in all 18 rows; the relay is 6-24% ahead where a map is needed,
the all-gather up to 15% where none is. The W = 4 threshold rests on one-GPU predictions, which it
gets wrong at W = 8 with many documents (BENCHMARKS.md).
"""
from __future__ import annotations

import functools
import os

from megatron_kcp.parallel.plan import KCPPlan, build_plan

STRATEGIES = ("auto", "relay", "gather")
RELAY_MAX_W = 4


@functools.lru_cache(maxsize=64)
def needs_maps(cu_seqlens: tuple[int, ...], layout: str, world_size: int) -> bool:
    """Whether some rank holds a segment that continues its sequence both ways. Computed from what
    every rank shares (the global cu_seqlens, layout and W), so that all ranks choose alike."""
    for r in range(world_size):
        p = build_plan(cu_seqlens, layout, world_size, r)
        if any(a and b for a, b in zip(p.pred, p.succ)):
            return True
    return False


def choose(plan: KCPPlan) -> str:
    forced = os.environ.get("KCP_STRATEGY")
    if forced:
        if forced not in STRATEGIES[1:]:
            raise ValueError(f"KCP_STRATEGY={forced!r}: use relay or gather (or unset it for the cost model)")
        return forced
    if not needs_maps(plan.global_cu_seqlens, plan.layout, plan.world_size):
        return "gather"
    return "relay" if plan.world_size <= RELAY_MAX_W else "gather"
