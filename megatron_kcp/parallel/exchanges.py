"""Every exchange strategy, registered (each in its own module): import this to read a complete
``registry.EXCHANGES``."""
from __future__ import annotations

from megatron_kcp.parallel import cp2hp, fla_cp, gather, relay, single  # noqa: F401  (each registers itself)
from megatron_kcp.parallel.registry import EXCHANGES, by_order, register

__all__ = ["EXCHANGES", "by_order", "register"]
