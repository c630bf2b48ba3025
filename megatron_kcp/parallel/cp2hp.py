"""cp2hp: megatron-core GatedDeltaNet's CP scheme as a strategy, the peer KCP is measured against.

One all-to-all of [q|k|v|g|beta] from sequence shards to head shards (each rank: the whole stream,
H/W q/k heads and HV/W value heads, as megatron-core splits grouped heads), the core's single-device
call, one all-to-all of o back; backward runs the same two in reverse. Under any layout: the
all-to-all delivers the W shards in rank order and every rank's plan gives their tokens' stream
positions. It gives the KDA mixer (megatron-core has no KDA module) the same peer as megatron-core's
GatedDeltaNet.
"""
from __future__ import annotations

import functools

import torch

from megatron_kcp.parallel import registry
from megatron_kcp.parallel.comm import AllToAll, all_to_all
from megatron_kcp.plan import KCPPlan, all_plans, local_token_index
from megatron_kcp.parallel.strategy import ExchangeStrategy


def check_cp2hp(heads: int, value_heads: int, world_size: int, initial_state=None) -> None:
    """What the all-to-all to head shards needs, with the fix (also called by the mixers at construction)."""
    if heads % world_size or value_heads % world_size:
        raise ValueError(f"strategy 'cp2hp' splits the heads over the CP ranks: it needs q/k and v head counts "
                         f"divisible by the CP size {world_size} (got {heads} and {value_heads}); change the heads "
                         "or the CP size, or use a KCP strategy (auto, relay, gather)")
    if initial_state is not None:
        raise ValueError("strategy 'cp2hp' takes no initial_state: use a KCP strategy (auto, relay, gather)")


class TokenOrder:
    """Where the all-to-all's rows sit in the stream: ``pos`` (gathered row -> stream position) and its
    inverse ``inv``, and the stream's cu_seqlens, on one device."""

    def __init__(self, plan: KCPPlan, device: torch.device):
        plans = all_plans(plan.global_cu_seqlens, plan.layout, plan.world_size)
        pos = torch.cat([local_token_index(p) for p in plans])
        self.pos, self.inv = pos.to(device), torch.argsort(pos).to(device)
        self.cu_cpu = torch.tensor(plan.global_cu_seqlens)
        self.cu = self.cu_cpu.to(device)
        self.W = plan.world_size


@functools.lru_cache(maxsize=64)
def token_order(plan: KCPPlan, device: torch.device) -> TokenOrder:
    return TokenOrder(plan, device)


