"""The base of the exchange strategies: how one CP step gets across ranks what a rank's shard needs.

A strategy runs the gated delta rule of this rank's shard of the packed stream, given a local core
(:class:`megatron_kcp.kernels.core.LocalCore`). Two families:

* :class:`StateExchange`: the sequence stays sharded and fp32 states (or their affine maps) cross
  ranks; the subclass says in ``forward`` / ``backward`` what moves when, and
  :class:`megatron_kcp.parallel.step.KCPStep` makes it one autograd step
  (``relay.Relay``, ``gather.AllGather``).
* a strategy that moves the inputs instead and runs the core's single-device call
  (``cp2hp.CP2HP``: all-to-all to head shards; ``single.SingleDevice``: nothing to move).

Each strategy also says where the op's dispatch may run it and what it costs: ``applicable(problem)``
(a :class:`~megatron_kcp.problem.Problem`: by default only where it is named), ``cost(problem)`` (modelled
seconds a step adds; ``TAKEN`` for a peer's call that is taken wherever it applies: a measured threshold, not
a modelled time), ``refusal(problem)`` (the error where it is named but cannot run) and ``pick(problem)``
(the local core it runs where ``backend="auto"``, and the split). A new strategy is one file with one
subclass and one line, ``registry.register(MyStrategy())`` (:mod:`megatron_kcp.parallel.registry`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from megatron_kcp.kernels.core import LocalCore, Prepared
from megatron_kcp.kernels.cores import CORES, by_priority, first_running
from megatron_kcp.plan import KCPPlan
from megatron_kcp.parallel.step import KCPStep
from megatron_kcp.problem import Problem

TAKEN = float("-inf")      # the cost of a peer's call where it applies: taken ahead of any modelled exchange


class ExchangeStrategy(ABC):
    name: ClassVar[str]
    order: ClassVar[int] = 100     # breaks a tie of costs: the lower first

    def applicable(self, problem: Problem) -> bool:
        """Whether the dispatch may run this strategy on ``problem`` (by default: where it is named)."""
        return problem.strategy == self.name

    def cost(self, problem: Problem) -> float:
        """Modelled seconds this strategy adds to a step of ``problem`` (compared among the applicable ones)."""
        return 0.0

    def refusal(self, problem: Problem) -> str:
        """The error where this strategy is named but not applicable."""
        return f"strategy {self.name!r} does not run this problem: use strategy 'auto'"

    def pick(self, problem: Problem) -> tuple[str, int]:
        """(the local core this strategy runs, the part length its segments are split into, 0: none): the
        core named, else the first that runs the problem."""
        return (problem.core if problem.core != "auto" else first_running(problem).name), problem.split

    def check(self, q: torch.Tensor, v: torch.Tensor, plan: KCPPlan, initial_state: torch.Tensor | None) -> None:
        """ValueError naming the fix where this strategy cannot run the problem (before any kernel)."""

    @abstractmethod
    def apply(self, core: LocalCore, q, k, v, g, beta, plan: KCPPlan, group, *, scale: float,
              initial_state: torch.Tensor | None, use_qk_l2norm: bool) -> torch.Tensor:
        """o ``[1, T, HV, V]`` of this rank's shard, equal to the single-device run forward and backward.

        Args:
            q, k: ``[1, T, H, K]``; v: ``[1, T, HV, V]``; g: ``[1, T, HV]`` (GDN) or ``[1, T, HV, K]``
                (KDA), natural-log decay; beta: ``[1, T, HV]``; T: this rank's tokens.
            plan: this rank's plan; group: the CP process group.
            initial_state: ``[N, HV, K, V]``, one per global sequence, or None.
        """


class StateExchange(ExchangeStrategy):
    """Sequence-sharded: the core's passes run where the tokens are, and states cross ranks."""

    def uses_maps(self, problem: Problem) -> bool:
        """Whether some rank runs a transition-map pass on ``problem``."""
        return False

    def pick(self, problem: Problem) -> tuple[str, int]:
        """The core named, else: on a split plan, the first that runs; elsewhere the first that runs and is
        worth it (where this exchange needs transition maps, one whose ``gather_maps`` allows them). The
        split: the plan's, else the core's cut under transition maps (where no split was named)."""
        if problem.split:
            return super().pick(problem)
        maps = self.uses_maps(problem)
        core = problem.core if problem.core != "auto" else next(
            c.name for c in by_priority() if c.runs(problem) and c.worth(problem) and (c.gather_maps or not maps))
        return core, CORES[core].maps_cut(problem) if maps and problem.max_segment is None else 0

    def apply(self, core, q, k, v, g, beta, plan, group, *, scale, initial_state, use_qk_l2norm):
        return KCPStep.apply(q, k, v, g, beta, initial_state, plan, group, scale, use_qk_l2norm, core, self)

    @abstractmethod
    def forward(self, core: LocalCore, P: Prepared, plan: KCPPlan, group, h0: torch.Tensor):
        """(o of the local stream, what the backward needs besides ``P`` or None). Fills ``h0`` (every
        local segment's initial state, fp32; the user's where a sequence starts) as states arrive."""

    @abstractmethod
    def backward(self, core: LocalCore, P: Prepared, plan: KCPPlan, group, h0: torch.Tensor, do: torch.Tensor,
                 extra) -> tuple[tuple, torch.Tensor]:
        """(gradients of the prepared q, k, v, g, beta; initial-state gradients ``[segments, HV, K, V]``,
        rows set where a segment starts its sequence)."""
