"""What an exchange strategy calls on a local core, and the records they pass between them.

A *local core* computes one rank's part of the gated delta rule on sets of its local segments
(``KCPPlan``: the local stream cut at sequence starts and piece edges), given each segment's initial
state (forward) or final-state gradient (backward). An *exchange strategy*
(:mod:`megatron_kcp.parallel.strategy`) decides which segments run when and what crosses ranks. The
cores are in :mod:`megatron_kcp.ops` (``core_reference``: the pure-PyTorch oracle, ``core_fla``:
fla-core's chunk kernels, ``core_qla``: flash-qla's fused GDN kernels); a new core is one file
implementing :class:`LocalCore`.

The calls of one step, forward::

    P = core.prepare(q, k, v, g, beta, plan, scale, use_qk_l2norm, live)   # what needs no state, whole stream
    st = core.states(P, h0)
    core.state(P, st, segs, h0)        # state passes on any sets of segments, as their states arrive
    core.state(P, st, segs, h0, heads) # ... on a group of value heads only (the relay's pipeline)
    core.maps(P, segs)                 # [H | M] where a strategy gathers affine maps
    core.output(P, st, lo, hi)         # outputs of a range whose state passes are done

backward (``P`` rebuilt from ``P.saved``)::

    B = core.backward_prepare(P, lo, hi, h0[lo:hi], do)   # what needs no incoming state gradient
    core.backward_state(P, B, segs, dht)                  # state-gradient passes on sets in [lo, hi)
    core.backward_state(P, B, segs, dht, heads)           # ... on a group of value heads only
    core.backward_rest(P, B)                              # input gradients of the range
    core.finish(P, grads)                                 # of the prepared tensors -> of the inputs

Shapes: q, k ``[1, T, H, K]``, v ``[1, T, HV, V]``, g ``[1, T, HV]`` (GDN) or ``[1, T, HV, K]``
(KDA), beta ``[1, T, HV]``; states and state gradients ``[segments, HV, K, V]`` fp32, one row per
local segment unless a method says otherwise; maps ``[segments, HV, K, V + K]`` fp32.

Heads are independent, so a pass can run on a group of value heads (``heads``: a slice of the HV
value heads, holding whole q/k heads: value head i reads q/k head ``i // (HV / H)``); its state
(gradient) rows are then ``[len(segs), len(heads), K, V]``, and what it leaves for ``output`` /
``backward_rest`` covers those heads only, the other groups' passes the rest. A core that runs head
groups says so with ``head_slices``.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megatron_kcp.plan import KCPPlan, index_tensor


@dataclass
class Prepared:
    """A core's inputs for one step. ``saved`` survives into the backward; ``fwd`` does not."""
    saved: tuple                        # the prepared inputs the backward keeps (each core's own layout, q first)
    plan: KCPPlan
    scale: float
    use_qk_l2norm: bool  # q and k are l2-normalised inside the op
    fwd: tuple = ()                     # forward-only intermediates (fla: the WY form's w, u)
    live: frozenset | None = None       # segments whose initial state may be nonzero (None: any of them)

    @property
    def qk_heads(self) -> int:
        """H, the q/k heads (every core saves q ``[1, T, H, K]`` first)."""
        return self.saved[0].shape[2]


@dataclass
class States:
    """What the forward's state passes leave for ``output``, filled segment set by segment set."""
    h0: torch.Tensor                    # every local segment's initial state, filled as states arrive
    h: torch.Tensor | None = None       # chunk-start states [1, chunks, HV, K, V] (fla)
    v_new: torch.Tensor | None = None   # values after the delta rule [1, T, HV, V] (fla)
    o: torch.Tensor | None = None       # outputs the state passes computed themselves (reference)


@dataclass
class Backward:
    """One range [lo, hi) of segments in the backward: what ``backward_prepare`` computed, and what
    the state-gradient passes fill."""
    lo: int
    hi: int
    xs: tuple                           # the range's prepared and recomputed tensors (each core's own layout)
    dh: torch.Tensor | None = None      # chunk state gradients [1, chunks, HV, K, V] (fla)
    dv: torch.Tensor | None = None      # local value gradient, input of the state-gradient pass (fla)
    dv2: torch.Tensor | None = None     # ... with the state's share, its output (fla)
    dht: torch.Tensor | None = None     # final-state gradients, a row per segment of the range (qla)
    grads: list | None = None           # input gradients of the range, filled pass by pass (reference)
    kw: dict = field(default_factory=dict)   # the range's varlen arguments for the kernels


