"""What the exchanges and the layout moves cost, modelled from what every rank shares, so that all ranks
choose alike. The numbers are :mod:`megatron_kcp.calibration`'s (each with where it was measured); the
strategies' ``cost`` (:mod:`megatron_kcp.parallel.strategy`) and the dispatch's layout move read the
functions here.

Where no rank holds a segment that continues its sequence both ways, the all-gather needs no
transition map (every export is a true state) and every rank exports and folds at once: it is
taken. Elsewhere :func:`costs` weighs, per direction, the relay's chain (:func:`relay_chain`: stage
by stage, the busiest rank's state pass over the pieces that send on, and a message per hop) against the
all-gather's slowest rank (a map pass over each segment that continues both ways, a state pass over
each that only exports) plus the ring all-gather of the exchange slots. The choice moves with the map
pass's cost, hardly with the state pass's.

A layout move (:func:`relayout_pays`) pays where the layout it leaves costs more to cross ranks in
(:func:`layout_cost`: the cheaper exchange and the price of every cut of a sequence) than the layout it
reaches plus the move itself (:func:`relayout_cost`), the difference of the cores either layout runs
(:func:`core_saving`) included.

The relay's pipeline over head groups (:func:`pipeline_depth`): heads are independent, so a rank
can send a group of heads' states as soon as that group's state pass is done. With G groups the
longest chain's wait (its state passes before its last piece) shrinks to about 1/G, and each group
adds its own launches and messages (``group_cost`` per group and direction). A core whose passes do
not shrink with the heads (flash-qla's: a scan per head and sequence, latency-bound where a rank holds
few long segments) says so (``min_group_heads`` None) and keeps G = 1.

``KCP_STRATEGY=relay|gather``, ``KCP_CONVERT=0|1`` and ``KCP_RELAY_GROUPS=G`` override the choices
(:class:`megatron_kcp.options.Options`).
"""
from __future__ import annotations

import functools

from megatron_kcp.calibration import CALIBRATION
from megatron_kcp.kernels.cores import CORES
from megatron_kcp.options import Options
from megatron_kcp.plan import KCPPlan, all_plans

C = CALIBRATION
STATE_PASS = C.state_pass          # s per token of a state pass (fla, H200, H = 64)
STATE_PASS_HEADS, STATE_PASS_DIM = C.state_pass_heads, C.state_pass_dim   # what STATE_PASS was measured at
MAP_PASS = C.map_pass              # a transition-map pass against a state pass over the same tokens
ALPHA, BW = C.link.latency, C.link.bandwidth   # the link: s per message, bytes / s
HOP, HOP_HEAD = C.hop, C.hop_head  # a sequence cut over ranks, per cut and step, and its slope in the heads
RELAYOUT_BW = C.relayout_bw        # bytes / s a layout move carries, its local work included
HEADS_RELAYOUT_BW = C.heads_relayout_bw   # the same for the move to head shards (parallel/cp2hp.py)
QLA_SAVES = C.qla_saves            # s per token and value head flash-qla's GDN core saves against fla's
GROUP_COST = C.group_cost          # s a relay head group adds per direction
MIN_GROUP_HEADS = C.min_group_heads    # value heads a group needs to fill the GPU (fla)


@functools.lru_cache(maxsize=64)
def needs_maps(cu_seqlens: tuple[int, ...], layout: str, world_size: int) -> bool:
    """Whether some rank holds a segment that continues its sequence both ways."""
    return any(a and b for p in all_plans(cu_seqlens, layout, world_size) for a, b in zip(p.pred, p.succ))


@functools.lru_cache(maxsize=256)
def costs(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int = 64,
          head_dim: int = 128) -> tuple[float, float]:
    """Modelled seconds per direction that (relay, all-gather) add to a step. A state pass costs
    ``STATE_PASS`` a token whatever ``heads`` (which sizes the exchange's slots): with the cut's price
    fitted on top of it, this picks the faster layout for the measured GDN mixer at 32 heads, where a
    price scaled down to the heads and flash-qla's core would keep a long pack of few documents on
    Megatron's layout, which the measured rows have slower (benchmarks/reports/, the GDN mixer at 10
    documents: convert or stay)."""
    plans = all_plans(cu_seqlens, layout, world_size)
    gather = 0.0
    for p in plans:
        work = 0.0
        for i, n in enumerate(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])):
            if p.succ[i] is not None:
                work += (MAP_PASS if p.pred[i] is not None else 1.0) * STATE_PASS * n
        gather = max(gather, work)
    slot = heads * head_dim * 2 * head_dim * 4             # fp32 [H, K, V + K]
    gather += (world_size - 1) * (ALPHA + plans[0].num_slots_fwd * slot / BW)
    tokens, hops = relay_chain(cu_seqlens, layout, world_size)
    relay = tokens * STATE_PASS + hops * ALPHA
    return relay, gather


