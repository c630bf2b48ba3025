"""The local core of a KCP step on CUDA, composed from fla-core's single-device chunk kernels.

The same steps fla's ``chunk_gated_delta_rule`` / ``chunk_kda`` run, cut where the exchange
strategies need them (``core_reference`` documents the methods): ``prepare`` (l2norm, gate cumsum,
the WY form: everything that needs no state) over the whole local stream once; then, on a range
of local segments (varlen, one launch for all its documents), the state pass with per-segment
initial states, the output, fla's CP pre-process for transition maps, and the backward cut around
the state-gradient pass: what does not need the incoming gradient runs while it travels, and a
relay sends the outgoing gradient on before the rest of the backward.
The short conv runs fla's varlen conv with each piece's halo as that segment's initial state.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_kcp.ops import conv_reference
from megatron_kcp.parallel.plan import KCPPlan

FLA_VERSION = "0.6.0"
CHUNK = 64


def check_fla_environment(device: torch.device | None = None) -> None:
    """Fail early, with the fix, where fla would fail late or compute wrong numbers."""
    try:
        import fla
        import triton
    except ImportError as e:
        raise RuntimeError(f"the CUDA path of megatron_kcp needs fla-core=={FLA_VERSION} and triton: "
                           f"pip install fla-core=={FLA_VERSION} ({e})") from e
    if getattr(fla, "__version__", None) != FLA_VERSION:
        raise RuntimeError(f"megatron_kcp is built and tested against fla-core {FLA_VERSION}, found "
                           f"{getattr(fla, '__version__', 'unknown')}: pip install fla-core=={FLA_VERSION}")
    if not torch.cuda.is_available():
        raise RuntimeError("fla's kernels need a CUDA GPU; on CPU use backend='reference'")
    idx = (device or torch.device("cuda")).index
    major, minor = torch.cuda.get_device_capability(idx if idx is not None else torch.cuda.current_device())
    if major < 8:
        raise RuntimeError(f"fla's CP kernels need an Ampere or newer GPU (compute capability >= 8.0), this one "
                           f"is {major}.{minor}: use backend='reference' (slow) or another GPU")
    from packaging.version import Version
    tv = Version(triton.__version__.split("+")[0])
    if major == 9 and Version("3.4.0") <= tv < Version("3.7.1"):
        try:
            import tilelang  # noqa: F401
        except ImportError:
            raise RuntimeError(f"Triton {tv} on Hopper computes gated GDN backward wrongly and fla 0.6.0 then refuses "
                               "it: pip install tilelang (fla dispatches that kernel to it) or triton>=3.7.1") from None


@functools.lru_cache(maxsize=None)
def _checked(device_index: int) -> int:
    check_fla_environment(torch.device("cuda", device_index))
    return device_index


@functools.lru_cache(maxsize=256)
def _ranges(plan: KCPPlan, lo: int, hi: int, device: str):
    """(token start, end, cu_seqlens on the device and on the CPU, fla's chunk indices) of segments [lo, hi)."""
    from fla.ops.utils.index import prepare_chunk_indices
    a, b = plan.token_range(lo, hi)
    cpu = torch.tensor(plan.cu_seqlens[lo:hi + 1], dtype=torch.long) - a
    cu = cpu.to(device)
    return a, b, cu, prepare_chunk_indices(cu, CHUNK, cu_seqlens_cpu=cpu)


@dataclass
class Prepared:
    saved: tuple          # what the backward keeps (see each core's prepare)
    plan: KCPPlan
    scale: float
    l2: bool
    fwd: tuple = ()       # forward-only intermediates (w, u, ...), dropped before the backward

    def tensors(self):
        return self.saved


class _Core:
    def restore(self, saved, plan, scale, l2) -> Prepared:
        return Prepared(tuple(saved), plan, scale, l2)

    def cut(self, P: Prepared, lo, hi, *xs):
        a, b, cu, ci = _ranges(P.plan, lo, hi, str(xs[0].device))
        return [None if x is None else x[:, a:b] for x in xs], dict(cu_seqlens=cu, chunk_indices=ci)

    @staticmethod
    def _inputs(q, k, v, g, beta, plan, l2):
        """What both models do first: contiguous inputs, l2norm of q and k (with its rstd for the
        backward), the chunk-local gate cumsum in log2 units (fla's kernels use exp2), the stream's
        cu_seqlens and chunk indices."""
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        qr = kr = None
        if l2:
            from fla.modules.norm.l2norm import l2norm_fwd
            (q, qr), (k, kr) = l2norm_fwd(q), l2norm_fwd(k)
        _, _, cu, ci = _ranges(plan, 0, plan.num_segments, str(q.device))
        gc = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=ci)
        return q, k, v, gc, beta, qr, kr, dict(cu_seqlens=cu, chunk_indices=ci)

    def finish(self, P: Prepared, grads):
        """Input gradients from those of the prepared tensors (the l2norm's backward)."""
        dq, dk, dv, dg, db = grads
        if P.l2:
            from fla.modules.norm.l2norm import l2norm_bwd
            q, k, _, _, _, qr, kr = P.saved[:7]
            dq, dk = l2norm_bwd(q, qr, dq), l2norm_bwd(k, kr, dk)
        return dq, dk, dv, dg, db