class LocalCore(Protocol):
    """One rank's gated delta rule on sets of its local segments (see the module docstring)."""

    fused: bool
    """True where ``output`` and ``backward_rest`` run their own state (gradient) passes: a strategy
    then runs ``state`` / ``backward_state`` only where a result leaves the rank or the op."""

    head_slices: bool
    """True where ``state`` and ``backward_state`` take ``heads`` (a group of value heads)."""

    min_group_heads: int | None
    """Value heads a group needs before its pass runs shorter than all heads' at once (the relay's
    pipeline, :func:`megatron_kcp.parallel.cost_model.pipeline_depth`); None: never on this core."""

    state_reads: str
    """Which rows of the initial states ``h0`` and final-state gradients ``dht`` the passes read, so
    that a strategy zeroes no more (:func:`zeroed_states`):

    * ``"all"``: every row, zero where no state arrived;
    * ``"rows"``: ``state`` and ``backward_state`` only the rows of :func:`state_rows`, and
      ``backward_prepare`` ``h0`` only on a range that holds a segment of ``P.live`` (fla: a pass per
      set of segments);
    * ``"nonzero"``: a pass on a range reads every row of it where one can be nonzero
      (:func:`may_be_nonzero`) and none otherwise (flash-qla: its kernels take None for zero states).
    """

    def prepare(self, q, k, v, g, beta, plan: KCPPlan, scale: float, use_qk_l2norm: bool,
                live: frozenset | None = None) -> Prepared:
        """Everything that needs no state, over the whole local stream."""

    def states(self, P: Prepared, h0: torch.Tensor) -> States:
        """Empty buffers of the forward's state passes; ``h0`` is every segment's initial state."""

    def state(self, P: Prepared, st: States, segs, h0: torch.Tensor, heads: slice | None = None) -> torch.Tensor:
        """Final states ``[len(segs), HV, K, V]`` of the local segments ``segs`` (sorted) from their
        initial states in ``h0``; what ``output`` needs goes into ``st``. A row nobody takes (no
        successor) may be left undefined. ``heads``: the pass on those value heads only (rows
        ``[len(segs), len(heads), K, V]``; ``h0`` still holds every head); None: on all of them."""

    def maps(self, P: Prepared, segs) -> torch.Tensor:
        """The affine map ``S_out = M S_in + H`` of each of ``segs`` as ``[len(segs), HV, K, V + K]``
        = ``[H | M]``."""

    def output(self, P: Prepared, st: States, lo: int, hi: int) -> torch.Tensor:
        """o ``[1, tokens of segments lo..hi-1, HV, V]``, once their state passes are done."""

    def backward_prepare(self, P: Prepared, lo: int, hi: int, h0: torch.Tensor, do: torch.Tensor) -> Backward:
        """What the state-gradient passes of segments [lo, hi) need before their final-state gradients
        are known; ``h0`` holds their initial states."""

    def backward_state(self, P: Prepared, B: Backward, segs, dht: torch.Tensor,
                       heads: slice | None = None) -> torch.Tensor:
        """Initial-state gradients ``[len(segs), HV, K, V]`` of ``segs`` (sorted, in [B.lo, B.hi)) from
        the final-state gradients ``dht`` (a row per segment of the range); the rest goes into ``B``.
        A row that leaves neither rank nor op may be left undefined. ``heads``: as in ``state``
        (``dht`` still holds every head)."""

    def backward_rest(self, P: Prepared, B: Backward) -> tuple[torch.Tensor, ...]:
        """Gradients (q, k, v, g, beta) of the prepared tensors of segments [B.lo, B.hi), once every
        one of their state-gradient passes is done."""

    def finish(self, P: Prepared, grads: tuple) -> tuple[torch.Tensor, ...]:
        """The inputs' gradients from the prepared tensors' (undoing the l2norm)."""

    def single_device(self, q, k, v, g, beta, *, scale: float, initial_state: torch.Tensor | None,
                      use_qk_l2norm_in_kernel: bool, cu_seqlens: torch.Tensor,
                      cu_seqlens_cpu: torch.Tensor) -> torch.Tensor:
        """o of whole sequences on one device, with autograd: the library's own call, fla's
        ``chunk_gated_delta_rule`` / ``chunk_kda`` surface (megatron-core's ``GatedDeltaRuleInterface``)."""