@functools.lru_cache(maxsize=256)
def layout_cost(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int, head_dim: int) -> float:
    """Modelled seconds a step (fwd+bwd) spends on crossing ranks in ``layout``: the cheaper exchange's
    two directions (:func:`costs`) and the price of every cut of a sequence (``HOP``, ``HOP_HEAD``)."""
    if world_size == 1:
        return 0.0
    relay, gather = costs(cu_seqlens, layout, world_size, heads, head_dim)
    return 2 * min(relay, gather) + cuts(cu_seqlens, layout, world_size) * (
        HOP + HOP_HEAD * heads * (head_dim / 128) ** 2)


@functools.lru_cache(maxsize=256)
def cuts(cu_seqlens: tuple[int, ...], layout: str, world_size: int) -> int:
    """How many times ``layout`` cuts the sequences over ranks: a sequence of n pieces, n - 1."""
    return sum(n - 1 for p in all_plans(cu_seqlens, layout, world_size) for i, n in enumerate(p.num_stages)
               if p.stage[i] == 0)


def relayout_cost(tokens: int, world_size: int, bytes_per_token: float, messages: float,
                  bandwidth: float = RELAYOUT_BW) -> float:
    """Seconds of a layout move: ``messages`` all-to-alls, moving ``bytes_per_token`` in all per token of
    the stream (a rank keeps 1/W of its rows) at ``bandwidth`` (``RELAYOUT_BW``; ``HEADS_RELAYOUT_BW`` to
    head shards)."""
    return messages * ALPHA + tokens / world_size * bytes_per_token * (world_size - 1) / world_size / bandwidth


def relayout_net(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int, head_dim: int,
                 bytes_per_token: float, messages: float, target: str = "contiguous", core_saves: float = 0.0) -> float:
    """Seconds a step gains by moving the stream from ``layout`` to ``target`` and back: what the move costs
    (:func:`relayout_cost`) less what it saves (:func:`layout_cost` of both, and ``core_saves``: the seconds a
    step's core saves in ``target``, see :func:`core_saving`); negative where it pays. ``target="heads"``: to
    head shards, where nothing crosses a rank (no layout cost) and the move has its own price
    (``HEADS_RELAYOUT_BW``). 0 where there is nothing to move."""
    if layout == target or world_size == 1:
        return 0.0
    to_heads = target == "heads"
    saved = layout_cost(cu_seqlens, layout, world_size, heads, head_dim) + core_saves - \
        (0.0 if to_heads else layout_cost(cu_seqlens, target, world_size, heads, head_dim))
    return relayout_cost(cu_seqlens[-1], world_size, bytes_per_token, messages,
                         HEADS_RELAYOUT_BW if to_heads else RELAYOUT_BW) - saved


def relayout_pays(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int, head_dim: int,
                  bytes_per_token: float, messages: float, target: str = "contiguous", core_saves: float = 0.0,
                  options: Options | None = None) -> bool:
    """Whether moving the stream from ``layout`` to ``target`` saves more than it costs (:func:`relayout_net`
    below zero). ``KCP_CONVERT=1`` / ``0`` forces it."""
    forced = (Options.from_env() if options is None else options).forced_relayout()
    if forced is not None:
        return forced and layout != target and world_size > 1
    return relayout_net(cu_seqlens, layout, world_size, heads, head_dim, bytes_per_token, messages, target,
                        core_saves) < 0


def core_saving(stay: str, moved: str, local_tokens: int, heads: int, head_dim: int) -> float:
    """Seconds a step (fwd+bwd) saves by running core ``moved`` (``fla`` | ``qla`` | ...) on a rank's
    ``local_tokens`` instead of core ``stay``: the difference of the cores' ``saves`` (a token and value head,
    against fla's kernels: ``QLA_SAVES`` for flash-qla's), nothing between equal cores."""
    if stay == moved:
        return 0
    return (CORES[moved].saves - CORES[stay].saves) * local_tokens * heads * (head_dim / 128) ** 2


