"""Which local core, exchange strategy, split and layout one call runs: one cached decision per problem, read
by the op and by the ``KCP active`` line alike.

The problem (:class:`megatron_kcp.problem.Problem`) holds only what every rank of the CP group shares, so all
ranks decide alike. The rules live with the cores (:mod:`megatron_kcp.kernels.registry`: what each runs on and
the traits the cost model reads) and the strategies (:mod:`megatron_kcp.parallel.strategy`: ``applicable``,
``cost``, ``pick``); the numbers are :mod:`megatron_kcp.calibration`'s. :func:`decide`:

1. The layout move (``strategy="auto"`` or ``"convert"``, CP > 1, a zigzag layout): the cheapest of staying,
   moving to the contiguous layout and back, and (where the heads divide over the ranks, no document is longer
   than a rank's share and nothing is named or forced) moving to head shards (:func:`cost_model.relayout_net`),
   then the overrides: ``KCP_CONVERT``; where moving to the contiguous layout pays and head shards apply, head
   shards (measured faster or level wherever converting paid, benchmarks/reports/).
2. In the layout: the strategies that are ``applicable``, the cheapest (a peer's call where it applies, else
   the cost model's exchange; ties: the lower ``order``), then ``KCP_STRATEGY`` among the applicable state
   exchanges; the local core and split are the strategy's ``pick``. The split (``max_segment=None``) is the
   core's: the named core's or the first that runs, ahead of the exchange (only the all-gather chains parts).

The public argument that names the local core is ``backend``; internally (``Problem.core``,
``Dispatch.core``) it is the core.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from megatron_kcp.kernels.cores import CORES, first_running
from megatron_kcp.options import Options
from megatron_kcp.parallel.cost_model import core_saving, relayout_net
from megatron_kcp.parallel.exchanges import EXCHANGES, by_order
from megatron_kcp.parallel.relayout_exchange import RelayoutExchange, target_plan
from megatron_kcp.parallel.strategy import ExchangeStrategy, StateExchange
from megatron_kcp.plan import KCPPlan, capturing
from megatron_kcp.problem import Problem

STRATEGY_NAMES = ("auto", "relay", "gather", "cp2hp", "convert", "fla-cp")     # the built-in ones a caller names


def backend_names() -> tuple[str, ...]:
    """What ``backend=`` takes: ``auto`` and every registered core, from the lowest priority up."""
    return ("auto", *(c.name for c in sorted(CORES, key=lambda c: c.priority)))


def strategy_names() -> tuple[str, ...]:
    """What ``strategy=`` takes: the built-in names and every other registered strategy (``none`` is the
    dispatch's own: no exchange)."""
    return (*STRATEGY_NAMES, *(n for n in EXCHANGES.names() if n not in STRATEGY_NAMES and n != "none"))


@dataclass(frozen=True)
class Dispatch:
    """What one call runs."""
    core: str          # the local core (the op's ``backend``): reference | fla | qla | ...
    strategy: str      # relay | gather | cp2hp | fla-cp | none (no exchange: the core's single-device call) | ...
    max_segment: int   # local segments split into parts of at most this many tokens (0: not split)
    layout: str = ""   # the layout the exchange runs in, the stream moved there and back ("": the plan's)

    def describe(self) -> str:
        """``strategy S, core C`` as the ``KCP active`` line prints it."""
        core = CORES[self.core].label
        strategy = {"none": "none (the core's single-device call)",
                    "fla-cp": "fla-cp (fla's own CP call)"}.get(self.strategy, self.strategy)
        split = f", segments split into parts of {self.max_segment} tokens" if self.max_segment else ""
        moved = f", in the {self.layout} layout (the op's inputs moved there and back)" if self.layout else ""
        return f"strategy {strategy}, core {core}{split}{moved}"

    def exchange(self) -> ExchangeStrategy:
        """The strategy object that runs this decision (looked up at each call, so tests may swap one in)."""
        inner = EXCHANGES[self.strategy]
        return RelayoutExchange(inner, self.layout, self.max_segment) if self.layout else inner


def decide(plan: KCPPlan, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, backend: str = "auto",
           strategy: str = "auto", max_segment: int | None = None,
           initial_state: torch.Tensor | None = None) -> Dispatch:
    """The :class:`Dispatch` of ``gated_delta_rule`` for these arguments (see the module docstring).

    Args:
        q: ``[1, T, H, K]``; v: ``[1, T, HV, V]``; g: ``[1, T, HV]`` (GDN) or ``[1, T, HV, K]`` (KDA):
            only their device, dtype and shapes are read.
        backend: the local core, ``auto`` | ``reference`` | ``fla`` | ``qla`` (or a registered core).
        strategy: ``auto`` | ``relay`` | ``gather`` | ``cp2hp`` | ``convert`` | ``fla-cp`` (or a registered one).
        max_segment: None (the kernels' pick), 0 (never split) or a length.
        initial_state: the call's, or None: only whether one is passed is read.
    """
    if backend not in backend_names():
        raise ValueError(f"unknown KCP backend {backend!r}: choose one of {backend_names()}")
    if strategy not in strategy_names():
        raise ValueError(f"unknown KCP exchange strategy {strategy!r}: choose one of {strategy_names()}")
    if max_segment is not None and max_segment < 0:
        raise ValueError(f"max_segment must be >= 0 (0: segments not split; None: the kernels' pick), "
                         f"got {max_segment}")
    return decide_problem(Problem(plan, q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]), v.shape[2],
                                  q.shape[2], backend, strategy, max_segment,
                                  initial_state is None and not capturing(), Options.from_env()))


