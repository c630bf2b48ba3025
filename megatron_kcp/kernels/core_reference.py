"""The local core of a KCP step in pure PyTorch: the CPU path, and the oracle of the CUDA cores.

Implements :class:`megatron_kcp.kernels.core.LocalCore` over the fp64 chunked reference
(``reference.py``): each state pass computes its segments' outputs too (kept in ``States.o``), and
each state-gradient pass is autograd through the same reference, filling ``Backward.grads``. A
pass on a group of value heads runs the reference on those heads and their q/k heads: heads are
independent, and each head's arithmetic is the same as in a pass over all of them.
"""
from __future__ import annotations

import torch

from megatron_kcp.kernels import reference as R
from megatron_kcp.kernels import registry
from megatron_kcp.kernels.core import Backward, Prepared, States, heads_of
from megatron_kcp.calibration import CALIBRATION
from megatron_kcp.plan import KCPPlan


def _gather(plan: KCPPlan, segs, *xs):
    """``xs`` on the local segments ``segs``, packed; their cu_seqlens; the local row of each packed token."""
    cu = plan.cu_seqlens
    idx = torch.cat([torch.arange(cu[s], cu[s + 1]) for s in segs]).to(xs[0].device)
    lens = torch.tensor([0] + [cu[s + 1] - cu[s] for s in segs])
    return [x[:, idx] for x in xs], lens.cumsum(0), idx


def _on_heads(xs, heads: slice | None, HV: int, dim: int = 2):
    """``xs`` (their heads along ``dim``) on the value heads ``heads`` (views); as they are for None."""
    return list(xs) if heads is None else [heads_of(x, heads, HV, dim) for x in xs]


class ReferenceCore:
    fused = False                # output and backward_rest return what the passes computed
    head_slices = True
    min_group_heads = CALIBRATION.min_group_heads
    state_reads = "all"          # every state row of a range is read

    def prepare(self, q, k, v, g, beta, plan, scale, use_qk_l2norm, live=None) -> Prepared:
        return Prepared((q, k, v, g, beta), plan, scale, use_qk_l2norm, live=live)

    def states(self, P: Prepared, h0) -> States:
        return States(h0)

    def state(self, P: Prepared, st: States, segs, h0, heads=None):
        HV = h0.shape[1]
        xs, cu, idx = _gather(P.plan, segs, *P.saved)
        xs, (h0,) = _on_heads(xs, heads, HV), _on_heads([h0[list(segs)]], heads, HV, dim=1)
        o, ht = R.chunk_gated_delta_rule_fp64(*xs, scale=P.scale, initial_state=h0,
                                              output_final_state=True, use_qk_l2norm=P.use_qk_l2norm, cu_seqlens=cu)
        if st.o is None:
            st.o = o.new_zeros(1, P.plan.num_local_tokens, HV, o.shape[3])
        if heads is None:
            st.o[:, idx] = o
        else:
            st.o[:, idx, heads] = o
        return ht.float()

    def output(self, P: Prepared, st: States, lo, hi):
        a, b = P.plan.token_range(lo, hi)
        return st.o[:, a:b]

    def maps(self, P: Prepared, segs):
        cu = P.plan.cu_seqlens
        _, k, v, g, beta = P.saved
        return torch.stack([R.affine_state_map(k[:, cu[s]:cu[s + 1]], g[:, cu[s]:cu[s + 1]],
                                               beta[:, cu[s]:cu[s + 1]], v[:, cu[s]:cu[s + 1]], P.use_qk_l2norm)
                            for s in segs]).float()

    def backward_prepare(self, P: Prepared, lo, hi, h0, do) -> Backward:
        a, b = P.plan.token_range(lo, hi)
        return Backward(lo, hi, (h0, do), grads=[torch.zeros_like(x[:, a:b]) for x in P.saved])

    def backward_state(self, P: Prepared, B: Backward, segs, dht, heads=None):
        h0, do = B.xs
        HV = h0.shape[1]
        xs, cu, idx = _gather(P.plan, segs, *P.saved)
        (do,), _, _ = _gather(P.plan, segs, do)
        rows = [s - B.lo for s in segs]
        *xs, do = _on_heads(xs + [do], heads, HV)
        h0, dht = _on_heads([h0[rows], dht[rows]], heads, HV, dim=1)
        with torch.enable_grad():
            xs = [x.detach().requires_grad_() for x in xs] + [h0.detach().requires_grad_()]
            o, ht = R.chunk_gated_delta_rule_fp64(*xs[:5], scale=P.scale, initial_state=xs[5],
                                                  output_final_state=True, use_qk_l2norm=P.use_qk_l2norm, cu_seqlens=cu)
            grads = torch.autograd.grad((o, ht), xs, (do, dht.to(ht.dtype)))
        local = idx - P.plan.cu_seqlens[B.lo]
        for acc, gr in zip(B.grads, grads[:5]):
            if heads is None:
                acc[:, local] = gr.to(acc.dtype)
            else:            # the group's q/k heads are its own: no other group writes them
                heads_of(acc, heads, HV)[:, local] = gr.to(acc.dtype)
        return grads[5].float()

    def backward_rest(self, P: Prepared, B: Backward):
        return tuple(B.grads)

    def finish(self, P, grads):
        return grads

    def single_device(self, q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                      cu_seqlens_cpu):
        return R.chunk_gated_delta_rule_fp64(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                             use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens_cpu)[0]


registry.register(registry.CoreEntry(
    name="reference", label="reference (PyTorch)", runs_on="any device (PyTorch; the CPU path and the oracle)",
    runs=lambda p: True, build=lambda device, dtype, kda, head_dims: ReferenceCore(), priority=10,
    min_group_heads=ReferenceCore.min_group_heads))
