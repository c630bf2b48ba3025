"""fla's own CP call as a strategy: on the contiguous layout, ``chunk_kda`` / ``chunk_gated_delta_rule``
with fla's ``build_cp_context`` of the plan (for GDN on fla's kernels: flash-qla refuses a CP context).

That is the core of Megatron-LM dev's scheme, which converts a packed batch to the contiguous layout
and hands it to fla. There, with documents, at most one document crosses each rank edge, and fla's
pre-process exports its state before the rank's whole stream runs in one call: the work of our
all-gather step, issued by fewer launches and less Python. Where a rank holds few tokens the step
waits on its host, and fla's call is the faster: the default picks it for KDA there
(:func:`fla_cp_pays`, fitted on the KDA mixers' measured rows, which differ
only in this call); it also runs where asked for (``strategy="fla-cp"``).

fla's CP call takes no initial state, and is not run under CUDA graph capture (its rank metadata
would have to be refreshed in device buffers before each replay).
"""
from __future__ import annotations

import functools

import torch

from megatron_kcp.calibration import CALIBRATION
from megatron_kcp.parallel import registry
from megatron_kcp.plan import KCPPlan, capturing
from megatron_kcp.parallel.strategy import TAKEN, ExchangeStrategy


@functools.lru_cache(maxsize=64)
def context(plan: KCPPlan, group, device: torch.device):
    """fla's CP context of this plan's stream (built once: it reads the global cu_seqlens on the host)."""
    from fla.ops.cp import build_cp_context
    cu = torch.tensor(plan.global_cu_seqlens)
    return build_cp_context(cu.to(device), group=group, cu_seqlens_cpu=cu, layout="contiguous")


def fla_cp_pays(plan: KCPPlan) -> bool:
    """Whether fla's CP call runs this KDA plan faster than our step: the contiguous layout, no document
    longer than a rank's share (so at most one crosses each rank edge, as in the measured packs), at most
    ``CALIBRATION.fla_cp_max_local`` tokens a rank (where our step waits on its host)."""
    cu, W = plan.global_cu_seqlens, plan.world_size
    share = -(-cu[-1] // W)
    return plan.layout == "contiguous" and not plan.max_segment and share <= CALIBRATION.fla_cp_max_local and \
        max(b - a for a, b in zip(cu, cu[1:])) <= share


class FlaCP(ExchangeStrategy):
    """Where named (on CUDA, fla's kernels, segments whole), and under the default for KDA where
    :func:`fla_cp_pays` and the call may run a peer's call (no initial state, no capture), with no backend,
    ``max_segment`` or ``KCP_STRATEGY`` named. Where it applies it is taken (``TAKEN``)."""
    name = "fla-cp"
    order = 3

    def applicable(self, problem):
        if problem.strategy == self.name:
            return problem.cuda and problem.core in ("auto", "fla") and not problem.max_segment
        return problem.strategy == "auto" and problem.kda and problem.cuda and problem.world_size > 1 and \
            problem.core == "auto" and problem.max_segment is None and problem.peer_calls and \
            problem.options.strategy is None and fla_cp_pays(problem.plan)

    def cost(self, problem):
        return TAKEN

    def refusal(self, problem):
        return ("strategy 'fla-cp' is fla's own CP call: it runs fla's kernels on CUDA, its segments whole: use "
                "backend 'auto' or 'fla' and no max_segment, or a KCP strategy (relay, gather)")

    def pick(self, problem):
        return "fla", 0

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


registry.register(FlaCP())