@functools.lru_cache(maxsize=256)
def relay_chain(cu_seqlens: tuple[int, ...], layout: str, world_size: int) -> tuple[int, int]:
    """(tokens, hops) of the relay's longest chain: the relay runs a stage's pieces of every sequence in
    one phase (``relay.phases``), so the chain is, stage by stage, the busiest rank's state pass over the
    pieces that send on; hops: the most cuts of one sequence. (0, 0) where nothing crosses a rank."""
    stage_work, hops = {}, 0
    for p in all_plans(cu_seqlens, layout, world_size):
        for i, n in enumerate(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])):
            hops = max(hops, p.num_stages[i] - 1)
            if p.succ[i] is not None:
                work = stage_work.setdefault(p.stage[i], {})
                work[p.rank] = work.get(p.rank, 0) + n
    return sum(max(w.values()) for w in stage_work.values()), hops


def relay_chain_pass(cu_seqlens: tuple[int, ...], layout: str, world_size: int, heads: int = STATE_PASS_HEADS,
                     head_dim: int = STATE_PASS_DIM) -> float:
    """Modelled seconds of the relay's longest chain of state passes (:func:`relay_chain`), at
    ``STATE_PASS`` scaled to ``heads`` and ``head_dim`` (a pass is K x V work per token and head)."""
    scale = heads / STATE_PASS_HEADS * (head_dim / STATE_PASS_DIM) ** 2
    return relay_chain(cu_seqlens, layout, world_size)[0] * STATE_PASS * scale


def pipeline_depths(value_heads: int, qk_heads: int) -> tuple[int, ...]:
    """The head-group counts the relay can run: G divides the q/k heads H, so that each group of
    HV / G value heads holds whole q/k heads (HV / H value heads read each)."""
    return tuple(G for G in range(1, qk_heads + 1) if qk_heads % G == 0)


def forced_depth(value_heads: int, qk_heads: int, options: Options | None = None) -> int | None:
    """``KCP_RELAY_GROUPS``, validated against the heads; None where it is unset."""
    forced = (Options.from_env() if options is None else options).relay_groups
    if not forced:
        return None
    fits = pipeline_depths(value_heads, qk_heads)
    if not forced.strip().isdigit() or int(forced) not in fits:
        raise ValueError(f"KCP_RELAY_GROUPS={forced!r}: the relay's head groups must divide the value heads "
                         f"(HV={value_heads}) into groups of whole q/k heads (H={qk_heads}), so G must divide "
                         f"H: use one of {', '.join(map(str, fits))} (or unset it for the cost model)")
    return int(forced)


def pipeline_depth(plan: KCPPlan, value_heads: int, qk_heads: int | None = None, head_dim: int = 128,
                   min_group_heads: int | None = MIN_GROUP_HEADS) -> int:
    """G, the head groups the relay pipelines its state passes over (forward and backward alike), from
    what every rank shares: 1 where nothing crosses a rank or the chain is too short to pay for a group.
    ``KCP_RELAY_GROUPS`` overrides it.

    Args:
        plan: this rank's plan (only its global cu_seqlens, layout and CP size are read).
        value_heads: HV; qk_heads: H (default HV); head_dim: K (= V).
        min_group_heads: the core's ``min_group_heads`` (None: groups never pay on it, G = 1).
    Returns:
        G, a divisor of H (see :func:`pipeline_depths`).
    """
    qk_heads = value_heads if qk_heads is None else qk_heads
    forced = forced_depth(value_heads, qk_heads)
    if forced is not None:
        return forced
    if min_group_heads is None:
        return 1
    return _pipeline_depth(plan.global_cu_seqlens, plan.layout, plan.world_size, value_heads, qk_heads, head_dim,
                           min_group_heads)


@functools.lru_cache(maxsize=256)
def _pipeline_depth(cu_seqlens, layout, world_size, value_heads, qk_heads, head_dim, min_group_heads) -> int:
    wait = relay_chain_pass(cu_seqlens, layout, world_size, value_heads, head_dim) if world_size > 1 else 0.0
    fits = [G for G in pipeline_depths(value_heads, qk_heads) if G == 1 or value_heads // G >= min_group_heads]
    return min(fits, key=lambda G: (wait / G + (G - 1) * GROUP_COST, G))