class CP2HP(ExchangeStrategy):
    """Where named (the default moves to head shards as a layout move: :mod:`megatron_kcp.ops.dispatch`),
    without ``max_segment`` (no segments to split): megatron-core's scheme, fla's single-device call on head
    shards where the core is not named (fla hands GDN to flash-qla's call where that is installed)."""
    name = "cp2hp"
    order = 2

    def applicable(self, problem):
        return problem.strategy == self.name and not problem.max_segment

    def refusal(self, problem):
        return ("max_segment splits KCP's segments and strategy 'cp2hp' has none: drop it, or use a KCP "
                "strategy")

    def pick(self, problem):
        if problem.core != "auto":
            return problem.core, 0
        return ("fla" if problem.cuda else "reference"), 0

    def check(self, q, v, plan, initial_state):
        check_cp2hp(q.shape[2], v.shape[2], plan.world_size, initial_state)

    def apply(self, core, q, k, v, g, beta, plan, group, *, scale, initial_state, use_qk_l2norm):
        order = token_order(plan, q.device)
        W, Tl, HV, gdn = order.W, q.shape[1], v.shape[2], g.dim() == 3
        q, k, v, g, beta = SeqToHeads.apply(order, group, q, k, v, g[..., None] if gdn else g, beta[..., None])
        o = core.single_device(q, k, v, g[..., 0] if gdn else g, beta[..., 0], scale=scale, initial_state=None,
                               use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=order.cu,
                               cu_seqlens_cpu=order.cu_cpu)[0]                       # [T, HV/W, V]
        o = Permute.apply(o, order.pos, order.inv).view(W, Tl, HV // W, -1)
        return AllToAll.apply(o, group).transpose(0, 1).reshape(1, Tl, HV, -1)


def to_heads(order: TokenOrder, group, xs):
    """[1, T/W, H_i, d_i] (this rank's tokens, all heads) -> [1, T, H_i/W, d_i] (all tokens, my heads),
    each input split by its own head count (q and k may have fewer heads than v, g and beta), in one
    all-to-all: every rank's share of every input side by side in a row. Two passes over the data:
    the packing (one ``cat`` of the inputs' per-rank views) and, per input, one gather of its columns
    into stream order."""
    W, Tl, wire = order.W, xs[0].shape[1], xs[0].dtype
    bits = [x[0] if x.dtype == wire else x[0].view(wire) for x in xs]                      # [T/W, H_i, d_i]
    y = torch.cat([x.reshape(Tl, W, -1).transpose(0, 1) for x in bits], -1)              # [W, T/W, D]
    y = all_to_all(y, group).flatten(0, 1)                                                # [T, D], rank order
    parts = y.split([b[0].numel() // W for b in bits], -1)
    return [t.index_select(0, order.inv).view(len(t), b.shape[1] // W, -1).view(x.dtype)[None]
            for t, b, x in zip(parts, bits, xs)]


def to_seq(order: TokenOrder, group, grads, meta):
    """The way back, for the gradients: [1, T, H_i/W, d_i] -> [1, T/W, H_i, d_i]; ``meta`` holds the
    inputs' (shape, dtype), the first one's dtype being the wire's. Two passes over the data: each
    gradient gathered into rank order straight into its columns of the packed rows, and the unpacking."""
    W, Tl, wire = order.W, meta[0][0][1], meta[0][1]
    widths = [s[2] // W * s[3] * torch.finfo(t).bits // torch.finfo(wire).bits for s, t in meta]
    y = torch.empty(Tl * W, sum(widths), dtype=wire, device=order.pos.device)
    for d, col in zip(grads, y.split(widths, -1)):
        if d is None:
            col.zero_()
        else:
            torch.index_select((d[0] if d.dtype == wire else d[0].view(wire)).reshape(Tl * W, -1), 0, order.pos,
                               out=col)
    y = all_to_all(y.view(W, Tl, -1), group).transpose(0, 1)                             # [T/W, W, D]
    return [t.reshape(Tl, s[2], -1).contiguous().view(dt)[None]
            for t, (s, dt) in zip(y.split(widths, -1), meta)]


class Permute(torch.autograd.Function):
    """``x.index_select(0, pos)`` for a permutation ``pos``, whose adjoint is the gather by its inverse
    ``inv``: a copy each way, where autograd's own adjoint of ``index_select`` zero-fills and
    scatter-adds."""

    @staticmethod
    def forward(ctx, x, pos, inv):
        ctx.inv = inv
        return x.index_select(0, pos)

    @staticmethod
    def backward(ctx, dy):
        return dy.index_select(0, ctx.inv), None, None


class SeqToHeads(torch.autograd.Function):
    """:func:`to_heads` with its exact adjoint :func:`to_seq` as backward: one fused all-to-all each
    way, as Megatron sends its fused in_proj output. Inputs of another dtype than q (the fp32 gate)
    travel as pairs of q's dtype: every step is a copy, so their bits arrive unchanged both ways."""

    @staticmethod
    def forward(ctx, order, group, *xs):
        ctx.order, ctx.group, ctx.meta = order, group, [(tuple(x.shape), x.dtype) for x in xs]
        return tuple(to_heads(order, group, xs))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *to_seq(ctx.order, ctx.group, grads, ctx.meta))


registry.register(CP2HP())
