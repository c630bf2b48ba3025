"""The exchange strategies by name: each registers itself in its own module with one line,
``registry.register(MyStrategy())``; :mod:`megatron_kcp.parallel.exchanges` imports every strategy module, so
that ``EXCHANGES`` is complete. The op looks a decision's strategy up here at each call (a test may swap one in:
``EXCHANGES.swapped(...)``).
"""
from __future__ import annotations

from megatron_kcp.parallel.strategy import ExchangeStrategy
from megatron_kcp.registry import Registry

EXCHANGES: Registry[ExchangeStrategy] = Registry("an exchange strategy", reserved=("auto", "convert"))
register, unregister = EXCHANGES.register, EXCHANGES.unregister


def by_order() -> list[ExchangeStrategy]:
    return sorted(EXCHANGES, key=lambda s: s.order)
