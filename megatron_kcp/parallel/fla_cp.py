"""fla's own CP call as a strategy: on the contiguous layout, ``chunk_kda`` / ``chunk_gated_delta_rule``
with fla's ``build_cp_context`` of the plan (for GDN on fla's kernels: flash-qla refuses a CP context).

That is the core of Megatron-LM dev's scheme, which converts a packed batch to the contiguous layout
and hands it to fla. There, with documents, at most one document crosses each rank edge, and fla's
pre-process exports its state before the rank's whole stream runs in one call: the work of our
all-gather step, issued by fewer launches and less Python. Where a rank holds few tokens the step
waits on its host, and fla's call is the faster: the default picks it for KDA there
(:func:`megatron_kcp.ops.dispatch.fla_cp_pays`, fitted on the KDA mixers' measured rows, which differ
only in this call); it also runs where asked for (``strategy="fla-cp"``).

fla's CP call takes no initial state, and is not run under CUDA graph capture (its rank metadata
would have to be refreshed in device buffers before each replay).
"""
from __future__ import annotations

import functools

import torch

from megatron_kcp.plan import KCPPlan, capturing
from megatron_kcp.parallel.strategy import ExchangeStrategy


@functools.lru_cache(maxsize=64)
def context(plan: KCPPlan, group, device: torch.device):
    """fla's CP context of this plan's stream (built once: it reads the global cu_seqlens on the host)."""
    from fla.ops.cp import build_cp_context
    cu = torch.tensor(plan.global_cu_seqlens)
    return build_cp_context(cu.to(device), group=group, cu_seqlens_cpu=cu, layout="contiguous")


class FlaCP(ExchangeStrategy):
    name = "fla-cp"

    def check(self, q, v, plan, initial_state):
        if plan.layout != "contiguous" or plan.max_segment:
            raise ValueError(f"strategy 'fla-cp' is fla's own CP call, which runs the contiguous layout, got "
                             f"{plan.layout!r}{' split by max_segment' if plan.max_segment else ''}: use strategy "
                             "'auto' (it converts there where that pays) or a KCP strategy (relay, gather)")
        if initial_state is not None:
            raise ValueError("strategy 'fla-cp' takes no initial_state (fla's CP call has none): use a KCP strategy "
                             "(auto, relay, gather)")
        if capturing():
            raise ValueError("strategy 'fla-cp' inside a CUDA graph capture: fla's CP call would replay this "
                             "batch's rank metadata; use a KCP strategy (auto, relay, gather) in a graph")

    def apply(self, core, q, k, v, g, beta, plan, group, *, scale, initial_state, use_qk_l2norm):
        return core.cp_call(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                            cp_context=context(plan, group, q.device))