def state_rows(P: Prepared) -> tuple[int, ...]:
    """The segments whose state rows a pass reads: those whose initial state may be nonzero
    (``P.live``: received, or the user's) or whose final state a successor takes (so the backward
    hands them a final-state gradient); every segment where ``P.live`` is None. With many documents a
    rank holds many segments, few of them these."""
    return _state_rows(P.plan, P.live)


@functools.lru_cache(maxsize=256)
def _state_rows(plan: KCPPlan, live: frozenset | None) -> tuple[int, ...]:
    n = plan.num_segments
    return tuple(range(n)) if live is None else tuple(s for s in range(n) if s in live or plan.succ[s] is not None)


def may_be_nonzero(P: Prepared, lo: int, hi: int, grad: bool = False) -> bool:
    """Whether a segment of [lo, hi) can have a nonzero initial state (one of ``P.live``: received, or
    the user's) or, for ``grad``, a nonzero final-state gradient (one whose final state a successor
    takes). True where ``P.live`` is None (unknown)."""
    if P.live is None:
        return True
    rows = _successors(P.plan) if grad else _sorted_live(P.live)
    i = bisect.bisect_left(rows, lo)
    return i < len(rows) and rows[i] < hi


@functools.lru_cache(maxsize=256)
def _successors(plan: KCPPlan) -> tuple[int, ...]:
    return tuple(s for s in range(plan.num_segments) if plan.succ[s] is not None)


@functools.lru_cache(maxsize=256)
def _sorted_live(live: frozenset) -> tuple[int, ...]:
    return tuple(sorted(live))


def zeroed_states(core: LocalCore, P: Prepared, shape: tuple[int, ...], device, grad: bool = False) -> torch.Tensor:
    """Initial states (final-state gradients for ``grad``) ``shape`` = ``[segments, HV, K, V]`` fp32,
    zero wherever ``core`` reads a row before a strategy writes it (``LocalCore.state_reads``): every
    row; only the rows of :func:`state_rows`; or none where no row can be nonzero. A row is HV x K x V
    fp32 (2 MiB at 32 heads of 128 x 128), so zeroing a few rows instead of hundreds saves a fill of
    hundreds of MiB a tensor and step."""
    if core.state_reads == "nonzero" and not may_be_nonzero(P, 0, shape[0], grad):
        return torch.empty(shape, dtype=torch.float32, device=device)
    rows = state_rows(P)
    if core.state_reads != "rows" or len(rows) == shape[0]:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    out = torch.empty(shape, dtype=torch.float32, device=device)
    if rows:
        out.index_fill_(0, index_tensor(rows, out.device), 0.0)
    return out


def head_groups(value_heads: int, groups: int) -> list[slice | None]:
    """The value heads cut into ``groups`` equal slices in order; ``[None]`` (every head at once) for one."""
    if groups == 1:
        return [None]
    n = value_heads // groups
    return [slice(i * n, (i + 1) * n) for i in range(groups)]


def heads_of(x: torch.Tensor, heads: slice, value_heads: int, dim: int = 2) -> torch.Tensor:
    """The part of ``x`` that the value heads ``heads`` read or write, a view: along ``dim``, the
    value heads themselves where ``x`` has ``value_heads`` heads there, else their q/k heads
    (``value_heads / x.shape[dim]`` value heads a q/k head; ``heads`` must hold whole q/k heads).

    Args:
        x: e.g. q, k ``[1, T, H, K]`` or v ``[1, T, HV, V]`` (``dim`` 2), states ``[n, HV, K, V]`` (``dim`` 1).
        heads: a slice of the value heads, its ends multiples of ``value_heads / H``.
    Returns:
        ``x`` narrowed along ``dim`` (not contiguous in general).
    """
    n = value_heads // x.shape[dim]
    if heads.start % n or heads.stop % n:
        raise ValueError(f"value heads [{heads.start}, {heads.stop}) split a q/k head ({n} value heads each)")
    return x.narrow(dim, heads.start // n, (heads.stop - heads.start) // n)
