"""Convert: move the inputs to a document-aligned layout, run a state exchange there, move o back.

On Megatron's per-document zigzag every document is a chain over all ranks; in the contiguous
layout at most W - 1 documents cross a rank edge, so the exchange inside (relay or all-gather,
``inner``) moves a few states instead of one per document and direction. The price is two
all-to-alls of the op's inputs and output each way (:mod:`megatron_kcp.parallel.relayout`), which
:func:`megatron_kcp.parallel.cost_model.relayout_pays` weighs. The mixers convert their hidden states
instead (d_model per token, about a sixth of q, k, v, g and beta), and a run of linear layers only
at its edges (:mod:`megatron_kcp.layers.layout`); this strategy is the op's own, for a caller that
hands it the per-document layout.
"""
from __future__ import annotations

from megatron_kcp.plan import KCPPlan, all_plans
from megatron_kcp.parallel.relayout import relayout
from megatron_kcp.parallel.strategy import ExchangeStrategy


def target_plan(plan: KCPPlan, layout: str, max_segment: int = 0) -> KCPPlan:
    """This rank's plan of the same stream in ``layout``."""
    return all_plans(plan.global_cu_seqlens, layout, plan.world_size, plan.conv_kernel_size, max_segment)[plan.rank]


class RelayoutExchange(ExchangeStrategy):
    """``inner`` run in ``layout`` (its segments split by ``max_segment``), the stream moved there and back."""
    name = "convert"

    def __init__(self, inner: ExchangeStrategy, layout: str = "contiguous", max_segment: int = 0):
        self.inner, self.layout, self.max_segment = inner, layout, max_segment

    def check(self, q, v, plan, initial_state):
        self.inner.check(q, v, target_plan(plan, self.layout, self.max_segment), initial_state)

    def apply(self, core, q, k, v, g, beta, plan, group, *, scale, initial_state, use_qk_l2norm):
        there = target_plan(plan, self.layout, self.max_segment)
        cu = plan.global_cu_seqlens
        xs = relayout([x[0] for x in (q, k, v, g, beta)], cu, plan.layout, self.layout, group)
        o = self.inner.apply(core, *(x[None] for x in xs), there, group, scale=scale, initial_state=initial_state,
                             use_qk_l2norm=use_qk_l2norm)
        return relayout([o[0]], cu, self.layout, plan.layout, group)[0][None]
