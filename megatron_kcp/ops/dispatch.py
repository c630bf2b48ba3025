"""Which core, which exchange strategy and which segment split one call runs: one cached decision per
plan and problem, read by the op and by the ``KCP active`` line alike.

Every input of the decision is shared by all ranks of the CP group (the global cu_seqlens, layout,
CP size, heads, head dims, dtype, device kind), so all ranks decide alike; nothing depends on the
rank's own tokens.

* The core (``backend="auto"``): flash-qla's fused GDN kernels where they run here
  (:func:`megatron_kcp.environment.qla_runs`) and measured faster than fla's on such a plan
  (:func:`qla_worth`), fla's kernels elsewhere on CUDA, the pure-PyTorch reference on the CPU.
* The strategy (``strategy="auto"``): the cost model's (:mod:`megatron_kcp.parallel.cost_model`);
  on flash-qla, the relay wherever the all-gather would need transition maps. Without CP, on CUDA,
  no exchange at all: the core's single-device call (``"none"``).
* The layout (``strategy="auto"`` or ``"convert"``): on a zigzag layout (Megatron's per-document one
  above all), the stream moves to the contiguous layout and back around the exchange where the cost
  model says the fewer crossing documents pay for the all-to-alls
  (:func:`megatron_kcp.parallel.cost_model.convert_pays`), the difference of the cores either
  layout runs included (flash-qla's where the contiguous layout allows it, fla's where Megatron's
  leaves a rank too many segments); core, strategy and split are then decided on the contiguous plan.
  Where the heads divide over the ranks, the stream moves to head shards instead (``cp2hp``:
  megatron-core's all-to-all of the same five tensors, then the core's single-device call on the
  whole stream, with no state to exchange), which the measured rows found faster than the contiguous
  layout or about level with it wherever converting paid (benchmarks/reports/); where no document is longer
  than a rank's share (so the call runs as many scans side by side as a rank's step), also where that
  move alone pays at its own price (no layout cost left, ``HEADS_CONVERT_BW``). Not where an initial state is
  passed (cp2hp takes none), inside a CUDA graph capture (the single-device varlen call reads
  lengths on the host), where ``KCP_STRATEGY`` or ``KCP_CONVERT`` is set, or where a backend is named
  (its core's step, not the single-device call, is what was asked for).
* fla's own CP call (``strategy="fla-cp"``, on the contiguous layout, fla's kernels): where asked for,
  and (``strategy="auto"``) for KDA on the contiguous layout (the op's own, or the one it converts to)
  where no document is longer than a rank's share and a rank holds at most ``FLA_CP_MAX_LOCAL``
  tokens: there our step is bound by its host launches and fla's call issues the same work in fewer
  (:func:`fla_cp_pays`). Not where an initial state is passed, inside a CUDA graph capture, where
  ``KCP_STRATEGY`` is set, or where a backend or ``max_segment`` is named.
* The split (``max_segment=None``): where flash-qla's scans would be latency-bound (a few long
  segments a rank), segments are split into parts that the all-gather chains
  (:func:`qla_max_segment`); on fla's kernels under the all-gather with maps, the one segment of a
  zigzag layout's middle rank that is twice as long as any other rank's (:func:`fla_max_segment`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import torch

from megatron_kcp.environment import qla_runs
from megatron_kcp.parallel.relayout_exchange import RelayoutExchange, target_plan
from megatron_kcp.parallel.cost_model import CONVERT_ENV, choose, convert_pays, core_saving, needs_maps
from megatron_kcp.parallel.cp2hp import CP2HP
from megatron_kcp.parallel.fla_cp import FlaCP
from megatron_kcp.parallel.gather import AllGather
from megatron_kcp.plan import KCPPlan, all_plans, capturing
from megatron_kcp.parallel.relay import Relay
from megatron_kcp.parallel.single import SingleDevice
from megatron_kcp.parallel.strategy import ExchangeStrategy

BACKENDS = ("auto", "reference", "fla", "qla")
STRATEGY_NAMES = ("auto", "relay", "gather", "cp2hp", "convert", "fla-cp")
# the strategies by name (``none``: no exchange, the core's single-device call)
STRATEGIES: dict[str, ExchangeStrategy] = {s.name: s for s in (Relay(), AllGather(), CP2HP(), FlaCP(), SingleDevice())}

# flash-qla against fla, fitted on GPU runs (benchmarks/reports/): where a rank's scans are too few to fill
# the GPU, or its per-document segments too many, fla's kernels are faster
QLA_MIN_CHAINS = 32           # heads x (local tokens / longest local segment): below, fla's kernels beat qla's
QLA_MAX_INTERLEAVED = 64      # segments a rank holds on per-document zigzag: above, qla's covering passes lose
QLA_SPLIT_CHAINS = 128        # scans a rank runs side by side once its segments are split (about one per SM)
QLA_SPLIT_BELOW = 80          # heads x chains below which the split pays for its maps' passes (benchmarks/reports/)
QLA_SPLIT_MIN_WORK = 1 << 18  # local tokens x heads: below, a split step is bound by its host launches
QLA_SPLIT_MIN_PART = 4096     # tokens: the floor of a part, lowered only while the sequence holds at most...
QLA_SPLIT_MAX_PARTS = 32      # ...this many parts: each adds states to the all-gather and a step to its fold
# the cut of the zigzag middle rank's segment on fla's core (one sequence, predicted W = 8 and 16 runs): parts of
# 8192 tokens measured faster (KDA, 128k at W = 8), parts of 4096 slower (W = 16: a rank's step bound by launches)
FLA_SPLIT_MIN_PART = 8192     # tokens
# fla's CP call against our KDA step on the contiguous layout, measured in the KDA mixers (benchmarks/reports/):
# faster or level where a rank holds 8k tokens (our step host-bound), level at 16k, level or slower at 64k
FLA_CP_MAX_LOCAL = 16384      # tokens a rank


@dataclass(frozen=True)
class Dispatch:
    """What one call runs."""
    core: str          # reference | fla | qla
    strategy: str      # relay | gather | cp2hp | fla-cp | none (no exchange: the core's single-device call)
    max_segment: int   # local segments split into parts of at most this many tokens (0: not split)
    layout: str = ""   # the layout the exchange runs in, the stream moved there and back ("": the plan's)

    def describe(self) -> str:
        """``strategy S, core C`` as the ``KCP active`` line prints it."""
        core = {"reference": "reference (PyTorch)", "fla": "fla", "qla": "flash-qla"}[self.core]
        strategy = {"none": "none (the core's single-device call)",
                    "fla-cp": "fla-cp (fla's own CP call)"}.get(self.strategy, self.strategy)
        split = f", segments split into parts of {self.max_segment} tokens" if self.max_segment else ""
        moved = f", in the {self.layout} layout (the op's inputs moved there and back)" if self.layout else ""
        return f"strategy {strategy}, core {core}{split}{moved}"

    def exchange(self) -> ExchangeStrategy:
        """The strategy object that runs this decision (looked up at each call, so tests may swap one in)."""
        inner = STRATEGIES[self.strategy]
        return RelayoutExchange(inner, self.layout, self.max_segment) if self.layout else inner


def decide(plan: KCPPlan, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, backend: str = "auto",
           strategy: str = "auto", max_segment: int | None = None,
           initial_state: torch.Tensor | None = None) -> Dispatch:
    """The :class:`Dispatch` of ``gated_delta_rule`` for these arguments (see the module docstring).

    Args:
        q: ``[1, T, H, K]``; v: ``[1, T, HV, V]``; g: ``[1, T, HV]`` (GDN) or ``[1, T, HV, K]`` (KDA):
            only their device, dtype and shapes are read.
        backend: ``auto`` | ``reference`` | ``fla`` | ``qla``.
        strategy: ``auto`` | ``relay`` | ``gather`` | ``cp2hp`` | ``convert`` | ``fla-cp``.
        max_segment: None (the kernels' pick), 0 (never split) or a length.
        initial_state: the call's, or None: only whether one is passed is read.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown KCP backend {backend!r}: choose one of {BACKENDS}")
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown KCP exchange strategy {strategy!r}: choose one of {STRATEGY_NAMES}")
    if max_segment is not None and max_segment < 0:
        raise ValueError(f"max_segment must be >= 0 (0: segments not split; None: the kernels' pick), "
                         f"got {max_segment}")
    return _decide(plan, q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]), v.shape[2], q.shape[2], backend,
                   strategy, max_segment, (os.environ.get("KCP_STRATEGY"), os.environ.get(CONVERT_ENV)),
                   initial_state is None and not capturing())


