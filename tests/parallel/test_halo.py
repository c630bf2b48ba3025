"""The conv halo's exchange: the tails' gradients reach the conv inputs in place, with no ``[T, D]`` pass."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_kcp.kernels import conv_reference

from megatron_kcp.ops import kcp
from megatron_kcp.parallel import halo
from megatron_kcp.testing.cases import plan_for, random_cu_seqlens, shard
from megatron_kcp.testing.checks import cp_group
from megatron_kcp.testing.distributed import spawn

DENSE = {"zeros", "new_zeros", "zeros_like", "add", "add_"}


class _Dense(TorchDispatchMode):
    """Records the fills and adds of a tensor of ``shapes``: what a dense halo gradient would cost."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.seen = shapes, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in DENSE and isinstance(out, torch.Tensor) and tuple(out.shape) in self.shapes:
            self.seen.append((name, tuple(out.shape)))
        return out


def _cases():
    group = cp_group()
    W, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(5)
    for layout in ("zigzag_per_doc", "contiguous"):
        cu = random_cu_seqlens(gen, layout, W, "random")
        plan, ks, widths = plan_for(cu, layout, W, r, 4), 4, (3, 5)
        xs = [torch.randn(1, cu[-1], d, generator=gen, dtype=torch.float64) for d in widths]
        ws = [torch.randn(d, ks, generator=gen, dtype=torch.float64) for d in widths]
        dys = [torch.randn(1, cu[-1], d, generator=gen, dtype=torch.float64) for d in widths]
        loc = [shard(plan, x)[0].requires_grad_() for x in xs]
        ys = kcp.causal_conv1ds(loc, ws, plan=plan, group=group, backend="reference")
        T = plan.num_local_tokens
        dense = _Dense({s for d in widths for s in ((T, d), (1, T, d))})
        with dense:
            grads = torch.autograd.grad(ys, loc, [shard(plan, dy)[0] for dy in dys])
        assert not dense.seen, f"{layout}: the halo's gradient made dense passes over the conv inputs: {dense.seen}"
        # the same gradients added the dense way: the conv's own input gradient, and the tails' gradient
        # as a [T, D] of its own (the exchange's backward on streams nothing else reads)
        loc2 = [x.detach().clone().requires_grad_() for x in loc]
        rows = halo.halos([x[0] for x in loc2], plan, group)[1]
        own_in = [x.detach().clone().requires_grad_() for x in loc]
        halo_in = [h.detach().requires_grad_() for h in rows]
        convs = [conv_reference.local_conv(x, w, None, "silu", plan, h) for x, w, h in zip(own_in, ws, halo_in)]
        own = torch.autograd.grad(convs, own_in + halo_in, [shard(plan, dy)[0] for dy in dys])
        tails = torch.autograd.grad(rows, loc2, own[len(convs):])
        for g, g_own, g_tails in zip(grads, own, tails):
            assert torch.equal(g, g_own + g_tails), layout


def test_tails_reach_the_conv_input_gradient_in_place():
    spawn(_cases, 2)
