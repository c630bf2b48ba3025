"""KCP over the pure-PyTorch core: the CPU path, and the oracle for the fla path's exchange.

Forward: every local segment that continues into a later piece exports its affine state map
``[H | M]`` (from a zero state); ranks all-gather them and fold the maps of the pieces before
each continuing first segment into its true initial state; the local chunked pass then runs
with those states. Backward mirrors it: continuing first segments export ``[dH | M^T]`` (the
state gradient from their own outputs, and the transposed transition), the fold yields each
continuing last segment's final-state gradient, and the local backward runs with it. Only fp32
maps cross ranks; no gradient flows through the exchange itself, because the injected
final-state gradients already carry every later rank's dependence on this one.
"""
from __future__ import annotations

import torch

from megatron_kcp.ops import reference as R
from megatron_kcp.parallel.exchange import fold_backward, fold_forward
from megatron_kcp.parallel.plan import KCPPlan


def _seg(x, plan, i):
    a, b = plan.cu_seqlens[i], plan.cu_seqlens[i + 1]
    return x[:, a:b]


def _core(q, k, v, g, beta, h0, plan, scale, l2):
    return R.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm=l2, cu_seqlens=plan.cu_seqlens_tensor())


def _forward_maps(k, v, g, beta, plan, l2):
    """[H | M] of each exported last segment."""
    maps = [R.affine_state_map(_seg(k, plan, i), _seg(g, plan, i), _seg(beta, plan, i), _seg(v, plan, i), l2)
            for i in plan.send_fwd]
    return _stack(maps, v, k)


def _backward_maps(q, k, v, g, beta, do, plan, scale, l2, fwd_maps):
    """[dH | M^T] of each exported first segment: its state gradient from its own outputs, and its
    transposed transition (taken from the forward maps where the segment exported one)."""
    maps = []
    fwd_slot = {seg: j for j, seg in enumerate(plan.send_fwd)}
    for i in plan.send_bwd:
        args = [_seg(x, plan, i) for x in (q, k, v, g, beta)]
        with torch.enable_grad():
            h = args[2].new_zeros(1, v.shape[2], k.shape[-1], v.shape[-1], dtype=torch.float32, requires_grad=True)
            o, _ = R.chunk_gated_delta_rule(*args, scale=scale, initial_state=h, use_qk_l2norm=l2)
            dH, = torch.autograd.grad(o, h, _seg(do, plan, i))
        if i in fwd_slot:           # a piece that is one segment: its transition is already known
            M = fwd_maps[fwd_slot[i], ..., v.shape[-1]:]
        else:
            M = R.affine_state_map(args[1], args[3], args[4], args[2], l2)[..., v.shape[-1]:]
        maps.append(torch.cat([dH[0].float(), M.transpose(-1, -2).float()], -1))
    return _stack(maps, v, k)


def _stack(maps, v, k):
    if maps:
        return torch.stack([m.float() for m in maps])
    return v.new_zeros(0, v.shape[2], k.shape[-1], v.shape[-1] + k.shape[-1], dtype=torch.float32)


def _local_h0(plan, init, folded):
    """Initial state per local segment: the folded state where a sequence continues, else the
    user's initial state of that sequence (or zero)."""
    if init is None:
        return folded
    h0 = init.float()[list(plan.seg_seq)]
    for c in plan.recv_fwd:
        h0[c.segment] = folded[c.segment]
    return h0


class KCPReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, init, plan: KCPPlan, group, scale, l2):
        with torch.no_grad():
            maps = _forward_maps(k, v, g, beta, plan, l2)
            folded = fold_forward(maps, plan, group, init)
            h0 = _local_h0(plan, init, folded)
            o, _ = _core(q, k, v, g, beta, h0, plan, scale, l2)
        ctx.save_for_backward(q, k, v, g, beta, h0, maps)
        ctx.plan, ctx.group, ctx.scale, ctx.l2, ctx.has_init = plan, group, scale, l2, init is not None
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, h0, maps = ctx.saved_tensors
        plan = ctx.plan
        dht = fold_backward(_backward_maps(q, k, v, g, beta, do, plan, ctx.scale, ctx.l2, maps), plan, ctx.group)
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
            o, ht = _core(*inputs, plan, ctx.scale, ctx.l2)
            grads = torch.autograd.grad((o, ht), inputs, (do, dht))
        dinit = None
        if ctx.has_init:
            # only segments that start their sequence here hold the user's state; a continuing
            # segment's dh0 is already accounted for by the dht injected on earlier ranks
            dinit = grads[5].new_zeros(plan.num_seqs, *grads[5].shape[1:])
            cont = {c.segment for c in plan.recv_fwd}
            for i, n in enumerate(plan.seg_seq):
                if i not in cont:
                    dinit[n] += grads[5][i]
        return (*grads[:5], dinit, None, None, None, None)
