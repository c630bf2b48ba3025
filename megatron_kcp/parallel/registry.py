"""The exchange strategies by name: each registers itself in its own module with one line,
``registry.register(MyStrategy())``; :mod:`megatron_kcp.parallel.exchanges` imports every strategy module, so
that ``EXCHANGES`` is complete. The op looks a decision's strategy up here at each call (a test may swap one in).
"""
from __future__ import annotations

from megatron_kcp.parallel.strategy import ExchangeStrategy

EXCHANGES: dict[str, ExchangeStrategy] = {}


def register(strategy: ExchangeStrategy) -> ExchangeStrategy:
    """Add a strategy (its name must be new)."""
    if strategy.name in EXCHANGES or strategy.name in ("auto", "convert"):
        raise ValueError(f"an exchange strategy named {strategy.name!r} is registered already")
    EXCHANGES[strategy.name] = strategy
    return strategy


def unregister(name: str) -> None:
    EXCHANGES.pop(name)


def by_order() -> list[ExchangeStrategy]:
    return sorted(EXCHANGES.values(), key=lambda s: s.order)
