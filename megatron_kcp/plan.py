"""Where each CP rank's tokens sit in the packed global stream, and what KCP exchanges.

A layout hands every rank a list of *pieces*: intervals ``[start, end)`` of the global token
stream, concatenated in local order. Everything else follows from the pieces and the global
``cu_seqlens``: the local segments (sequences cut at piece edges, except between two local pieces
that are neighbours in the stream), each segment's neighbours along its sequence on other ranks
(``pred``, ``succ``: where its initial state comes from and where its final state goes), the
all-gather's fold chains, and the conv halo of every piece.

Layouts (``megatron.core.utils.get_batch_on_this_cp_rank``):

* ``contiguous``      rank r holds tokens ``[rT/W, (r+1)T/W)`` of the stream.
* ``zigzag``          per-sequence balancing: the stream is cut into 2W chunks, rank r holds
                      chunks r and 2W-1-r (Megatron's layout when cu_seqlens is None).
* ``zigzag_per_doc``  per-document balancing: every document (of the padded cu_seqlens) is cut
                      into 2W chunks, rank r holds chunks r and 2W-1-r of each, in document order.
                      Also the layout of a ``[b, s]`` batch split per row, with documents = rows.

Plans are built on the CPU from Python ints, once per (cu_seqlens, layout, W, r) and cached,
so the hot path does no device sync.
"""
from __future__ import annotations

import bisect
import functools
import weakref
from dataclasses import dataclass

import torch

LAYOUTS = ("contiguous", "zigzag", "zigzag_per_doc")
MAX_HEAD_DIM = 256


Link = tuple[int, int]        # (rank, local segment) of a neighbouring segment of the same sequence


@dataclass(frozen=True)
class Chain:
    """A local segment whose state (forward) or state gradient (backward) comes from other pieces.

    ``sources`` are (rank, slot) in the all-gathered exchange buffer, ordered so that a fold
    ``S = M_j S + H_j`` over them runs along the recurrence (forward: from the sequence start up
    to this segment; backward: from the sequence end down to it). The first source starts its
    sequence (forward) or ends it (backward), so its M is never needed.
    """
    segment: int
    seq: int
    sources: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class KCPPlan:
    """One rank's view of the CP layout. Local segments are the local stream cut at sequence starts
    and at piece edges, except where two local pieces are neighbours in the global stream (zigzag's
    middle rank): those run as one segment, so nothing is exchanged between them."""
    world_size: int
    rank: int
    layout: str
    global_cu_seqlens: tuple[int, ...]              # the packed global stream
    pieces: tuple[tuple[int, int], ...]             # this rank's [start, end), local order
    cu_seqlens: tuple[int, ...]                     # local segments, local token offsets
    seg_seq: tuple[int, ...]                        # global sequence of each local segment
    seg_start: tuple[int, ...]                      # global position of each segment's first token
    pred: tuple[Link | None, ...]                   # the segment before this one in its sequence
    succ: tuple[Link | None, ...]                   # the segment after it
    stage: tuple[int, ...]                          # position of the segment along its sequence (0: first)
    num_stages: tuple[int, ...]                     # segments of the segment's sequence, over all ranks
    send_fwd: tuple[int, ...]                       # segments exporting their state map (they have a succ)
    send_bwd: tuple[int, ...]                       # segments exporting their state-gradient map (a pred)
    recv_fwd: tuple[Chain, ...]                     # segments whose initial state is folded
    recv_bwd: tuple[Chain, ...]                     # segments whose final-state gradient is folded
    num_slots_fwd: int                              # exchange buffer slots per rank (max over ranks; 0: no exchange)
    num_slots_bwd: int
    conv_kernel_size: int
    halo_src: tuple[tuple[int, int, int], ...]      # per halo row: (rank, piece, tail row) or (-1, 0, 0) = zero
    max_segment: int = 0                            # segments split into parts of at most this many tokens (0: not)

    def __hash__(self) -> int:
        """The hash of what determines the plan, computed once: every cache of the step is keyed by the
        plan, and its tuples hold hundreds of segments a rank on packed documents."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.world_size, self.rank, self.layout, self.global_cu_seqlens, self.conv_kernel_size,
                      self.max_segment))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):
        """Pickled without the cached hash: strings hash differently in another process."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def num_pieces(self) -> int:
        """Pieces per rank (the same on every rank in every layout)."""
        return len(self.pieces)

    @property
    def num_segments(self) -> int:
        return len(self.seg_seq)

    @property
    def num_seqs(self) -> int:
        return len(self.global_cu_seqlens) - 1

    @property
    def num_local_tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def halo_len(self) -> int:
        return self.conv_kernel_size - 1

    @property
    def is_local(self) -> bool:
        """No sequence crosses a rank: nothing to exchange on any rank."""
        return self.num_slots_fwd == 0

    @property
    def pre_num_ranks(self) -> int:
        """Earlier ranks holding part of this rank's first sequence."""
        c = next((c for c in self.recv_fwd if c.segment == 0), None)
        return 0 if c is None else len({r for r, _ in c.sources} - {self.rank})

    @property
    def post_num_ranks(self) -> int:
        """Later ranks holding part of this rank's last sequence."""
        last = self.num_segments - 1
        c = next((c for c in self.recv_bwd if c.segment == last), None)
        return 0 if c is None else len({r for r, _ in c.sources} - {self.rank})

    @property
    def num_conv_halo_tokens(self) -> int:
        """Tokens of the same sequences this rank receives for its short conv."""
        return sum(r >= 0 for r, _, _ in self.halo_src)

    def starts_among(self, segs) -> list[int]:
        """Positions in ``segs`` of the segments that start their sequence: where the user's initial
        state enters, and so the only rows of the initial-state gradient that leave the op."""
        return [j for j, s in enumerate(segs) if self.pred[s] is None]

    def token_range(self, lo: int, hi: int) -> tuple[int, int]:
        """Local tokens of segments [lo, hi)."""
        return self.cu_seqlens[lo], self.cu_seqlens[hi]

    def cu_seqlens_tensor(self, device=None) -> torch.Tensor:
        return index_tensor(self.cu_seqlens, device)


