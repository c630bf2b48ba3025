"""The local core of a KCP step in pure PyTorch: the CPU path, and the oracle of the CUDA core.

A core computes one rank's part on a range of its local segments, given each segment's initial
state (forward) or final-state gradient (backward): ``prepare`` once, then per range ``state`` ->
``output`` and ``backward_prepare`` -> ``backward_state`` -> ``backward_rest``, and ``maps`` (the
affine state map of every segment) where a strategy gathers maps. The exchange strategies
(``megatron_kcp.parallel``) decide which range runs when and what crosses ranks. The CUDA core
(``core_fla``) has the same methods over fla's kernels; this one runs the fp64 chunked reference
(``reference.py``) and its autograd.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_kcp.ops import reference as R
from megatron_kcp.parallel.plan import KCPPlan


@dataclass
class Prepared:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    plan: KCPPlan
    scale: float | None
    l2: bool

    def tensors(self):
        return self.q, self.k, self.v, self.g, self.beta

    def cut(self, lo: int, hi: int, *xs):
        """The tensors (default: the inputs) on segments [lo, hi), and their cu_seqlens."""
        a, b = self.plan.token_range(lo, hi)
        cu = torch.tensor(self.plan.cu_seqlens[lo:hi + 1]) - a
        return [x[:, a:b] for x in (xs or self.tensors())], cu


class ReferenceCore:
    def prepare(self, q, k, v, g, beta, plan, scale, l2) -> Prepared:
        return Prepared(q, k, v, g, beta, plan, scale, l2)

    def restore(self, saved, plan, scale, l2) -> Prepared:
        return Prepared(*saved, plan, scale, l2)

    def state(self, P: Prepared, lo, hi, h0):
        """(output of the range, final state of each segment [hi - lo, HV, K, V] fp32)."""
        xs, cu = P.cut(lo, hi)
        o, ht = R.chunk_gated_delta_rule(*xs, scale=P.scale, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm=P.l2, cu_seqlens=cu)
        return o, ht.float()

    def output(self, P, lo, hi, st):
        return st

    def maps(self, P: Prepared, lo, hi):
        """[H | M] of every segment in the range, ``[hi - lo, HV, K, V + K]`` fp32."""
        (_, k, v, g, beta), cu = P.cut(lo, hi)
        cu = cu.tolist()
        return torch.stack([R.affine_state_map(k[:, a:b], g[:, a:b], beta[:, a:b], v[:, a:b], P.l2)
                            for a, b in zip(cu, cu[1:])]).float()

    def backward_prepare(self, P: Prepared, lo, hi, h0, do):
        """What the state-gradient pass needs before the final-state gradient is known (here: its inputs)."""
        return lo, hi, h0, do

    def backward_state(self, P: Prepared, bpre, dht):
        """(what backward_rest needs, the gradient of each segment's initial state)."""
        lo, hi, h0, do = bpre
        xs, cu = P.cut(lo, hi)
        (do,), _ = P.cut(lo, hi, do)
        with torch.enable_grad():
            xs = [x.detach().requires_grad_() for x in xs] + [h0.detach().requires_grad_()]
            o, ht = R.chunk_gated_delta_rule(*xs[:5], scale=P.scale, initial_state=xs[5], output_final_state=True,
                                             use_qk_l2norm=P.l2, cu_seqlens=cu)
            grads = torch.autograd.grad((o, ht), xs, (do, dht.to(ht.dtype)))
        return grads[:5], grads[5].float()

    def backward_rest(self, P, lo, hi, bst):
        return bst

    def finish(self, P, grads):
        return grads
