"""Which exchange a plan uses: relay (latency: state passes in sequence) or all-gather (work: the
transition maps). ``choose`` is the cost model; ``KCP_STRATEGY=relay|gather`` overrides it."""
from __future__ import annotations

import os

from megatron_kcp.parallel.plan import KCPPlan

STRATEGIES = ("auto", "relay", "gather")


def choose(plan: KCPPlan) -> str:
    forced = os.environ.get("KCP_STRATEGY")
    if forced:
        if forced not in STRATEGIES[1:]:
            raise ValueError(f"KCP_STRATEGY={forced!r}: use relay or gather (or unset it for the cost model)")
        return forced
    # provisional, by CP size alone: the one-GPU predictions at W=2 (BENCHMARKS.md) favour the relay
    # where a sequence crosses ranks; a model over layout and segment lengths is still to be fitted
    return "relay" if plan.world_size <= 4 else "gather"
