"""All-gather: every rank summarises what it hands on, one all-gather per direction, then a fold.

Forward, each segment with a successor exports one ``[HV, K, V + K]`` slot: a segment that starts
its sequence here exports its true final state ``[S | 0]`` (a state pass: its initial state is
known; on a fused core, from a zero state, the maps pass's ``[S | M]``); one that continues a
sequence exports its affine map ``[H | M]`` (``S_out = M S_in + H``, fla's CP pre-process). After
the all-gather every receiving segment folds the slots of the pieces before it, ``S = M_j S + H_j``
from the sequence start, and the local pass runs once. Backward is the mirror image with
``[dH | M^T]``: dH from a state-gradient pass with a zero final-state gradient, M^T from the
forward's M. All ranks work at once, so the price is the M pass, not
latency: the strategy for many ranks. On a plan with ``max_segment`` it also chains the parts of a rank's
own long segments, so their passes run side by side.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_kcp.kernels.cores import CORES
from megatron_kcp.parallel import registry
from megatron_kcp.parallel.comm import all_gather
from megatron_kcp.parallel.cost_model import costs, needs_maps
from megatron_kcp.kernels.core import zeroed_states
from megatron_kcp.plan import KCPPlan, index_tensor, keep_starts
from megatron_kcp.parallel.strategy import StateExchange


def fold(gathered: torch.Tensor, chains, out: torch.Tensor, merge=None) -> None:
    """``out[c.segment] = fold over c.sources`` for every chain. ``gathered`` ``[W, slots, HV, K, V+K]``;
    ``merge``: the fold of chains of several sources (None: :func:`fold_merge` on CUDA, else
    :func:`fold_reference`).

    The chains of one sequence are prefixes of its longest (the pieces before a segment, or after it
    in the backward), so each sequence is folded once, along its longest chain, and every chain takes
    the state after its last source. On CUDA that is one launch of fla's merge of gathered summaries
    (``chunk_cp_fwd_bwd_kernel_merge``, the kernel of fla's intra-card CP: a program per sequence,
    head and value block walks its chain; products in TF32x3, near fp32): a chain of parts is as
    long as a sequence has parts (64 for 1M tokens over W = 8 in parts of 16384), and a launch a
    step would leave the step waiting for its host. Elsewhere :func:`fold_reference`. Where every
    chain has one source (each crossing document in two pieces: the contiguous layout at W = 2, where
    the mixers convert to), a chain's state is its source's H, and the fold is two index copies (one
    copy for one chain: a rank of the contiguous layout receives one state each way)."""
    if not chains:
        return
    if all(len(c.sources) == 1 for c in chains):
        V = out.shape[-1]
        if len(chains) == 1:                    # one copy (a rank of the contiguous layout receives one)
            (r, s), = chains[0].sources
            out[chains[0].segment].copy_(gathered[r, s, ..., :V])
            return
        rows = index_tensor([r * gathered.shape[1] + s for c in chains for r, s in c.sources], out.device)
        out.index_copy_(0, index_tensor([c.segment for c in chains], out.device),
                        gathered.flatten(0, 1)[..., :V].index_select(0, rows))
        return
    (merge or (fold_merge if gathered.is_cuda else fold_reference))(gathered, chains, out)


def fold_merge(gathered: torch.Tensor, chains, out: torch.Tensor) -> None:
    """:func:`fold` on fla's merge kernel."""
    import triton
    from fla.ops.cp.chunk_merge import chunk_cp_fwd_bwd_kernel_merge
    HV, K, V = out.shape[1:]
    m = _merge_plan(tuple(chains), gathered.shape[1], str(out.device))
    states = out.new_empty(m.num_states, HV, K, V)
    chunk_cp_fwd_bwd_kernel_merge[lambda meta: (-(-V // meta["BV"]), m.num_seqs, HV)](
        h=states, ag_hm=gathered.flatten(0, 1).index_select(0, m.rows), num_ranks=m.num_seqs, rank=0,
        seq_offsets=m.seq_offsets, init_offsets=m.init_offsets, h0_seq_ids=None, h0=None, h_seq_idx=None,
        HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), FORWARD=True, IS_INTRACARD=True, N=m.num_seqs)
    out.index_copy_(0, m.segments, states if m.picks is None else states.index_select(0, m.picks))


@dataclass(frozen=True)
class _Merge:
    """Index tensors of one fold on fla's merge kernel (per plan and direction, built once)."""
    rows: torch.Tensor                  # the summaries, sequence by sequence along its longest chain, each
    seq_offsets: torch.Tensor           # closed by a repeat of its last row: the kernel stores every prefix
    init_offsets: torch.Tensor          # but the last (int32, as the kernel reads them)
    num_seqs: int
    num_states: int                     # prefixes stored: one per summary of a longest chain
    segments: torch.Tensor              # the chains' segments, and the stored prefix each takes
    picks: torch.Tensor | None          # (None: the prefixes in segment order, one each)


@functools.lru_cache(maxsize=256)
def _merge_plan(chains, slots: int, device: str) -> _Merge:
    seqs, longest = _longest(chains, slots)
    rows, seq_off, init_off = [], [0], [0]
    for n in seqs:
        rows += longest[n] + longest[n][-1:]
        seq_off.append(len(rows))
        init_off.append(init_off[-1] + len(longest[n]))
    picks = [init_off[seqs.index(c.seq)] + len(c.sources) - 1 for c in chains]
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return _Merge(index_tensor(rows, device), i32(seq_off), i32(init_off), len(seqs), init_off[-1],
                  index_tensor([c.segment for c in chains], device),
                  None if picks == list(range(init_off[-1])) else index_tensor(picks, device))


def _longest(chains, slots: int):
    """(sequences, longest first; {sequence: the rows of ``gathered.flatten(0, 1)`` along its longest chain})."""
    longest = {}
    for c in chains:
        if len(c.sources) > len(longest.get(c.seq, ())):
            longest[c.seq] = c.sources
    seqs = sorted(longest, key=lambda n: -len(longest[n]))
    return seqs, {n: [r * slots + s for r, s in longest[n]] for n in seqs}


def fold_reference(gathered: torch.Tensor, chains, out: torch.Tensor) -> None:
    """:func:`fold` in PyTorch: all sequences step together along their longest chains, longest first,
    so the live ones are a prefix: one batched product a step, no gather where one sequence is live.
    Products in full fp32 (no TF32: the chains carry state across the whole sequence)."""
    V = gathered.shape[-1] - gathered.shape[-2]
    flat = gathered.flatten(0, 1)
    seqs, longest = _longest(chains, gathered.shape[1])
    rows = [longest[n] for n in seqs]
    pos = {n: i for i, n in enumerate(seqs)}
    ends = {}                                   # step -> chains whose last source it folds
    for c in chains:
        ends.setdefault(len(c.sources) - 1, []).append(c)

    def ix(values):
        return index_tensor(values, flat.device)

    def take(j):                                # rows j of the live sequences' longest chains
        live = [r[j] for r in rows if len(r) > j]
        return flat[live[0]][None] if len(live) == 1 else flat.index_select(0, ix(live))
    S, parts, segs = take(0)[..., :V], [], []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for j in range(len(rows[0])):
            if j:
                src = take(j)
                n = src.shape[0]
                S = torch.baddbmm(src[..., :V].flatten(0, 1), src[..., V:].flatten(0, 1),
                                  S[:n].flatten(0, 1)).view(n, *S.shape[1:])
            if j in ends:
                at = [pos[c.seq] for c in ends[j]]
                parts.append(S if at == list(range(S.shape[0])) else S.index_select(0, ix(at)))
                segs += [c.segment for c in ends[j]]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out.index_copy_(0, ix(segs), parts[0] if len(parts) == 1 else torch.cat(parts))


class AllGather(StateExchange):
    """Named, or under the default wherever the local core runs an all-gather with transition maps, or needs
    none (a core named whose ``gather_maps`` is False runs the relay where maps would be needed: flash-qla's
    all-gather with maps lost to its relay on the GPU runs). The only strategy of a split plan. Its cost: its
    slowest rank and the ring all-gather of its slots, a direction (:func:`cost_model.costs`)."""
    name = "gather"
    order = 1
    merge = None        # fold's merge of chains of several sources (None: its own pick)

    def applicable(self, problem):
        if problem.strategy != "auto":
            return problem.strategy == self.name
        return bool(problem.split) or problem.core == "auto" or CORES[problem.core].gather_maps or \
            not self.uses_maps(problem)

    def uses_maps(self, problem):
        plan = problem.plan
        return plan.world_size > 1 and needs_maps(plan.global_cu_seqlens, plan.layout, plan.world_size)

    def cost(self, problem):
        return costs(problem.plan.global_cu_seqlens, problem.plan.layout, problem.world_size, problem.value_heads)[1]

    def forward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor):
        """(output, the transitions M of the segments that continue a sequence both ways: their M^T is
        the backward's export); fills ``h0`` with the folded states."""
        n, st, M, done = plan.num_segments, core.states(P, h0), None, []
        if not plan.is_local:
            HV, K, V = h0.shape[1:]
            slot = {s: j for j, s in enumerate(plan.send_fwd)}
            buf = h0.new_zeros(plan.num_slots_fwd, HV, K, V + K)
            # a segment that starts its sequence knows its initial state: its pass is final
            done = [s for s in plan.send_fwd if plan.pred[s] is None]
            middle = [s for s in plan.send_fwd if plan.pred[s] is not None]
            ride = self._through_maps(core, P, done, middle)
            own = [s for s in done if s not in ride]
            if own:
                buf[..., :V].index_copy_(0, index_tensor([slot[s] for s in own], buf.device),
                                         core.state(P, st, own, h0))
            if middle:
                export = sorted(middle + ride)
                maps = core.maps(P, export)
                buf.index_copy_(0, index_tensor([slot[s] for s in export], buf.device), maps)
                M = maps[..., V:]
                if ride:                        # the backward's M^T: the segments that continue both ways
                    row = {s: j for j, s in enumerate(export)}
                    M = M.index_select(0, index_tensor([row[s] for s in middle], M.device))
                M = M.contiguous()
            fold(_all_gather(buf, plan, group), plan.recv_fwd, h0, self.merge)
        rest = _others(n, done)
        if rest and not core.fused:           # a fused core's output runs its own state pass
            core.state(P, st, rest, h0)
        return core.output(P, st, 0, n), M

    def _through_maps(self, core, P, done, middle):
        """The sequence starts in ``done`` whose final state the maps pass exports as its H: on a fused
        core (its state pass exists only to export), where that pass runs anyway (``middle``), from a
        zero initial state (H is then the final state; the fold never reads a start's M). flash-qla's
        pass is one scan a part and head, so the rank holding a sequence's first part then runs no
        more passes before the forward's all-gather than the ranks that hold its middle."""
        if not (core.fused and middle and P.live is not None):
            return []
        return [s for s in done if s not in P.live]

    def backward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor, do: torch.Tensor, M):
        n, done = plan.num_segments, []
        B = core.backward_prepare(P, 0, n, h0, do)
        # dh0: rows set by keep_starts, the only ones read
        dht, dh0 = zeroed_states(core, P, h0.shape, h0.device, grad=True), torch.empty_like(h0)
        if not plan.is_local:
            HV, K, V = h0.shape[1:]
            buf = h0.new_zeros(plan.num_slots_bwd, HV, K, V + K)
            send = list(plan.send_bwd)
            if send:
                dH = core.backward_state(P, B, send, dht)
                buf[:len(send), ..., :V] = dH
                # a segment that ends its sequence has a zero final-state gradient: its pass is final
                # (and it has a predecessor, so its dh0 does not leave the op)
                done = [s for s in send if plan.succ[s] is None]
            # segments that also export forward continue their sequence both ways: their M^T folds
            middle = [s for s in plan.send_fwd if plan.pred[s] is not None]
            slot = {s: j for j, s in enumerate(send)}
            if middle:
                buf[..., V:].index_copy_(0, index_tensor([slot[s] for s in middle], buf.device), M.transpose(-1, -2))
            fold(_all_gather(buf, plan, group), plan.recv_bwd, dht, self.merge)
        rest = _others(n, done)
        if core.fused:                        # its backward runs its own pass: only dh0 that leaves the op
            rest = [s for s in rest if plan.pred[s] is None]
        if rest:
            d = core.backward_state(P, B, rest, dht)
            keep_starts(plan, dh0, d, rest, P.live)
        return core.backward_rest(P, B), dh0


def _all_gather(buf, plan: KCPPlan, group):
    """The exchange buffer of every rank; a rank alone (``max_segment`` at CP = 1) folds its own."""
    return buf[None] if plan.world_size == 1 else all_gather(buf, group)


def _others(n, done):
    done = set(done)
    return [i for i in range(n) if i not in done]


registry.register(AllGather())