@functools.lru_cache(maxsize=4096)
def _as_tensor_cached(values: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def index_tensor(values, device=None) -> torch.Tensor:
    """``values`` as a LongTensor on ``device``, built once (cached: never write into it). Indexing a
    CUDA tensor with a Python list copies the list to the device and waits for the stream, a host sync
    that leaves the GPU idle behind every transfer in flight while the host catches up with its
    launches. A plan is fixed, and so are its index lists."""
    return _as_tensor_cached(tuple(values), str(torch.device("cpu") if device is None else device))


def keep_starts(plan: KCPPlan, dh0: torch.Tensor, d: torch.Tensor, segs, live=None) -> None:
    """``dh0[s] = d[j]`` for the segments ``s = segs[j]`` that start their sequence (``d``: a row per
    segment of ``segs``): the only initial-state gradients that leave the op. ``live`` (``Prepared.live``):
    only the starts in it, the others' initial state is zero (no user state), so their gradient goes
    nowhere (and a core may leave its row undefined)."""
    starts = [j for j in plan.starts_among(segs) if live is None or segs[j] in live]
    if starts:
        dev = d.device
        dh0.index_copy_(0, index_tensor([segs[j] for j in starts], dev), d.index_select(0, index_tensor(starts, dev)))


_last_cu: tuple = (None, -1, ())


def _cu_list(t: torch.Tensor) -> list[int]:
    """``t.tolist()``, once per tensor: every layer of a step reads the same cu_seqlens, and reading a
    CUDA tensor is a host sync. Keyed by the object (a weak reference) and its version, so a new
    batch or an in-place change is read again."""
    global _last_cu
    if t.is_inference():                                  # no version counter to key on
        return t.tolist()
    ref, version, values = _last_cu
    if ref is None or ref() is not t or t._version != version:
        values = t.tolist()
        _last_cu = (weakref.ref(t), t._version, values)
    return values


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_cu_seqlens(cu_seqlens) -> tuple[int, ...]:
    """cu_seqlens as a tuple of ints, validated; names the fix on bad input."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu" and capturing():
            raise ValueError("cu_seqlens on the GPU while a CUDA graph is captured: KCP reads them on the host to "
                             "plan its exchange, which capture forbids, and the graph would replay this plan for every "
                             "later batch. Capture only calls whose cu_seqlens never change, given as a tuple or a "
                             "CPU tensor")
        batched = cu_seqlens.dim() == 2 and cu_seqlens.shape[0] == 1   # Megatron keeps a (1, n) batch dim
        if not (cu_seqlens.dim() == 1 or batched) or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got shape {tuple(cu_seqlens.shape)} "
                             f"and dtype {cu_seqlens.dtype}")
        cu_seqlens = _cu_list(cu_seqlens)[0] if batched else _cu_list(cu_seqlens)
    cu = tuple(int(x) for x in cu_seqlens)
    if len(cu) < 2:
        raise ValueError(f"cu_seqlens {list(cu)} holds no sequence: give the offsets [0, len_0, len_0 + len_1, ...] "
                         "of at least one")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 (got {list(cu[:4])}...): prepend 0 "
                         "(cu_seqlens = [0, len_0, len_0 + len_1, ...])")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        i = next(i for i, (a, b) in enumerate(zip(cu, cu[1:])) if b <= a)
        raise ValueError(f"cu_seqlens must be strictly increasing, but cu_seqlens[{i}]={cu[i]} >= "
                         f"cu_seqlens[{i + 1}]={cu[i + 1]}: drop empty sequences")
    return cu


def layout_pieces(layout: str, cu: tuple[int, ...], world_size: int, rank: int) -> list[tuple[int, int]]:
    """This rank's pieces of the global stream, in local order; raises if the layout can't split it."""
    total, W = cu[-1], world_size
    if layout == "contiguous":
        if total % W:
            raise ValueError(f"{total} tokens cannot be split over {W} CP ranks by the contiguous layout: "
                             f"pad the packed sequence to a multiple of {W}")
        n = total // W
        return [(rank * n, (rank + 1) * n)]
    if layout == "zigzag":
        docs = [(0, total)]
    elif layout == "zigzag_per_doc":
        docs = list(zip(cu[:-1], cu[1:]))
    else:
        raise ValueError(f"unknown CP layout {layout!r}: choose one of {LAYOUTS}")
    pieces = []
    for s, e in docs:
        if (e - s) % (2 * W):
            what = "the packed sequence" if layout == "zigzag" else f"document [{s}, {e})"
            raise ValueError(f"{what} has {e - s} tokens, not a multiple of 2*CP = {2 * W} as the {layout} "
                             f"layout needs: pad it (Megatron: --pad-to-multiple / cu_seqlens_padded)")
        c = (e - s) // (2 * W)
        pieces += [(s + rank * c, s + (rank + 1) * c), (s + (2 * W - 1 - rank) * c, s + (2 * W - rank) * c)]
    return pieces


def _segments(pieces, cu, max_segment=0):
    """Local segments: (global start, global end, global sequence), cut at sequence starts and at
    piece edges, except between local pieces that are neighbours in the global stream; then, with
    ``max_segment``, each split into parts of that many tokens from its start (the last one shorter)."""
    segs = []
    for s, e in pieces:
        n = bisect.bisect_right(cu, s) - 1
        while s < e:
            end = min(e, cu[n + 1])
            if segs and segs[-1][1] == s and segs[-1][2] == n:       # continues the previous local piece
                segs[-1] = (segs[-1][0], end, n)
            else:
                segs.append((s, end, n))
            s, n = end, n + 1
    if max_segment:
        segs = [(a, min(a + max_segment, e), n) for s, e, n in segs for a in range(s, e, max_segment)]
    return segs


@functools.lru_cache(maxsize=32)
def all_plans(cu_seqlens: tuple[int, ...], layout: str, world_size: int, conv_kernel_size: int = 1,
              max_segment: int = 0) -> tuple[KCPPlan, ...]:
    """Every rank's plan of this layout, built once (cached on the hashable arguments): what a decision
    all ranks must share (strategy, kernels) reads, and what one rank's plan is taken from.
    ``max_segment``: see :func:`split_segments`."""
    cu = check_cu_seqlens(cu_seqlens)
    if max_segment < 0:
        raise ValueError(f"max_segment must be >= 0 (0: segments not cut), got {max_segment}")
    if world_size < 1:
        raise ValueError(f"the CP size must be >= 1, got {world_size}")
    if conv_kernel_size < 1:
        raise ValueError(f"conv kernel size must be >= 1, got {conv_kernel_size}")
    return _build(cu, layout, world_size, conv_kernel_size, max_segment)


def build_plan(cu_seqlens, layout: str, world_size: int, rank: int, conv_kernel_size: int = 1,
               max_segment: int = 0) -> KCPPlan:
    """The KCP plan of ``rank`` (one of :func:`all_plans`)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"CP rank {rank} is outside the CP group of size {world_size}")
    return all_plans(check_cu_seqlens(cu_seqlens), layout, world_size, conv_kernel_size, max_segment)[rank]


