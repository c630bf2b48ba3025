"""Relay: each boundary state travels point to point along its sequence; no transition map at all.

A sequence cut into pieces over several ranks is a chain; the rank holding a piece runs its state
pass once the state of the piece before it has arrived, and sends its own final state on. The
backward runs the chain the other way with state gradients. Every segment's state pass runs
exactly once and nothing but true K x V states crosses a rank, so the price is latency: the state
passes (forward) and state-gradient passes (backward) of one sequence run one rank after another.
The kernels of one step cover every document of a phase at once.

Phases: a rank's segments grouped by their position along their sequence (forward) or from its
end (backward). When the phases' segments form disjoint ranges of the local stream (contiguous
and zigzag layouts), each phase runs the whole step on its range (state, output; backward: prepare,
state gradient, rest) and sends as soon as its state pass is done, so the rest of its work
overlaps the transfer. When they interleave (per-document zigzag: [front, back] per document),
each phase runs only the state (gradient) pass of its own segments, one launch for the scattered
set, and the rest of the step runs once over the whole stream.

Pipelined over head groups: heads are independent, so within a phase the state (gradient) pass runs
group of value heads by group, and each group's rows leave as soon as its pass is done, while the
next group's runs; the receiver waits for each group's rows just before that group's pass. The next
rank then starts after about 1/G of a pass instead of a whole one, in both directions. G comes
from :func:`megatron_kcp.parallel.cost_model.pipeline_depth` (the same on every rank, and in the
forward and the backward); G = 1 (``heads`` None) runs every head at once. Messages between two
ranks keep one order on both sides: phase by phase, group by group.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_kcp.parallel.comm import P2P
from megatron_kcp.kernels.core import head_groups, zeroed_states
from megatron_kcp.parallel import registry
from megatron_kcp.parallel.cost_model import costs, needs_maps, pipeline_depth
from megatron_kcp.plan import KCPPlan, index_tensor, keep_starts
from megatron_kcp.parallel.strategy import StateExchange


@dataclass(frozen=True)
class Phase:
    recv: tuple[int, ...]        # segments whose incoming state (gradient) arrives in this phase
    send: tuple[int, ...]        # segments whose outgoing state (gradient) leaves in this phase
    segs: tuple[int, ...]        # segments whose state (gradient) pass runs in this phase, sorted
    span: tuple[int, int] | None  # disjoint mode: the range [lo, hi) = segs that the phase runs whole


@functools.lru_cache(maxsize=64)
def phases(plan: KCPPlan, backward: bool) -> tuple[Phase, ...]:
    """The phases in execution order: see the module docstring (disjoint mode: every phase has a span)."""
    n = plan.num_segments
    before, after = (plan.succ, plan.pred) if backward else (plan.pred, plan.succ)
    key = {}
    for i in range(n):
        if before[i] or after[i]:
            key[i] = plan.num_stages[i] - 1 - plan.stage[i] if backward else plan.stage[i]
    if not key:
        return (Phase((), (), tuple(range(n)), (0, n)),)
    groups = {}
    for i, k in key.items():
        groups.setdefault(k, []).append(i)
    stages = sorted(groups)
    spans = {k: [min(groups[k]), max(groups[k]) + 1] for k in stages}
    by_pos = sorted(stages, key=lambda k: spans[k][0])

    def phase(k, segs, span=None):
        return Phase(tuple(i for i in groups[k] if before[i]), tuple(i for i in groups[k] if after[i]),
                     tuple(sorted(segs)), span)
    if any(spans[a][1] > spans[b][0] for a, b in zip(by_pos, by_pos[1:])):
        # interleaved: each phase its own segments; segments outside every chain join the last
        alone = [i for i in range(n) if i not in key]
        return tuple(phase(k, groups[k] + (alone if k == stages[-1] else [])) for k in stages)
    # disjoint spans: segments outside every span (whole local sequences) join the span before them
    for a, b in zip(by_pos, by_pos[1:]):
        spans[a][1] = spans[b][0]
    spans[by_pos[0]][0], spans[by_pos[-1]][1] = 0, n
    return tuple(phase(k, range(*spans[k]), tuple(spans[k])) for k in stages)


def _by_peer(segs, links):
    """{peer rank: [local segments]} in the peer's segment order, which both sides agree on."""
    out = {}
    for i in sorted(segs, key=lambda i: links[i][1]):
        out.setdefault(links[i][0], []).append(i)
    return out


def _receive(p2p: P2P, segs, links, into: torch.Tensor, heads: slice | None = None):
    """Post the receives of ``segs`` (from the ranks ``links`` names); calling the result waits for
    them and fills their rows of ``into`` (on the value heads ``heads`` only, unless None)."""
    into = into if heads is None else into[:, heads]
    groups = _by_peer(segs, links)
    bufs = {peer: into.new_empty(len(s), *into.shape[1:]) for peer, s in groups.items()}
    pending = p2p.recv(bufs)

    def arrived():
        pending.wait()
        for peer, s in groups.items():
            into.index_copy_(0, index_tensor(s, into.device), bufs[peer])
    return arrived