class GDNCore(_Core):
    """Gated DeltaNet: one log-decay per head (``g`` ``[1, T, HV]``)."""

    def prepare(self, q, k, v, g, beta, plan, scale, l2) -> Prepared:
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        *saved, kw = self._inputs(q, k, v, g, beta, plan, l2)
        q, k, v, gc, beta = saved[:5]
        w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=CHUNK, **kw)
        return Prepared((*saved, A), plan, scale, l2, fwd=(w, u))

    def state(self, P, lo, hi, h0):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        (k, w, u, g), kw = self.cut(P, lo, hi, P.saved[1], *P.fwd, P.saved[3])
        h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=h0, output_final_state=True,
                                                    **kw)
        return (h, v_new), ht

    def output(self, P, lo, hi, st):
        from fla.ops.common.chunk_o import chunk_fwd_o
        (q, k, g), kw = self.cut(P, lo, hi, P.saved[0], P.saved[1], P.saved[3])
        h, v_new = st
        return chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=P.scale, **kw).to(q.dtype)

    def maps(self, P, lo, hi):
        from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
        (k, w, u, g), kw = self.cut(P, lo, hi, P.saved[1], *P.fwd, P.saved[3])
        HV, K, V = u.shape[2], k.shape[3], u.shape[3]
        hm = k.new_zeros(hi - lo, HV, K, V + K, dtype=torch.float32)
        chunk_cp_fwd_h(k=k, w=w, u=u, hm=hm, g=g, cu_seqlens=kw["cu_seqlens"], chunk_size=CHUNK, multi_seqs=True)
        return hm

    def backward_prepare(self, P, lo, hi, h0, do):
        """What the state-gradient pass needs and the incoming gradient does not change."""
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_bwd_dv_local
        from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
        (q, k, v, g, beta, A, do), kw = self.cut(P, lo, hi, *P.saved[:5], P.saved[7], do)
        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g, **kw)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=h0, output_final_state=False,
                                                   **kw)
        dv = chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=P.scale, **kw)
        return q, k, g, w, h, v_new, dv, do, h0, kw

    def backward_state(self, P, bpre, dht):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        q, k, g, w, h, v_new, dv, do, h0, kw = bpre
        dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=h0, dht=dht, do=do, dv=dv,
                                                     scale=P.scale, **kw)
        return (w, h, v_new, dh, dv, do), dh0

    def backward_rest(self, P, lo, hi, bst):
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
        from fla.ops.utils import chunk_local_cumsum
        (q, k, v, g, beta, A), kw = self.cut(P, lo, hi, *P.saved[:5], P.saved[7])
        w, h, v_new, dh, dv, do = bst
        dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=P.scale, **kw)
        dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv, **kw)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **kw)
        return dq, dk, dv, dg, db


