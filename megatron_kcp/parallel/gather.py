"""All-gather: every rank summarises what it hands on, one all-gather per direction, then a fold.

Forward, each segment with a successor exports one ``[HV, K, V + K]`` slot: a segment that starts
its sequence here exports its true final state ``[S | 0]`` (a state pass: its initial state is
known); one that continues a sequence exports its affine map ``[H | M]`` (``S_out = M S_in + H``,
fla's CP pre-process). After the all-gather every receiving segment folds the slots of the pieces
before it, ``S = M_j S + H_j`` from the sequence start, and the local pass runs once. Backward is
the mirror image with ``[dH | M^T]``: dH from a state-gradient pass with a zero final-state
gradient, M^T from the forward's M. All ranks work at once, so the price is the M pass, not
latency: the strategy for many ranks.
"""
from __future__ import annotations

import torch

from megatron_kcp.parallel.comm import all_gather
from megatron_kcp.parallel.plan import KCPPlan


def fold(gathered: torch.Tensor, chains, out: torch.Tensor) -> None:
    """``out[c.segment] = fold over c.sources`` for every chain, batched over chains step by step
    (at most 2W - 1 steps whatever the number of documents). ``gathered`` ``[W, slots, HV, K, V+K]``,
    fp32 products in full fp32 (no TF32: the chains carry state across the whole sequence)."""
    if not chains:
        return
    V = gathered.shape[-1] - gathered.shape[-2]
    flat = gathered.flatten(0, 1)
    slots = gathered.shape[1]
    rows = [[r * slots + s for r, s in c.sources] for c in chains]
    S = flat[torch.tensor([r[0] for r in rows], device=flat.device), ..., :V].clone()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for j in range(1, max(map(len, rows))):
            live = [c for c, r in enumerate(rows) if len(r) > j]
            src = flat[torch.tensor([rows[c][j] for c in live], device=flat.device)]
            idx = torch.tensor(live, device=flat.device)
            S[idx] = torch.matmul(src[..., V:], S[idx]) + src[..., :V]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out[[c.segment for c in chains]] = S


def _span(segs):
    return (min(segs), max(segs) + 1) if segs else (0, 0)


class AllGather:
    name = "gather"

    def forward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor):
        """(output, the transitions M of the segments that continue a sequence both ways: their M^T is
        the backward's export); fills ``h0`` with the folded states."""
        n = plan.num_segments
        if not plan.is_local:
            HV, K, V = h0.shape[1:]
            slot = {s: j for j, s in enumerate(plan.send_fwd)}
            buf = h0.new_zeros(plan.num_slots_fwd, HV, K, V + K)
            starts = [s for s in plan.send_fwd if plan.pred[s] is None]
            middle = [s for s in plan.send_fwd if plan.pred[s] is not None]
            if starts:
                lo, hi = _span(starts)
                _, ht = core.state(P, lo, hi, h0[lo:hi])
                buf[[slot[s] for s in starts], ..., :V] = ht[[s - lo for s in starts]]
            M = None
            if middle:
                lo, hi = _span(middle)
                maps = core.maps(P, lo, hi)[[s - lo for s in middle]]
                buf[[slot[s] for s in middle]] = maps
                M = maps[..., V:]
            fold(all_gather(buf, group), plan.recv_fwd, h0)
        else:
            M = None
        st, _ = core.state(P, 0, n, h0)
        return core.output(P, 0, n, st), M

    def backward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor, do: torch.Tensor, M):
        n = plan.num_segments
        dht = torch.zeros_like(h0)
        if not plan.is_local:
            HV, K, V = h0.shape[1:]
            buf = h0.new_zeros(plan.num_slots_bwd, HV, K, V + K)
            if plan.send_bwd:
                lo, hi = _span(plan.send_bwd)
                _, dH = core.backward_state(P, core.backward_prepare(P, lo, hi, h0[lo:hi], do), dht[lo:hi])
                buf[:len(plan.send_bwd), ..., :V] = dH[[s - lo for s in plan.send_bwd]]
            # segments that also export forward continue their sequence both ways: their M^T folds
            middle = [s for s in plan.send_fwd if plan.pred[s] is not None]
            slot = {s: j for j, s in enumerate(plan.send_bwd)}
            if middle:
                buf[[slot[s] for s in middle], ..., V:] = M.transpose(-1, -2)
            fold(all_gather(buf, group), plan.recv_bwd, dht)
        bst, dh0 = core.backward_state(P, core.backward_prepare(P, 0, n, h0, do), dht)
        return core.backward_rest(P, 0, n, bst), dh0