def _build(cu, layout, world_size, conv_kernel_size, max_segment) -> tuple[KCPPlan, ...]:
    W = world_size
    all_pieces = [layout_pieces(layout, cu, W, r) for r in range(W)]
    all_segs = [_segments(p, cu, max_segment) for p in all_pieces]

    # every sequence's segments in global order, as (rank, local segment)
    by_seq: dict[int, list[tuple[int, int, int]]] = {}
    for r, segs in enumerate(all_segs):
        for i, (s, _, n) in enumerate(segs):
            by_seq.setdefault(n, []).append((s, r, i))
    pred, succ, stage, nstage = ({} for _ in range(4))
    for n, lst in by_seq.items():
        lst.sort()
        links = [(r, i) for _, r, i in lst]
        for j, link in enumerate(links):
            pred[link] = links[j - 1] if j else None
            succ[link] = links[j + 1] if j + 1 < len(links) else None
            stage[link], nstage[link] = j, len(links)

    # exchange slots: forward exports every segment with a successor, backward every one with a predecessor
    slot_fwd = [{i: k for k, i in enumerate(i for i in range(len(all_segs[r])) if succ[(r, i)])} for r in range(W)]
    slot_bwd = [{i: k for k, i in enumerate(i for i in range(len(all_segs[r])) if pred[(r, i)])} for r in range(W)]

    order = sorted((s, e, r, p) for r in range(W) for p, (s, e) in enumerate(all_pieces[r]))
    starts = [o[0] for o in order]
    chains = {n: [(r, j) for _, r, j in lst] for n, lst in by_seq.items()}
    return tuple(_rank_plan(cu, layout, W, rank, conv_kernel_size, max_segment, all_pieces[rank], all_segs[rank],
                            chains, pred, succ, stage, nstage, slot_fwd, slot_bwd, order, starts)
                 for rank in range(W))