class KDACore(_Core):
    """Kimi Delta Attention: one log-decay per head and key dim (``g`` ``[1, T, HV, K]``)."""

    def prepare(self, q, k, v, g, beta, plan, scale, l2) -> Prepared:
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
        *saved, kw = self._inputs(q, k, v, g, beta, plan, l2)
        q, k, v, gc, beta = saved[:5]
        w, u, _, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, chunk_size=CHUNK,
                                                    **kw)
        return Prepared((*saved, Aqk, Akk), plan, scale, l2, fwd=(w, u, kg))

    def state(self, P, lo, hi, h0):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        (kg, w, u, g), kw = self.cut(P, lo, hi, P.fwd[2], P.fwd[0], P.fwd[1], P.saved[3])
        h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=h0, output_final_state=True,
                                                    **kw)
        return (h, v_new), ht

    def output(self, P, lo, hi, st):
        from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
        (q, g, Aqk), kw = self.cut(P, lo, hi, P.saved[0], P.saved[3], P.saved[7])
        h, v_new = st
        return chunk_gla_fwd_o_gk(q=q, v=v_new, g=g, A=Aqk, h=h, scale=P.scale, chunk_size=CHUNK, **kw).to(q.dtype)

    def maps(self, P, lo, hi):
        from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
        (kg, w, u, g), kw = self.cut(P, lo, hi, P.fwd[2], P.fwd[0], P.fwd[1], P.saved[3])
        HV, K, V = u.shape[2], kg.shape[3], u.shape[3]
        hm = kg.new_zeros(hi - lo, HV, K, V + K, dtype=torch.float32)
        chunk_cp_fwd_h(k=kg, w=w, u=u, hm=hm, gk=g, cu_seqlens=kw["cu_seqlens"], chunk_size=CHUNK, multi_seqs=True)
        return hm

    def backward_prepare(self, P, lo, hi, h0, do):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv
        from fla.ops.kda.wy_fast import recompute_w_u_fwd
        (q, k, v, g, beta, Aqk, Akk, do), kw = self.cut(P, lo, hi, *P.saved[:5], *P.saved[7:9], do)
        w, u, qg, kg = recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, gk=g, q=q, **kw)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=h0, output_final_state=False,
                                                   **kw)
        dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=P.scale, chunk_size=CHUNK, **kw)
        return qg, kg, w, g, h, v_new, dv, dAqk, do, h0, kw

    def backward_state(self, P, bpre, dht):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        qg, kg, w, g, h, v_new, dv, dAqk, do, h0, kw = bpre
        dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q=qg, k=kg, w=w, gk=g, h0=h0, dht=dht, do=do, dv=dv,
                                                     scale=P.scale, chunk_size=CHUNK, **kw)
        return (h, v_new, dh, dv, dAqk, do), dh0

    def backward_rest(self, P, lo, hi, bst):
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused
        from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
        from fla.ops.utils import chunk_local_cumsum
        (q, k, v, g, beta, Akk), kw = self.cut(P, lo, hi, *P.saved[:5], P.saved[8])
        h, v_new, dh, dv, dAqk, do = bst
        dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=Akk,
                                                               h=h, do=do, dh=dh, dv=dv, scale=P.scale,
                                                               chunk_size=CHUNK, **kw)
        dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                             dg=dg, chunk_size=CHUNK, **kw)
        H, HV = q.shape[2], v.shape[2]
        if HV > H:                               # grouped value heads: q/k gradients summed per q/k head
            dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(3)
            dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(3)
        dg = chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **kw)
        return dq, dk, dv, dg, db


def core(kda: bool, device: torch.device):
    _checked(device.index if device.index is not None else torch.cuda.current_device())
    return KDACore() if kda else GDNCore()


class _HaloToState(torch.autograd.Function):
    """Halo rows ``[P * (ks - 1), D]`` -> fla's conv initial states ``[num_segments, D, ks]`` (zero where a
    segment starts its sequence); backward: the states' gradient back onto the halo rows."""

    @staticmethod
    def forward(ctx, halo, plan: KCPPlan):
        segs, pieces = _halo_segments(plan)
        hl, ks = plan.halo_len, plan.conv_kernel_size
        state = halo.new_zeros(plan.num_segments, halo.shape[1], ks)
        if segs:
            state[list(segs), :, 1:] = halo.view(plan.num_pieces, hl, -1)[list(pieces)].transpose(1, 2)
        ctx.plan, ctx.shape = plan, halo.shape
        return state

    @staticmethod
    def backward(ctx, dstate):
        segs, pieces = _halo_segments(ctx.plan)
        plan = ctx.plan
        dhalo = dstate.new_zeros(plan.num_pieces, plan.halo_len, ctx.shape[1])
        if segs:
            dhalo[list(pieces)] = dstate[list(segs), :, 1:].transpose(1, 2)
        return dhalo.view(ctx.shape), None


@functools.lru_cache(maxsize=64)
def _halo_segments(plan: KCPPlan):
    """(segments that continue a sequence from an earlier piece, the piece each starts)."""
    starts = {s: p for p, (s, _) in enumerate(plan.pieces)}
    pairs = [(i, starts[s]) for i, s in enumerate(plan.seg_start) if s in starts and plan.pred[i] is not None]
    return tuple(i for i, _ in pairs), tuple(p for _, p in pairs)


def causal_conv1d(x, weight, bias, activation, plan: KCPPlan, group):
    """fla's varlen conv over the local segments, each continuing segment starting from its halo."""
    from fla.modules.causal_conv1d import causal_conv1d as conv
    state = None
    if plan.world_size > 1 and plan.halo_len:
        # every rank passes a state (zeros where no segment continues): the halo's gradient then
        # reaches the backward collective on every rank, which all of them must join
        state = _HaloToState.apply(conv_reference.HaloExchange.apply(x[0], plan, group), plan).contiguous()
    y, _ = conv(x, weight, bias, initial_state=state, activation=activation,
                cu_seqlens=plan.cu_seqlens_tensor(x.device), cu_seqlens_cpu=plan.cu_seqlens_tensor())
    return y