@functools.lru_cache(maxsize=256)
def _decide(plan, device, dtype, kda, head_dims, value_heads, qk_heads, backend, strategy, max_segment,
            forced, peer_calls=False) -> Dispatch:
    """``peer_calls``: the call may run a peer's call instead of our step, the single-device call on head
    shards or fla's CP call (it passes no initial state and is not being captured)."""
    cuda, W = device.type == "cuda", plan.world_size
    if strategy == "fla-cp" and W > 1:
        if not cuda or backend not in ("auto", "fla") or max_segment:
            raise ValueError("strategy 'fla-cp' is fla's own CP call: it runs fla's kernels on CUDA, its segments "
                             "whole: use backend 'auto' or 'fla' and no max_segment, or a KCP strategy (relay, gather)")
        return Dispatch("fla", "fla-cp", 0)
    if strategy == "fla-cp":
        strategy = "auto"                # one rank: nothing to exchange
    if strategy == "cp2hp" and W > 1:
        if max_segment:
            raise ValueError("max_segment splits KCP's segments and strategy 'cp2hp' has none: drop it, or use a KCP "
                             "strategy")
        return Dispatch("fla" if backend == "auto" and cuda else "reference" if backend == "auto" else backend,
                        "cp2hp", 0)
    if strategy == "cp2hp":
        strategy = "auto"                # one rank: nothing to spread over heads
    if W > 1 and strategy in ("auto", "convert") and plan.layout != "contiguous":
        moved = dataclasses.replace(_decide(target_plan(plan, "contiguous"), device, dtype, kda, head_dims, value_heads,
                                            qk_heads, backend, "auto", max_segment, forced,
                                            peer_calls and strategy == "auto"), layout="contiguous")
        if strategy == "convert":
            return moved
        stay = _decide(plan, device, dtype, kda, head_dims, value_heads, qk_heads, backend, "stay", max_segment, forced)
        cu, local = plan.global_cu_seqlens, -(-plan.global_cu_seqlens[-1] // W)
        moves = functools.partial(convert_pays, cu, plan.layout, W, value_heads, head_dims[1],
                                  op_bytes_per_token(qk_heads, value_heads, head_dims, kda, dtype), 4)
        heads = None
        if backend == "auto" and peer_calls and forced == (None, None) and max_segment is None and \
                not (qk_heads % W or value_heads % W):
            heads = Dispatch("reference" if not cuda else "qla" if qla_runs(device, dtype, kda, head_dims) else "fla",
                             "cp2hp", 0)
            # its single-device call keeps a rank's parallelism (scans side by side) only where no document
            # is longer than a rank's share; there it is weighed at its own price
            if max(b - a for a, b in zip(cu, cu[1:])) <= local and \
                    moves(target="heads", core_saves=core_saving(stay.core, heads.core, local, value_heads,
                                                                 head_dims[1])):
                return heads
        if not moves(core_saves=core_saving(stay.core, moved.core, local, value_heads, head_dims[1])):
            return stay
        return heads or moved
    if strategy == "auto" and kda and cuda and W > 1 and backend == "auto" and max_segment is None and peer_calls \
            and forced[0] is None and fla_cp_pays(plan):
        return Dispatch("fla", "fla-cp", 0)
    if strategy in ("convert", "stay"):
        strategy = "auto"                # nothing to convert, or the layout kept
    if backend == "auto" and max_segment is None and W == 1 and cuda:
        return Dispatch("fla", "none", 0)

    def qla_here():
        return qla_runs(device, dtype, kda, head_dims)
    kernels_pick = max_segment is None
    if max_segment is None:
        qla = backend == "qla" or backend == "auto" and cuda and qla_here()
        max_segment = qla_max_segment(plan, value_heads) if qla and strategy != "relay" else 0
    if max_segment:
        if strategy == "relay":
            raise ValueError("segments split by max_segment are chained through the all-gather's fold: use "
                             "strategy='gather' (or 'auto'), or max_segment=0 for the relay")
        if backend == "auto":
            backend = "reference" if not cuda else "qla" if qla_here() else "fla"
        return Dispatch(backend, "gather", max_segment)
    name = choose(plan, value_heads) if strategy == "auto" else strategy
    maps = name == "gather" and W > 1 and needs_maps(plan.global_cu_seqlens, plan.layout, W)
    if backend == "auto":
        if not cuda:
            return Dispatch("reference", name, 0)
        backend = "qla" if not maps and qla_worth(plan, value_heads) and qla_here() else "fla"
    if backend == "qla" and maps and strategy == "auto":
        name = "relay"                   # qla's all-gather with maps lost to its relay on the GPU runs
    return Dispatch(backend, name, fla_max_segment(plan) if kernels_pick and backend == "fla" and maps else 0)


def op_bytes_per_token(qk_heads: int, value_heads: int, head_dims: tuple[int, int], kda: bool,
                       dtype: torch.dtype) -> int:
    """Bytes per token the op's conversion moves in a step: q and k (``qk_heads``), v, g (fp32), beta and o
    (``value_heads``) forward, their gradients backward."""
    K, V = head_dims
    e = torch.finfo(dtype).bits // 8
    return 2 * (qk_heads * 2 * K * e + value_heads * ((2 * V + 1) * e + (K if kda else 1) * 4))


def fla_cp_pays(plan: KCPPlan) -> bool:
    """Whether fla's CP call runs this KDA plan faster than our step: the contiguous layout, no document
    longer than a rank's share (so at most one crosses each rank edge, as in the measured packs), at most
    ``FLA_CP_MAX_LOCAL`` tokens a rank (where our step waits on its host)."""
    cu, W = plan.global_cu_seqlens, plan.world_size
    share = -(-cu[-1] // W)
    return plan.layout == "contiguous" and not plan.max_segment and share <= FLA_CP_MAX_LOCAL and \
        max(b - a for a, b in zip(cu, cu[1:])) <= share


def qla_worth(plan: KCPPlan, value_heads: int) -> bool:
    """Whether flash-qla's fused kernels beat fla's on this plan. qla runs a segment's state pass and
    its output as one scan per head, so a rank's time is at least its longest segment's scan: with
    few heads and one long segment a rank it is latency-bound. On per-document zigzag its state passes
    cover the whole range between the segments that need them, which loses with many documents."""
    return _qla_worth(plan.global_cu_seqlens, plan.layout, plan.world_size, value_heads)


@functools.lru_cache(maxsize=256)
def _qla_worth(cu_seqlens: tuple[int, ...], layout: str, world_size: int, value_heads: int) -> bool:
    plans = all_plans(cu_seqlens, layout, world_size)
    chains = min(p.num_local_tokens / max(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])) for p in plans)
    if value_heads * chains < QLA_MIN_CHAINS:
        return False
    return layout != "zigzag_per_doc" or max(p.num_segments for p in plans) <= QLA_MAX_INTERLEAVED