def _rank_plan(cu, layout, W, rank, conv_kernel_size, max_segment, pieces, segs, chains, pred, succ, stage, nstage,
               slot_fwd, slot_bwd, order, starts) -> KCPPlan:
    """One rank's plan from what every rank's shares (each sequence's chain of (rank, segment) links)."""
    me = [(rank, i) for i in range(len(segs))]
    recv_fwd, recv_bwd = [], []
    for i, link in enumerate(me):
        n = segs[i][2]
        chain = chains[n]
        before, after = chain[:stage[link]], chain[stage[link] + 1:]
        if before:
            recv_fwd.append(Chain(i, n, tuple((r, slot_fwd[r][j]) for r, j in before)))
        if after:
            recv_bwd.append(Chain(i, n, tuple((r, slot_bwd[r][j]) for r, j in reversed(after))))

    # conv halo: the kernel_size-1 tokens before each piece, from the tails of earlier pieces
    halo = []
    hl = conv_kernel_size - 1
    for s, _ in pieces:
        n = bisect.bisect_right(cu, s) - 1
        for x in range(s - hl, s):
            if x < cu[n]:
                halo.append((-1, 0, 0))
                continue
            _, pe, r, q = order[bisect.bisect_right(starts, x) - 1]
            halo.append((r, q, hl - (pe - x)))       # tail rows hold the last hl tokens of a piece

    local = [0]
    for a, b, _ in segs:
        local.append(local[-1] + b - a)
    return KCPPlan(
        world_size=W, rank=rank, layout=layout, global_cu_seqlens=cu, pieces=tuple(pieces),
        cu_seqlens=tuple(local), seg_seq=tuple(n for *_, n in segs), seg_start=tuple(s for s, _, _ in segs),
        pred=tuple(pred[x] for x in me), succ=tuple(succ[x] for x in me),
        stage=tuple(stage[x] for x in me), num_stages=tuple(nstage[x] for x in me),
        send_fwd=tuple(slot_fwd[rank]), send_bwd=tuple(slot_bwd[rank]),
        recv_fwd=tuple(recv_fwd), recv_bwd=tuple(recv_bwd),
        num_slots_fwd=max(len(x) for x in slot_fwd), num_slots_bwd=max(len(x) for x in slot_bwd),
        conv_kernel_size=conv_kernel_size, halo_src=tuple(halo), max_segment=max_segment,
    )


def split_segments(plan: KCPPlan, max_segment: int) -> KCPPlan:
    """The same layout with every local segment cut into parts of at most ``max_segment`` tokens, linked
    along their sequence as pieces on other ranks are. Under the all-gather every part's map runs at
    once and the fold chains them locally: parallel work where a rank holds a few long segments and
    a kernel runs one program per segment and head (few heads). For the gated delta rule only: the
    conv's halo follows the pieces, and ``causal_conv1d`` refuses a plan with ``max_segment``."""
    return build_plan(plan.global_cu_seqlens, plan.layout, plan.world_size, plan.rank, plan.conv_kernel_size,
                      max_segment)


def local_token_index(plan: KCPPlan) -> torch.Tensor:
    """Global stream position of every local token (to shard a global tensor in tests and tools)."""
    return torch.cat([torch.arange(s, e) for s, e in plan.pieces])


def cp_group_from_megatron():
    """(group, world_size, rank) of Megatron's context-parallel group; a clear error if there is none."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("KCP needs Megatron's CP process group, but megatron.core.parallel_state is not "
                           "initialised: call parallel_state.initialize_model_parallel(context_parallel_size=...) "
                           "(pretrain_gpt.py does this) or pass group=")
    return ps.get_context_parallel_group(), ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()


def plan_for_cp_group(cu_seqlens, layout: str = "contiguous", conv_kernel_size: int = 1, group=None) -> KCPPlan:
    """The plan of this process in ``group`` (default: Megatron's CP group)."""
    if group is None:
        group, world_size, rank = cp_group_from_megatron()
    else:
        import torch.distributed as dist
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    return build_plan(check_cu_seqlens(cu_seqlens), layout, world_size, rank, conv_kernel_size)
