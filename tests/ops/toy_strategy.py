"""A toy exchange strategy, to show that a strategy is one file and one registration line: the relay under
another name, applicable (under ``auto`` or named) on the contiguous layout of more than one rank, its segments
whole, and modelled a tenth cheaper than the relay; refused elsewhere.

    with EXCHANGES.registered(toy_strategy.TOY):
        ...
"""
from __future__ import annotations

from megatron_kcp.parallel.relay import Relay

REFUSAL = "strategy 'toy-relay' runs the contiguous layout on more than one rank, unsplit: use strategy 'auto'"


class ToyRelay(Relay):
    name = "toy-relay"
    order = 5

    def applicable(self, problem):
        return problem.strategy in ("auto", self.name) and problem.plan.layout == "contiguous" and \
            problem.world_size > 1 and not problem.split

    def cost(self, problem):
        return 0.9 * super().cost(problem)

    def refusal(self, problem):
        return REFUSAL


TOY = ToyRelay()
