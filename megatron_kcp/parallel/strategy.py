"""The base of the exchange strategies: how one CP step gets across ranks what a rank's shard needs.

A strategy runs the gated delta rule of this rank's shard of the packed stream, given a local core
(:class:`megatron_kcp.kernels.core.LocalCore`). Two families:

* :class:`StateExchange`: the sequence stays sharded and fp32 states (or their affine maps) cross
  ranks; the subclass says in ``forward`` / ``backward`` what moves when, and
  :class:`megatron_kcp.parallel.step.KCPStep` makes it one autograd step
  (``relay.Relay``, ``gather.AllGather``).
* a strategy that moves the inputs instead and runs the core's single-device call
  (``cp2hp.CP2HP``: all-to-all to head shards; ``single.SingleDevice``: nothing to move).

A new strategy is one file with one subclass; ``megatron_kcp.ops.dispatch.STRATEGIES`` names it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from megatron_kcp.kernels.core import LocalCore, Prepared
from megatron_kcp.plan import KCPPlan
from megatron_kcp.parallel.step import KCPStep


class ExchangeStrategy(ABC):
    name: ClassVar[str]

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