def _send(p2p: P2P, segs, links, rows: torch.Tensor, ph: Phase) -> None:
    """Send the rows (one per segment of ``ph.segs``) of ``segs`` to the ranks ``links`` names (all
    of them, in order: the rows as they are, no copy)."""
    pos = {s: j for j, s in enumerate(ph.segs)}
    out = {}
    for peer, s in _by_peer(segs, links).items():
        j = [pos[i] for i in s]
        out[peer] = rows if j == list(range(len(rows))) else rows.index_select(0, index_tensor(j, rows.device))
    p2p.send(out)


def pipeline(core, P, plan: KCPPlan, h0: torch.Tensor) -> list[slice | None]:
    """The head groups of the relay's passes, in order (``[None]``: every head at once): the cost
    model's G from what every rank shares (plan, heads, head dim), forward and backward alike; 1 on
    a core that cannot run a pass on some heads."""
    if not getattr(core, "head_slices", False):
        return [None]
    HV, K = h0.shape[1], h0.shape[2]
    return head_groups(HV, pipeline_depth(plan, HV, P.qk_heads, K, core.min_group_heads))


class Relay(StateExchange):
    """Named, or under the default where the all-gather would need transition maps (elsewhere the all-gather
    exports true states, every rank at once) or ``KCP_STRATEGY=relay``; never on a split plan (its parts are
    chained by the all-gather's fold). Its cost: its longest chain, a direction (:func:`cost_model.costs`)."""
    name = "relay"
    order = 0                    # a tie with the all-gather: the relay

    def applicable(self, problem):
        if problem.split or problem.strategy not in ("auto", self.name):
            return False
        cu, layout, W = problem.plan.global_cu_seqlens, problem.plan.layout, problem.world_size
        return problem.strategy == self.name or problem.options.strategy == self.name or needs_maps(cu, layout, W)

    def cost(self, problem):
        return costs(problem.plan.global_cu_seqlens, problem.plan.layout, problem.world_size, problem.value_heads)[0]

    def refusal(self, problem):
        return ("segments split by max_segment are chained through the all-gather's fold: use strategy='gather' "
                "(or 'auto'), or max_segment=0 for the relay")

    def check(self, q, v, plan, initial_state):
        """A bad ``KCP_RELAY_GROUPS`` fails here, before any kernel."""
        pipeline_depth(plan, v.shape[2], q.shape[2], q.shape[3])

    def forward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor):
        """(output of the local stream, nothing for the backward); fills ``h0`` (every segment's
        initial state) as states arrive."""
        p2p, st, outs = P2P(group), core.states(P, h0), []
        heads = pipeline(core, P, plan, h0)
        for ph in phases(plan, backward=False):
            arrivals = [_receive(p2p, ph.recv, plan.pred, h0, hs) for hs in heads]
            for hs, arrived in zip(heads, arrivals):
                arrived()
                _send(p2p, ph.send, plan.succ, core.state(P, st, ph.segs, h0, heads=hs), ph)
            if ph.span:
                outs.append((ph.span[0], core.output(P, st, *ph.span)))
        p2p.finish()
        return _assemble(outs) if outs else core.output(P, st, 0, plan.num_segments), None

    def backward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor, do: torch.Tensor, _=None):
        """(input gradients of the local stream, dh0 where a sequence starts). Each phase prepares what does
        not need the incoming state gradient while that is on its way (disjoint mode), or the whole
        stream is prepared first (interleaved)."""
        steps, heads = phases(plan, backward=True), pipeline(core, P, plan, h0)
        p2p, outs, n = P2P(group), [], plan.num_segments
        # dh0: rows set by keep_starts, the only ones read
        dht, dh0 = zeroed_states(core, P, h0.shape, h0.device, grad=True), torch.empty_like(h0)
        B = None if steps[0].span else core.backward_prepare(P, 0, n, h0, do)
        for ph in steps:
            arrivals = [_receive(p2p, ph.recv, plan.succ, dht, hs) for hs in heads]
            if ph.span:
                B = core.backward_prepare(P, *ph.span, h0[slice(*ph.span)], do)
            for hs, arrived in zip(heads, arrivals):
                arrived()
                d = core.backward_state(P, B, ph.segs, dht[B.lo:B.hi], heads=hs)
                _send(p2p, ph.send, plan.pred, d, ph)
                keep_starts(plan, dh0 if hs is None else dh0[:, hs], d, ph.segs, P.live)
            if ph.span:
                outs.append((ph.span[0], core.backward_rest(P, B)))
        if not outs:
            outs.append((0, core.backward_rest(P, B)))
        p2p.finish()
        return tuple(_assemble([(lo, g[j]) for lo, g in outs]) for j in range(len(outs[0][1]))), dh0


def _assemble(parts):
    """Concatenate per-phase results along tokens in local order (one part: as it is)."""
    if len(parts) == 1:
        return parts[0][1]
    return torch.cat([x for _, x in sorted(parts, key=lambda p: p[0])], 1)


registry.register(Relay())
