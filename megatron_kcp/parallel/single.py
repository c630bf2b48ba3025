"""No exchange: without CP (one rank), the core's own single-device call.

That is the call megatron-core's mixer makes without CP (fla's ``chunk_gated_delta_rule`` /
``chunk_kda``; fla hands GDN to flash-qla's call, with its intra-GPU split, where that is installed),
so a KCP mixer at CP = 1 runs exactly what megatron-core's does.
"""
from __future__ import annotations

from megatron_kcp.parallel import registry
from megatron_kcp.parallel.strategy import TAKEN, ExchangeStrategy


class SingleDevice(ExchangeStrategy):
    """On one rank on CUDA wherever neither the core nor a split is named (whatever strategy is: one rank has
    nothing to exchange): fla's single-device call. Where it applies it is taken (``TAKEN``)."""
    name = "none"
    order = 4

    def applicable(self, problem):
        return problem.world_size == 1 and problem.cuda and problem.core == "auto" and problem.max_segment is None

    def cost(self, problem):
        return TAKEN

    def pick(self, problem):
        return "fla", 0

    def check(self, q, v, plan, initial_state):
        if plan.world_size != 1:
            raise ValueError(f"strategy 'none' is the single-device call, but the CP size is {plan.world_size}: "
                             "use a KCP strategy (auto, relay, gather)")

    def apply(self, core, q, k, v, g, beta, plan, group, *, scale, initial_state, use_qk_l2norm):
        return core.single_device(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=plan.cu_seqlens_tensor(q.device),
                                  cu_seqlens_cpu=plan.cu_seqlens_tensor())


registry.register(SingleDevice())