def qla_max_segment(plan: KCPPlan, value_heads: int) -> int:
    """Where flash-qla's scans are latency-bound enough that the split's extra passes pay (heads x
    chains below ``QLA_SPLIT_BELOW``: one or two long segments a rank, even at 64 heads), the part
    length (a multiple of the 64-token chunk) that splits the busiest rank's stream into
    ``QLA_SPLIT_CHAINS`` scans; 0 where no split is needed or none pays (a step too small to be
    anything but host-bound, or no segment longer than that part or ``QLA_SPLIT_MIN_PART``). Parts are at least
    ``QLA_SPLIT_MIN_PART`` long, or a ``QLA_SPLIT_MAX_PARTS``-th of the sequence where that is
    shorter: every part's state travels in the all-gather to every rank and steps its fold, so
    shorter parts paid on the GPU runs where the sequence held 16 of them (W = 2 and 4) and lost
    where it held 64 (W = 8, predicted; benchmarks/reports/). On one long sequence, flash-qla's own
    intra-GPU split (``autocp.decide``, its fitted kernel-time model) picks parts of the same order."""
    return _qla_max_segment(plan.global_cu_seqlens, plan.layout, plan.world_size, value_heads)


@functools.lru_cache(maxsize=256)
def _qla_max_segment(cu_seqlens: tuple[int, ...], layout: str, world_size: int, value_heads: int) -> int:
    plans = all_plans(cu_seqlens, layout, world_size)
    longest = max(max(b - a for a, b in zip(p.cu_seqlens, p.cu_seqlens[1:])) for p in plans)
    chains = min(p.num_local_tokens for p in plans) / longest
    tokens = max(p.num_local_tokens for p in plans)
    if value_heads * chains >= QLA_SPLIT_BELOW or tokens * value_heads < QLA_SPLIT_MIN_WORK or \
            layout == "zigzag_per_doc" and max(p.num_segments for p in plans) > QLA_MAX_INTERLEAVED:
        return 0
    part = -(-tokens * value_heads // (QLA_SPLIT_CHAINS * 64)) * 64
    if max(part, QLA_SPLIT_MIN_PART) >= longest:
        return 0
    return max(part, min(QLA_SPLIT_MIN_PART, -(-cu_seqlens[-1] // (QLA_SPLIT_MAX_PARTS * 64)) * 64))


def fla_max_segment(plan: KCPPlan) -> int:
    """The part length that halves the zigzag middle rank's segment of one sequence under the all-gather on
    fla's kernels; 0 elsewhere. In both zigzag layouts rank W - 1 holds chunks W - 1 and W, neighbours in
    the stream, as one segment twice as long as any other rank's. fla's state passes run a program per
    segment, head and value block along its chunks, so that rank's maps pass (M beside H), state pass
    and state-gradient pass take twice as long as the others', whose two segments run side by side,
    and every rank waits for it at the all-gathers. Cut at the chunk length, its segment runs as two
    parts side by side, which the fold chains (one step more); every other segment stays whole. From
    W = 3, where the other middle ranks export two states each way, the exchange keeps its slots; at
    W = 2 the middle rank would export two states where it exports one, doubling the all-gather: no cut.
    Parts of at least ``FLA_SPLIT_MIN_PART`` tokens: shorter ones leave a rank's step bound by its
    launches, where the cut's extra part costs more than its passes save. One sequence only, as
    measured (benchmarks/reports/): with packed documents a rank's passes run many segments side by side,
    and the longest is no longer the rank's time."""
    cu, W = plan.global_cu_seqlens, plan.world_size
    if plan.layout == "contiguous" or W < 3 or len(cu) != 2:
        return 0
    part = cu[-1] // (2 * W)
    return part if part >= FLA_SPLIT_MIN_PART else 0


def build_core(name: str, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor):
    """The :class:`~megatron_kcp.kernels.core.LocalCore` called ``name``, after its environment check."""
    if name == "qla":
        from megatron_kcp.kernels import core_qla
        return core_qla.core(q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]))
    if name == "fla":
        from megatron_kcp.kernels import core_fla
        return core_fla.core(kda=g.dim() == 4, device=q.device)
    from megatron_kcp.kernels.core_reference import ReferenceCore
    return ReferenceCore()
