"""The local core of a KCP step in pure PyTorch: the CPU path, and the oracle of the CUDA core.

A core computes one rank's part on sets of its local segments, given each segment's initial
state (forward) or final-state gradient (backward): ``prepare`` once; forward, ``state`` on any
set of segments (the state passes, which the exchange orders) into one ``states`` buffer, then
``output`` on a range of segments whose states are done; backward, ``backward_prepare`` on a
range, ``backward_state`` on any sets of segments in it, then ``backward_rest`` on the range; and
``maps`` (the affine state map of each of a set of segments) where a strategy gathers maps. The exchange strategies
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
    live: frozenset | None = None       # segments whose initial state may be nonzero (unused here)

    def tensors(self):
        return self.q, self.k, self.v, self.g, self.beta

    def gather(self, segs, *xs):
        """The tensors (default: the inputs) on the local segments ``segs``, packed, with their
        cu_seqlens and the local token index of each packed token."""
        cu = self.plan.cu_seqlens
        idx = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in segs]).to(self.q.device)
        lens = torch.tensor([0] + [cu[s + 1] - cu[s] for s in segs])
        return [x[:, idx] for x in (xs or self.tensors())], lens.cumsum(0), idx


@dataclass
class States:
    o: torch.Tensor | None = None       # the output of every segment whose state pass ran


@dataclass
class Backward:
    lo: int
    hi: int
    h0: torch.Tensor                    # initial states of segments [lo, hi)
    do: torch.Tensor
    grads: list                         # input gradients of the range, filled by backward_state


class ReferenceCore:
    fused = False                # its passes compute what ``output`` and ``backward_rest`` return

    def prepare(self, q, k, v, g, beta, plan, scale, l2, live=None) -> Prepared:
        return Prepared(q, k, v, g, beta, plan, scale, l2, live)

    def restore(self, saved, plan, scale, l2, live=None) -> Prepared:
        return Prepared(*saved, plan, scale, l2, live)

    def states(self, P: Prepared, h0=None) -> States:
        return States()

    def state(self, P: Prepared, st: States, segs, h0):
        """Final states ``[len(segs), HV, K, V]`` fp32 of the local segments ``segs`` (sorted) from the
        initial states ``h0`` (a row per local segment); what the output needs goes into ``st``."""
        xs, cu, idx = P.gather(segs)
        h0 = h0[list(segs)]
        o, ht = R.chunk_gated_delta_rule(*xs, scale=P.scale, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm=P.l2, cu_seqlens=cu)
        if st.o is None:
            st.o = o.new_zeros(1, P.plan.num_local_tokens, *o.shape[2:])
        st.o[:, idx] = o
        return ht.float()

    def output(self, P: Prepared, st: States, lo, hi):
        """Output of segments [lo, hi) (their state passes done)."""
        a, b = P.plan.token_range(lo, hi)
        return st.o[:, a:b]

    def maps(self, P: Prepared, segs):
        """[H | M] of each of ``segs``, ``[len(segs), HV, K, V + K]`` fp32."""
        cu = P.plan.cu_seqlens
        return torch.stack([R.affine_state_map(P.k[:, cu[s]:cu[s + 1]], P.g[:, cu[s]:cu[s + 1]],
                                               P.beta[:, cu[s]:cu[s + 1]], P.v[:, cu[s]:cu[s + 1]], P.l2)
                            for s in segs]).float()

    def backward_prepare(self, P: Prepared, lo, hi, h0, do) -> Backward:
        """What the state-gradient passes of segments [lo, hi) need before their final-state gradients
        are known (here: their inputs), and the buffers they fill."""
        a, b = P.plan.token_range(lo, hi)
        return Backward(lo, hi, h0, do, [torch.zeros_like(x[:, a:b]) for x in P.tensors()])

    def backward_state(self, P: Prepared, B: Backward, segs, dht):
        """Initial-state gradients ``[len(segs), HV, K, V]`` of ``segs`` (sorted, in [B.lo, B.hi)) from
        the final-state gradients ``dht`` (a row per segment of the range); their input gradients go
        into ``B``."""
        xs, cu, idx = P.gather(segs)
        dht = dht[[s - B.lo for s in segs]]
        (do,), _, _ = P.gather(segs, B.do)
        h0 = B.h0[[s - B.lo for s in segs]]
        with torch.enable_grad():
            xs = [x.detach().requires_grad_() for x in xs] + [h0.detach().requires_grad_()]
            o, ht = R.chunk_gated_delta_rule(*xs[:5], scale=P.scale, initial_state=xs[5], output_final_state=True,
                                             use_qk_l2norm=P.l2, cu_seqlens=cu)
            grads = torch.autograd.grad((o, ht), xs, (do, dht.to(ht.dtype)))
        rows = idx - P.plan.cu_seqlens[B.lo]
        for acc, gr in zip(B.grads, grads[:5]):
            acc[:, rows] = gr.to(acc.dtype)
        return grads[5].float()

    def backward_rest(self, P: Prepared, B: Backward):
        """Input gradients of segments [B.lo, B.hi) (every one's state-gradient pass done)."""
        return tuple(B.grads)

    def finish(self, P, grads):
        return grads
