"""What the dispatch decides on: one frozen record of a call's problem, shared by every rank of the CP group.

The cores' traits (``megatron_kcp.kernels.registry``) and the strategies' ``applicable`` / ``cost``
(``megatron_kcp.parallel.strategy``) read it; ``megatron_kcp.ops.dispatch.decide`` builds it from the op's
arguments. Everything in it is the same on every rank (the global cu_seqlens, layout and CP size, the heads,
head dims, dtype and device kind), so every rank decides alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_kcp.options import Options
from megatron_kcp.plan import KCPPlan


@dataclass(frozen=True)
class Problem:
    """One call's problem (hashable: the dispatch caches its decision on it).

    Args:
        plan: this rank's plan (only what every rank shares is read).
        device: the inputs' device (only its type is read, and by the cores' environment checks);
            dtype: q's dtype.
        kda: a per-key gate (``g`` ``[1, T, HV, K]``); GDN otherwise.
        head_dims: ``(K, V)``; value_heads: HV; qk_heads: H.
        core: the local core asked for (the op's public argument ``backend``): ``auto`` or a core's name.
        strategy: the exchange strategy asked for: ``auto``, ``convert`` or a strategy's name.
        max_segment: the split asked for (None: the kernels' pick; 0: never).
        peer_calls: whether the call may run a peer's call instead of our step (the single-device call on
            head shards, fla's CP call): no initial state is passed and no CUDA graph is being captured.
        options: the environment options (``KCP_STRATEGY``, ``KCP_CONVERT``, ...).
        split: set by the dispatch: the part length the segments are split into (the argument, or the
            kernels' pick), 0 where not split.
    """
    plan: KCPPlan
    device: torch.device
    dtype: torch.dtype
    kda: bool
    head_dims: tuple[int, int]
    value_heads: int
    qk_heads: int
    core: str = "auto"
    strategy: str = "auto"
    max_segment: int | None = None
    peer_calls: bool = False
    options: Options = field(default_factory=Options)
    split: int = 0

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def local_share(self) -> int:
        """Tokens a rank holds: the global tokens over the CP size, rounded up."""
        return -(-self.plan.global_cu_seqlens[-1] // self.plan.world_size)

    @property
    def longest_document(self) -> int:
        cu = self.plan.global_cu_seqlens
        return max(b - a for a, b in zip(cu, cu[1:]))
