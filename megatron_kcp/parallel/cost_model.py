"""Which state exchange a plan uses: relay (latency: state passes one rank after another) or all-gather
(work: the transition maps), and whether to move the stream to a document-aligned layout first, from
what every rank shares, so that all ranks choose alike. ``KCP_STRATEGY=relay|gather`` and
``KCP_CONVERT=0|1`` override the choices.

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
# what a sequence cut over ranks costs beyond its chain's state passes, per cut (hop) and step (fwd+bwd):
# the per-document zigzag against the contiguous layout, relay, W = 2, K = V = 128 (ops_h200x2.csv:
# 1, 10 and 100 documents at H = 16 and 64): segments too short to fill the kernels' chunks, one more
# phase of launches, a state each way
HOP, HOP_HEAD = 37e-6, 0.65e-6
CONVERT_ENV = "KCP_CONVERT"


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


@functools.lru_cache(maxsize=256)
def layout_cost(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int, head_dim: int) -> float:
    """Modelled seconds a step (fwd+bwd) spends on crossing ranks in ``layout``: the cheaper exchange's
    two directions (:func:`costs`) and the price of every cut of a sequence (``HOP``, ``HOP_HEAD``)."""
    if world_size == 1:
        return 0.0
    hops = sum(n - 1 for p in all_plans(cu_seqlens, layout, world_size) for i, n in enumerate(p.num_stages)
               if p.stage[i] == 0)
    relay, gather = costs(cu_seqlens, layout, world_size, heads, head_dim)
    return 2 * min(relay, gather) + hops * (HOP + HOP_HEAD * heads * (head_dim / 128) ** 2)


def conversion_cost(tokens: int, world_size: int, bytes_per_token: float, messages: float) -> float:
    """Seconds of the all-to-alls of a conversion: ``messages`` of them, moving ``bytes_per_token`` in
    all per token of the stream (a rank keeps 1/W of its rows)."""
    return messages * ALPHA + tokens / world_size * bytes_per_token * (world_size - 1) / world_size / BW


def convert_pays(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int, head_dim: int,
                 bytes_per_token: float, messages: float, target: str = "contiguous") -> bool:
    """Whether moving the stream from ``layout`` to ``target`` (what it costs: :func:`conversion_cost`)
    saves more than it costs (:func:`layout_cost` of both). ``KCP_CONVERT=1`` / ``0`` forces it."""
    forced = os.environ.get(CONVERT_ENV)
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{CONVERT_ENV}={forced!r}: use 1 (convert), 0 (keep the layout), or unset it")
        return forced == "1" and layout != target and world_size > 1
    if layout == target or world_size == 1:
        return False
    saved = layout_cost(cu_seqlens, layout, world_size, heads, head_dim) - \
        layout_cost(cu_seqlens, target, world_size, heads, head_dim)
    return saved > conversion_cost(cu_seqlens[-1], world_size, bytes_per_token, messages)