@functools.lru_cache(maxsize=256)
def decide_problem(p: Problem) -> Dispatch:
    """:func:`decide` on a :class:`Problem`."""
    W = p.world_size
    if W == 1 and p.strategy in ("fla-cp", "cp2hp"):
        p = dataclasses.replace(p, strategy="auto")          # one rank: nothing to exchange
    if W > 1 and p.strategy in ("auto", "convert") and p.plan.layout != "contiguous":
        return _layout_move(p)
    if p.strategy == "convert":
        p = dataclasses.replace(p, strategy="auto", peer_calls=False)     # nothing to move
    return _in_layout(p)


CORES.watch(decide_problem.cache_clear)        # a core or strategy registered, removed or swapped: decide anew
EXCHANGES.watch(decide_problem.cache_clear)


def _layout_move(p: Problem) -> Dispatch:
    """Stay, move to the contiguous layout, or move to head shards (step 1 of the module docstring)."""
    moved = dataclasses.replace(_in_layout(dataclasses.replace(
        p, plan=target_plan(p.plan, "contiguous"), strategy="auto", peer_calls=p.peer_calls and p.strategy == "auto")),
        layout="contiguous")
    if p.strategy == "convert":
        return moved
    stay = _in_layout(dataclasses.replace(p, strategy="auto", peer_calls=False))
    cu, layout, W, local, V = p.plan.global_cu_seqlens, p.plan.layout, p.world_size, p.local_share, p.head_dims[1]
    net = functools.partial(relayout_net, cu, layout, W, p.value_heads, V,
                            op_bytes_per_token(p.qk_heads, p.value_heads, p.head_dims, p.kda, p.dtype), 4)
    heads = None
    if p.core == "auto" and p.peer_calls and p.options.strategy is None and p.options.convert is None and \
            p.max_segment is None and not (p.qk_heads % W or p.value_heads % W):
        heads = Dispatch(first_running(p).name, "cp2hp", 0)
    candidates = [(0.0, stay), (net(core_saves=core_saving(stay.core, moved.core, local, p.value_heads, V)), moved)]
    # on head shards the single-device call keeps a rank's parallelism (scans side by side) only where no
    # document is longer than a rank's share: there it is weighed at its own price
    if heads is not None and p.longest_document <= local:
        candidates.insert(1, (net(target="heads", core_saves=core_saving(stay.core, heads.core, local,
                                                                         p.value_heads, V)), heads))
    forced = p.options.forced_relayout()
    if forced is not None:
        return moved if forced else stay
    pick = min(candidates, key=lambda c: c[0])[1]
    return heads if pick is moved and heads is not None else pick


def _in_layout(p: Problem) -> Dispatch:
    """The strategy, core and split in the plan's layout (step 2 of the module docstring)."""
    if p.max_segment is not None:
        p = dataclasses.replace(p, split=p.max_segment)
    elif p.strategy != "relay":
        lead = CORES[p.core] if p.core != "auto" else first_running(p)
        p = dataclasses.replace(p, split=lead.split(p))
    candidates = [s for s in by_order() if s.applicable(p)]
    if not candidates:
        raise ValueError(EXCHANGES[p.strategy].refusal(p))
    pick = candidates[0] if len(candidates) == 1 else min(candidates, key=lambda s: s.cost(p))
    if p.strategy == "auto" and not p.split and isinstance(pick, StateExchange):
        forced = p.options.forced_strategy()
        if forced and EXCHANGES[forced] in candidates:
            pick = EXCHANGES[forced]
    return _dispatch(pick, p)


def _dispatch(strategy: ExchangeStrategy, p: Problem) -> Dispatch:
    core, split = strategy.pick(p)
    return Dispatch(core, strategy.name, split)


def op_bytes_per_token(qk_heads: int, value_heads: int, head_dims: tuple[int, int], kda: bool,
                       dtype: torch.dtype) -> int:
    """Bytes per token the op's conversion moves in a step: q and k (``qk_heads``), v, g (fp32), beta and o
    (``value_heads``) forward, their gradients backward."""
    K, V = head_dims
    e = torch.finfo(dtype).bits // 8
    return 2 * (qk_heads * 2 * K * e + value_heads * ((2 * V + 1) * e + (K if kda else 1) * 4))


def build_core(name: str, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor):
    """The :class:`~megatron_kcp.kernels.core.LocalCore` called ``name`` (the registry's), after its
    environment check."""
    return CORES[name].build(q.device, q.dtype, g.dim() == 4, (q.shape[-1], v.shape[-1]))
