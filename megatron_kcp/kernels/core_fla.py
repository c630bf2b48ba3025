"""The local core of a KCP step on CUDA, composed from fla-core's single-device chunk kernels.

Implements :class:`megatron_kcp.kernels.core.LocalCore` with the steps fla's
``chunk_gated_delta_rule`` / ``chunk_kda`` run, taken apart where the exchange strategies need them:
``prepare`` (l2norm, gate cumsum, the WY form: everything that needs no state) over the whole local
stream once; the state pass on any set of segments (one launch of fla's kernel for a scattered set,
``Selection``), into buffers of the whole stream; the output on a range of segments (varlen, one
launch for all its documents); fla's CP pre-process for the transition maps of any set; and the
backward split around the state-gradient pass, so that what does not need the incoming gradient
runs while it travels.

A pass on a group of value heads (the relay's pipeline) runs the same kernels on contiguous copies
of the heads' part of the range its segments cover: fla's kernels find a head from the program id
and the head count, so a strided view of some heads cannot be handed to them. The chunk states and
new values (forward) or chunk state gradients and value gradients (backward) the pass writes are
copied back into the range's buffers on those heads; where the pass does not write every segment of
the range they are copied in first, so that the others keep what earlier passes wrote. Those copies
are the price of a group: about the pass's own memory traffic again, over all groups.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_kcp.environment import check_fla
from megatron_kcp.kernels import registry
from megatron_kcp.kernels.core import Backward, Prepared, States, heads_of, may_be_nonzero, state_rows
from megatron_kcp.calibration import CALIBRATION
from megatron_kcp.plan import KCPPlan, index_tensor

CHUNK = 64


@functools.lru_cache(maxsize=256)
def _ranges(plan: KCPPlan, lo: int, hi: int, device: str):
    """(token start, end, cu_seqlens on the device and on the CPU, fla's chunk indices) of segments [lo, hi)."""
    from fla.ops.utils.index import prepare_chunk_indices
    a, b = plan.token_range(lo, hi)
    cpu = torch.tensor(plan.cu_seqlens[lo:hi + 1], dtype=torch.long) - a
    cu = cpu.to(device)
    return a, b, cu, prepare_chunk_indices(cu, CHUNK, cu_seqlens_cpu=cpu)


@functools.lru_cache(maxsize=256)
def _chunk_offsets(plan: KCPPlan, lo: int, hi: int) -> tuple[int, ...]:
    """First chunk of each segment of [lo, hi], and the end, in the range's chunk order (fla's chunk indices)."""
    out = [0]
    for a, b in zip(plan.cu_seqlens[lo:hi], plan.cu_seqlens[lo + 1:hi + 1]):
        out.append(out[-1] + -(-(b - a) // CHUNK))
    return tuple(out)


@dataclass(frozen=True)
class Selection:
    """cu_seqlens and chunk offsets that make one launch of fla's sequence-grid kernels (one program
    per sequence and head: the state pass, the state-gradient pass, the CP maps) run on a subset of
    the segments [lo, hi), in place in the range's buffers. Runs of consecutive chosen segments are
    listed last run first, so the pair of cu_seqlens between two runs runs backwards (end before
    start) and the kernels' chunk loops skip it: that program only copies its initial state row
    (any row: ``src`` points it at a real one, so no buffer is zero-filled) to its final-state row,
    or nothing where the launch has no state rows."""
    cu: torch.Tensor
    offsets: torch.Tensor
    src: torch.Tensor | slice          # per program, its row among the range's segments
    rows: torch.Tensor | None          # the programs of the chosen segments, in their order (None: all)
    num_programs: int


def _runs(segs):
    runs = []
    for s in segs:
        if runs and runs[-1][-1] == s - 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


@functools.lru_cache(maxsize=256)
def _selection(plan: KCPPlan, lo: int, hi: int, segs: tuple[int, ...], device: str) -> Selection:
    base, cu_all = plan.cu_seqlens[lo], plan.cu_seqlens
    off = _chunk_offsets(plan, lo, hi)
    cu, offsets, src, rows = [], [], [], {}
    for run in reversed(_runs(segs)):
        if cu:                               # the program between two runs: a gap, skipped
            offsets.append(0)
            src.append(run[0] - lo)
        for s in run:
            rows[s] = len(offsets)
            offsets.append(off[s - lo])
            src.append(s - lo)
        cu += [cu_all[s] - base for s in run] + [cu_all[run[-1] + 1] - base]
    t = functools.partial(torch.tensor, dtype=torch.long, device=device)
    if len(offsets) == len(segs):            # one run: its rows of the range, in order
        return Selection(t(cu), t(offsets), slice(segs[0] - lo, segs[-1] + 1 - lo), None, len(segs))
    return Selection(t(cu), t(offsets), t(src), t([rows[s] for s in segs]), len(offsets))


def _spread(x: torch.Tensor | None, sel: Selection) -> torch.Tensor | None:
    """Rows of the range's segments -> one row per program (a view for one run; else a gather: no
    fill, no scatter)."""
    if x is None:
        return None
    return x[sel.src].contiguous() if isinstance(sel.src, slice) else x.index_select(0, sel.src)


def _pick(x: torch.Tensor | None, sel: Selection) -> torch.Tensor | None:
    """One row per program -> the rows of the chosen segments, in their order."""
    return x if x is None or sel.rows is None else x.index_select(0, sel.rows)


def state_pass(sel: Selection, k, w, u, g, gk, h0, h, v_new, final: bool = True) -> torch.Tensor | None:
    """fla's forward state pass on the selected segments, writing their chunk states ``h`` and new
    values ``v_new`` in place; returns their final states, or None where ``final`` is False (nobody
    takes them). ``h0=None``: every initial state is zero and no final state is written (fla's
    kernel then reads and writes no state rows)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_kernel_h_blockdim64 as kernel
    H, K, HV, V = *k.shape[2:], *u.shape[2:]
    ht = None if h0 is None or not final else h0.new_empty(sel.num_programs, HV, K, V)
    kernel[lambda m: (-(-V // m['BV']) * sel.num_programs * HV,)](
        k=k, v=u, w=w, v_new=v_new, g=g, gk=gk, h=h, h0=_spread(h0, sel), ht=ht, cu_seqlens=sel.cu,
        chunk_offsets=sel.offsets, T=k.shape[1], H=H, HV=HV, K=K, V=V, BT=CHUNK, STATE_V_FIRST=False)
    return _pick(ht, sel)


def state_grad_pass(sel: Selection, q, k, w, g, gk, do, dv, dht, dh, dv2, scale,
                    initial: bool = True) -> torch.Tensor | None:
    """fla's state-gradient pass on the selected segments, writing their chunk state gradients ``dh``
    and value gradients ``dv2`` in place; returns the gradients of their initial states, or None where
    ``initial`` is False (nobody takes them). ``dht=None``: every final-state gradient is zero and no
    initial-state gradient is written."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64 as kernel
    H, K, HV, V = *q.shape[2:], *do.shape[2:]
    dh0 = None if dht is None or not initial else dht.new_empty(sel.num_programs, HV, K, V)
    kernel[lambda m: (-(-V // m['BV']) * sel.num_programs * HV,)](
        q=q, k=k, w=w, g=g, gk=gk, dht=_spread(dht, sel), dh0=dh0, do=do, dh=dh, dv=dv, dv2=dv2,
        cu_seqlens=sel.cu, chunk_offsets=sel.offsets, scale=scale, T=q.shape[1], H=H, HV=HV, K=K, V=V,
        BT=CHUNK, STATE_V_FIRST=False)
    return _pick(dh0, sel)


def _by_state_rows(P, segs) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(the segments of ``segs`` whose pass needs state rows, the others, the former's positions in
    ``segs``). A segment reads its initial state (writes its gradient) only where it can be nonzero
    (``P.live``: received, or the user's) and writes its final state (reads its gradient) only where a
    successor takes it (``state_rows``): with many documents most segments need neither, and a state
    row is HV x K x V fp32 each way."""
    segs = tuple(segs)
    if P.live is None:
        return segs, (), tuple(range(len(segs)))
    return _split_by_rows(state_rows(P), segs)


@functools.lru_cache(maxsize=256)
def _split_by_rows(rows: tuple[int, ...], segs: tuple[int, ...]):
    need = set(rows)                       # once per plan and range: a rank holds hundreds of segments
    at = tuple(j for j, s in enumerate(segs) if s in need)
    return tuple(segs[j] for j in at), tuple(s for s in segs if s not in need), at


@functools.lru_cache(maxsize=256)
def _taken(plan: KCPPlan, live: frozenset | None, rows: tuple[int, ...], grad: bool) -> bool:
    """Whether anyone takes a row a pass on ``rows`` returns: a final state, where a segment has a
    successor; for ``grad`` an initial-state gradient, where a segment has a predecessor or starts a
    sequence with a state the user passed (in ``live``; None: any may)."""
    if grad:
        return live is None or any(plan.pred[s] is not None or s in live for s in rows)
    return any(plan.succ[s] is not None for s in rows)


def _in_order(out, at: tuple[int, ...], n: int, like):
    """A row per segment of a range of ``n`` from ``out``, the rows of the segments at positions ``at``
    (the others' rows undefined: nobody reads them; every row where ``out`` is None)."""
    if len(at) == n and out is not None:
        return out
    full = like.new_empty(n, *like.shape[1:])
    if at and out is not None:
        full.index_copy_(0, index_tensor(at, full.device), out)
    return full


class _OnHeads:
    """Contiguous copies of the value heads ``heads`` of a range's tensors, for one pass on a head
    group; ``out`` the buffers the pass writes, copied in where ``copy_in`` (the pass leaves some of
    their rows alone) and written back by ``write_back``."""

    def __init__(self, heads: slice, HV: int, out, copy_in: bool):
        self.heads, self.HV, self.out = heads, HV, out
        fresh = functools.partial(torch.empty_like, memory_format=torch.contiguous_format)
        self.bufs = [self(x) if copy_in else fresh(heads_of(x, heads, HV)) for x in out]

    def __call__(self, x: torch.Tensor | None, dim: int = 2) -> torch.Tensor | None:
        return None if x is None else heads_of(x, self.heads, self.HV, dim).contiguous()

    def write_back(self) -> None:
        for x, buf in zip(self.out, self.bufs):
            heads_of(x, self.heads, self.HV).copy_(buf)


class _FLACore:
    """What GDN and KDA share; the subclasses hold the model's own kernels."""
    fused = False           # the passes fill buffers that ``output`` and ``backward_rest`` read
    head_slices = True      # a pass on a head group copies its heads' part (see the module docstring)
    min_group_heads = CALIBRATION.min_group_heads
    state_reads = "rows"    # passes read the rows of state_rows only; backward_prepare reads h0 where _h0 hands it

    def _range_inputs(self, P: Prepared, lo, hi, *xs):
        """``xs`` on the tokens of segments [lo, hi), and the range's varlen arguments."""
        a, b, cu, ci = _ranges(P.plan, lo, hi, str(xs[0].device))
        return [None if x is None else x[:, a:b] for x in xs], dict(cu_seqlens=cu, chunk_indices=ci)

    def states(self, P: Prepared, h0) -> States:
        u = P.fwd[1]
        NT = _chunk_offsets(P.plan, 0, P.plan.num_segments)[-1]
        return States(h0, h=u.new_empty(1, NT, u.shape[2], P.saved[1].shape[3], u.shape[3]), v_new=torch.empty_like(u))

    def _state_inputs(self, P):
        """(k, w, u, g, gk) of the state pass (and of the maps)."""
        raise NotImplementedError

    def state(self, P: Prepared, st: States, segs, h0, heads=None):
        if heads is None:
            return self._state(P, 0, P.plan.num_segments, segs, self._state_inputs(P), h0, st.h, st.v_new)
        # the heads' part of the range [lo, hi) that segs cover: inputs, initial states, the buffers written
        lo, hi = segs[0], segs[-1] + 1
        a, b = P.plan.token_range(lo, hi)
        off = _chunk_offsets(P.plan, 0, P.plan.num_segments)
        part = _OnHeads(heads, h0.shape[1], (st.h[:, off[lo]:off[hi]], st.v_new[:, a:b]),
                        copy_in=tuple(segs) != tuple(range(lo, hi)))
        xs = [part(None if x is None else x[:, a:b]) for x in self._state_inputs(P)]
        out = self._state(P, lo, hi, segs, xs, part(h0[lo:hi], dim=1), *part.bufs)
        part.write_back()
        return out

    def _state(self, P: Prepared, lo, hi, segs, xs, h0, h, v_new):
        """``state`` on the tensors of the range [lo, hi) that ``segs`` lie in: ``xs`` the state pass's
        inputs on its tokens, ``h0`` a row per segment, ``h`` and ``v_new`` the buffers on its chunks
        and tokens."""
        dev = str(h0.device)
        rows, free, at = _by_state_rows(P, segs)
        out = None
        if rows:
            out = state_pass(_selection(P.plan, lo, hi, rows, dev), *xs, h0, h, v_new,
                             final=_taken(P.plan, P.live, rows, grad=False))
        if free:
            state_pass(_selection(P.plan, lo, hi, free, dev), *xs, None, h, v_new)
        return _in_order(out, at, len(rows) + len(free), h0)

    def maps(self, P: Prepared, segs):
        """fla's CP pre-process on the state pass's inputs (scalar gate for GDN, per-key gate for KDA)."""
        from fla.ops.cp.chunk_fwd import chunk_cp_fwd_h
        k, w, u, g, gk = self._state_inputs(P)
        sel = _selection(P.plan, 0, P.plan.num_segments, tuple(segs), str(k.device))
        hm = k.new_zeros(sel.num_programs, u.shape[2], k.shape[3], u.shape[3] + k.shape[3], dtype=torch.float32)
        chunk_cp_fwd_h(k=k, w=w, u=u, hm=hm, g=g, gk=gk, cu_seqlens=sel.cu, chunk_size=CHUNK, multi_seqs=True)
        return _pick(hm, sel)

    def _h_range(self, P, lo, hi, x):
        off = _chunk_offsets(P.plan, 0, P.plan.num_segments)
        return x[:, off[lo]:off[hi]]

    def backward_state(self, P: Prepared, B: Backward, segs, dht, heads=None):
        if heads is None:
            return self._backward_state(P, B, segs, self._grad_inputs(B), B.dv, dht, B.dh, B.dv2)
        part = _OnHeads(heads, dht.shape[1], (B.dh, B.dv2), copy_in=tuple(segs) != tuple(range(B.lo, B.hi)))
        xs = [part(x) for x in self._grad_inputs(B)]
        out = self._backward_state(P, B, segs, xs, part(B.dv), part(dht, dim=1), *part.bufs)
        part.write_back()
        return out

    def _backward_state(self, P: Prepared, B: Backward, segs, xs, dv, dht, dh, dv2):
        """``backward_state`` on the range's tensors: ``xs`` the state-gradient pass's inputs, ``dv``
        the local value gradient, ``dht`` a row per segment, ``dh`` and ``dv2`` the buffers written."""
        dev = str(dht.device)
        rows, free, at = _by_state_rows(P, segs)
        out = None
        if rows:
            out = state_grad_pass(_selection(P.plan, B.lo, B.hi, rows, dev), *xs, dv, dht, dh, dv2, P.scale,
                                  initial=_taken(P.plan, P.live, rows, grad=True))
        if free:
            state_grad_pass(_selection(P.plan, B.lo, B.hi, free, dev), *xs, dv, None, dh, dv2, P.scale)
        return _in_order(out, at, len(rows) + len(free), dht)

    @staticmethod
    def _h0(P: Prepared, lo, hi, h0):
        """``h0`` of segments [lo, hi) for the backward's state recompute, None where all of them are zero."""
        return h0 if may_be_nonzero(P, lo, hi) else None

    @staticmethod
    def _inputs(q, k, v, g, beta, plan, use_qk_l2norm):
        """What both models do first: contiguous inputs, l2norm of q and k (with its rstd for the
        backward), the chunk-local gate cumsum in log2 units (fla's kernels use exp2), the stream's
        cu_seqlens and chunk indices."""
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        qr = kr = None
        if use_qk_l2norm:
            from fla.modules.norm.l2norm import l2norm_fwd
            (q, qr), (k, kr) = l2norm_fwd(q), l2norm_fwd(k)
        _, _, cu, ci = _ranges(plan, 0, plan.num_segments, str(q.device))
        gc = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu, chunk_indices=ci)
        return q, k, v, gc, beta, qr, kr, dict(cu_seqlens=cu, chunk_indices=ci)

    def finish(self, P: Prepared, grads):
        dq, dk, dv, dg, db = grads
        if P.use_qk_l2norm:
            from fla.modules.norm.l2norm import l2norm_bwd
            q, k, _, _, _, qr, kr = P.saved[:7]
            dq, dk = l2norm_bwd(q, qr, dq), l2norm_bwd(k, kr, dk)
        return dq, dk, dv, dg, db

    def single_device(self, q, k, v, g, beta, *, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                      cu_seqlens_cpu):
        return fla_chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                         cu_seqlens_cpu=cu_seqlens_cpu)

    def cp_call(self, q, k, v, g, beta, *, scale, use_qk_l2norm_in_kernel, cp_context):
        """o of fla's own CP call on this rank's part of a contiguous stream (``cp_context``: fla's
        ``build_cp_context``; :mod:`megatron_kcp.parallel.fla_cp`), with autograd. fla keeps GDN's call
        on its own kernels there: flash-qla refuses a CP context."""
        return fla_chunk(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cp_context=cp_context)


class GDNCore(_FLACore):
    """Gated DeltaNet: one log-decay per head (``g`` ``[1, T, HV]``)."""

    def prepare(self, q, k, v, g, beta, plan, scale, use_qk_l2norm, live=None) -> Prepared:
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        *saved, kw = self._inputs(q, k, v, g, beta, plan, use_qk_l2norm)
        q, k, v, gc, beta = saved[:5]
        w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, chunk_size=CHUNK, **kw)
        return Prepared((*saved, A), plan, scale, use_qk_l2norm, fwd=(w, u), live=live)

    def _state_inputs(self, P):
        return P.saved[1], *P.fwd, P.saved[3], None

    def output(self, P, st: States, lo, hi):
        from fla.ops.common.chunk_o import chunk_fwd_o
        (q, k, g, v_new), kw = self._range_inputs(P, lo, hi, P.saved[0], P.saved[1], P.saved[3], st.v_new)
        return chunk_fwd_o(q=q, k=k, v=v_new, h=self._h_range(P, lo, hi, st.h), g=g, scale=P.scale,
                           **kw).to(q.dtype)

    def backward_prepare(self, P, lo, hi, h0, do) -> Backward:
        """What the state-gradient passes need and the incoming gradients do not change."""
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_bwd_dv_local
        from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
        (q, k, v, g, beta, A, do), kw = self._range_inputs(P, lo, hi, *P.saved[:5], P.saved[7], do)
        w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g, **kw)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=self._h0(P, lo, hi, h0),
                                                   output_final_state=False, **kw)
        dv = chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=P.scale, **kw)
        return Backward(lo, hi, (q, k, w, g, do, h, v_new), dh=torch.empty_like(h), dv=dv, dv2=torch.empty_like(dv),
                        kw=kw)

    def _grad_inputs(self, B):
        q, k, w, g, do = B.xs[:5]
        return q, k, w, g, None, do

    def backward_rest(self, P, B: Backward):
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
        from fla.ops.utils import chunk_local_cumsum
        (q, k, v, g, beta, A), kw = self._range_inputs(P, B.lo, B.hi, *P.saved[:5], P.saved[7])
        _, _, w, _, do, h, v_new = B.xs
        dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=B.dv2, do=do, dh=B.dh, scale=P.scale,
                                         **kw)
        dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=B.dv2, **kw)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **kw)
        return dq, dk, dv, dg, db


