"""cp2hp: megatron-core GatedDeltaNet's CP scheme on the op, the baseline KCP is measured against.

One all-to-all of [q|k|v|g|beta] from sequence shards to head shards (each rank: the whole sequence,
H/W heads), the single-device chunk kernel, one all-to-all of o back; backward runs the same two in
reverse. ``kcp.gated_delta_rule(..., strategy="cp2hp")`` runs it under any layout, which gives the
KDA mixer (megatron-core has no KDA module) the same peer as megatron-core's GatedDeltaNet.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x, group):
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Equal blocks along dim 0, block j to rank j. The exchange is its own adjoint, so backward
    sends the gradient through the same all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_to_all(dy, ctx.group), None


class CP2HP:
    """megatron-core GatedDeltaNet's CP on the op: sequence shards -> head shards -> kernel -> back.

    ``plans`` are every rank's zigzag plans: the all-to-all delivers the W shards in rank order,
    ``inv`` puts their tokens back in stream order for the kernel (Megatron's undo of the attention
    load balancing), ``pos`` the other way."""

    def __init__(self, kernel, plans, cu, group, device):
        from megatron_kcp.parallel.plan import local_token_index
        pos = torch.cat([local_token_index(p) for p in plans])     # gathered row -> stream position
        self.pos, self.inv = pos.to(device), torch.argsort(pos).to(device)
        self.cu, self.cu_cpu = torch.tensor(cu, device=device), torch.tensor(cu)
        self.kernel, self.group, self.W = kernel, group, len(plans)

    def __call__(self, q, k, v, g, beta):
        W, (_, Tl, H, _), gdn = self.W, q.shape, g.dim() == 3
        q, k, v, g, beta = SeqToHeads.apply(self, q, k, v, g[..., None] if gdn else g, beta[..., None])
        o = self.kernel(q, k, v, g[..., 0] if gdn else g, beta[..., 0], self.cu, self.cu_cpu)[0]   # [T, H/W, V]
        o = o.index_select(0, self.pos).view(W, Tl, H // W, -1)
        return AllToAll.apply(o, self.group).transpose(0, 1).reshape(1, Tl, H, -1)

    def to_heads(self, xs):
        """[1, T/W, H, d_i] (this rank's tokens, all heads) -> [1, T, H/W, d_i] (all tokens, my heads)."""
        W, (_, Tl, H, _), wire = self.W, xs[0].shape, xs[0].dtype
        bits = [x[0] if x.dtype == wire else x[0].view(wire) for x in xs]
        y = torch.cat([x.reshape(Tl, W, H // W, -1) for x in bits], -1).transpose(0, 1)       # [W, T/W, H/W, D]
        y = _all_to_all(y, self.group).flatten(0, 1).index_select(0, self.inv)
        return [t.contiguous().view(x.dtype)[None] for t, x in zip(y.split([b.shape[-1] for b in bits], -1), xs)]

    def to_seq(self, grads, meta):
        """The way back, for the gradients: [1, T, H/W, d_i] -> [1, T/W, H, d_i]; ``meta`` holds the
        inputs' (shape, dtype), the first one's dtype being the wire's."""
        W, (_, Tl, H, _), wire = self.W, meta[0][0], meta[0][1]
        bits = [(d if d is not None else torch.zeros(1, Tl * W, H // W, s[-1], dtype=t, device=self.pos.device))[0]
                for d, (s, t) in zip(grads, meta)]
        bits = [d if d.dtype == wire else d.view(wire) for d in bits]
        y = torch.cat(bits, -1).index_select(0, self.pos).view(W, Tl, H // W, -1)
        y = _all_to_all(y, self.group).transpose(0, 1)                                          # [T/W, W, H/W, D]
        return [t.reshape(Tl, H, -1).contiguous().view(dt)[None]
                for t, (_, dt) in zip(y.split([b.shape[-1] for b in bits], -1), meta)]


class SeqToHeads(torch.autograd.Function):
    """CP2HP.to_heads with its exact adjoint as backward: one fused all-to-all each way, as Megatron
    sends its fused in_proj output. Inputs of another dtype than q (the fp32 gate) travel as pairs of
    q's dtype: every step is a copy, so their bits arrive unchanged both ways."""

    @staticmethod
    def forward(ctx, cp, *xs):
        ctx.cp, ctx.meta = cp, [(tuple(x.shape), x.dtype) for x in xs]
        return tuple(cp.to_heads(xs))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.cp.to_seq(grads, ctx.meta))