class KDACore(_FLACore):
    """Kimi Delta Attention: one log-decay per head and key dim (``g`` ``[1, T, HV, K]``)."""

    def prepare(self, q, k, v, g, beta, plan, scale, use_qk_l2norm, live=None) -> Prepared:
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
        *saved, kw = self._inputs(q, k, v, g, beta, plan, use_qk_l2norm)
        q, k, v, gc, beta = saved[:5]
        w, u, _, kg, Aqk, Akk = chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, chunk_size=CHUNK,
                                                    **kw)
        return Prepared((*saved, Aqk, Akk), plan, scale, use_qk_l2norm, fwd=(w, u, kg), live=live)

    def _state_inputs(self, P):
        return P.fwd[2], P.fwd[0], P.fwd[1], None, P.saved[3]

    def output(self, P, st: States, lo, hi):
        from fla.ops.gla.chunk import chunk_gla_fwd_o_gk
        (q, g, Aqk, v_new), kw = self._range_inputs(P, lo, hi, P.saved[0], P.saved[3], P.saved[7], st.v_new)
        return chunk_gla_fwd_o_gk(q=q, v=v_new, g=g, A=Aqk, h=self._h_range(P, lo, hi, st.h), scale=P.scale,
                                  chunk_size=CHUNK, **kw).to(q.dtype)

    def backward_prepare(self, P, lo, hi, h0, do) -> Backward:
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_dAv
        from fla.ops.kda.wy_fast import recompute_w_u_fwd
        (q, k, v, g, beta, Aqk, Akk, do), kw = self._range_inputs(P, lo, hi, *P.saved[:5], *P.saved[7:9], do)
        w, u, qg, kg = recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, gk=g, q=q, **kw)
        h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=kg, w=w, u=u, gk=g, initial_state=self._h0(P, lo, hi, h0),
                                                   output_final_state=False, **kw)
        dAqk, dv = chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=P.scale, chunk_size=CHUNK, **kw)
        return Backward(lo, hi, (qg, kg, w, g, do, h, v_new, dAqk), dh=torch.empty_like(h), dv=dv,
                        dv2=torch.empty_like(dv), kw=kw)

    def _grad_inputs(self, B):
        qg, kg, w, g, do = B.xs[:5]
        return qg, kg, w, None, g, do

    def backward_rest(self, P, B: Backward):
        from fla.ops.kda.chunk_bwd import chunk_kda_bwd_wy_dqkg_fused
        from fla.ops.kda.chunk_intra import chunk_kda_bwd_intra
        from fla.ops.utils import chunk_local_cumsum
        (q, k, v, g, beta, Akk), kw = self._range_inputs(P, B.lo, B.hi, *P.saved[:5], P.saved[8])
        *_, do, h, v_new, dAqk = B.xs
        dq, dk, dv, db, dg, dAkk = chunk_kda_bwd_wy_dqkg_fused(q=q, k=k, v=v, v_new=v_new, g=g, beta=beta, A=Akk,
                                                               h=h, do=do, dh=B.dh, dv=B.dv2, scale=P.scale,
                                                               chunk_size=CHUNK, **kw)
        dq, dk, db, dg = chunk_kda_bwd_intra(q=q, k=k, g=g, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db,
                                             dg=dg, chunk_size=CHUNK, **kw)
        H, HV = q.shape[2], v.shape[2]
        if HV > H:                               # grouped value heads: q/k gradients summed per q/k head
            dq = dq.view(*dq.shape[:2], H, HV // H, dq.shape[-1]).sum(3)
            dk = dk.view(*dk.shape[:2], H, HV // H, dk.shape[-1]).sum(3)
        dg = chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **kw)
        return dq, dk, dv, dg, db


def core(kda: bool, device: torch.device) -> GDNCore | KDACore:
    """fla's core for GDN (``kda=False``) or KDA, after the environment check for ``device``."""
    check_fla(device)
    return KDACore() if kda else GDNCore()


def fla_chunk(q, k, v, g, beta, **kwargs) -> torch.Tensor:
    """o of fla's own single-device call (``chunk_kda`` for a per-key gate, else
    ``chunk_gated_delta_rule``, which fla hands to flash-qla where that is installed). The gate goes
    in fp32: fla cumsums it in fp32 either way, and flash-qla's backward needs it so."""
    if g.dim() == 4:
        from fla.ops.kda import chunk_kda as fn
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    return fn(q, k, v, g.float(), beta, output_final_state=False, **kwargs)[0]


def fla_max_segment(plan: KCPPlan) -> int:
    """The part length that halves the zigzag middle rank's segment of one sequence under the all-gather on
    fla's kernels; 0 elsewhere. In both zigzag layouts rank W - 1 holds chunks W - 1 and W, neighbours in
    the stream, as one segment twice as long as any other rank's. fla's state passes run a program per
    segment, head and value block along its chunks, so that rank's maps pass (M beside H), state pass
    and state-gradient pass take twice as long as the others', whose two segments run side by side,
    and every rank waits for it at the all-gathers. Cut at the chunk length, its segment runs as two
    parts side by side, which the fold chains (one step more); every other segment stays whole. From
    W = 3, where the other middle ranks export two states each way, the exchange keeps its slots; at
    W = 2 the middle rank would export two states where it exports one, doubling the all-gather: no cut.
    Parts of at least ``CALIBRATION.fla_split_min_part`` tokens: shorter ones leave a rank's step bound by
    its launches, where the cut's extra part costs more than its passes save. One sequence only, as
    measured (benchmarks/reports/): with packed documents a rank's passes run many segments side by side,
    and the longest is no longer the rank's time."""
    cu, W = plan.global_cu_seqlens, plan.world_size
    if plan.layout == "contiguous" or W < 3 or len(cu) != 2:
        return 0
    part = cu[-1] // (2 * W)
    return part if part >= CALIBRATION.fla_split_min_part else 0


registry.register(registry.CoreEntry(
    name="fla", label="fla", runs_on="CUDA with fla-core installed (GDN and KDA)", runs=lambda p: p.cuda,
    build=lambda device, dtype, kda, head_dims: core(kda=kda, device=device), priority=20,
    min_group_heads=_FLACore.min_group_heads, maps_cut=lambda p: fla_max_segment(p.plan)))
