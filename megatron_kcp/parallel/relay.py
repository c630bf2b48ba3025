"""Relay: each boundary state travels point to point along its sequence; no transition map at all.

A sequence cut into pieces over several ranks is a chain; the rank holding a piece runs its state
pass once the state of the piece before it has arrived, and sends its own final state on. The
backward runs the chain the other way with state gradients. Every segment computes exactly once
and nothing but true K x V states crosses a rank, so the price is latency: the state passes
(forward) and state-gradient passes (backward) of one sequence run one rank after another. The
kernels of one step (state, output, backward) cover every document of a phase at once.

Phases: a rank's segments grouped by their position along their sequence (forward) or from its
end (backward). When the phases' segments form disjoint ranges of the local stream (contiguous
and zigzag layouts), each phase runs the whole pass on its range and sends as soon as its state
pass is done. When they interleave (per-document zigzag: [front, back] per document), the early
phases run only the state pass over the range they span (the segments of later phases in it get
a wrong, discarded state) and the last phase runs the whole pass over everything.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_kcp.parallel.comm import P2P
from megatron_kcp.parallel.plan import KCPPlan


@dataclass(frozen=True)
class Phase:
    recv: tuple[int, ...]        # segments whose incoming state (gradient) arrives in this phase
    send: tuple[int, ...]        # segments whose outgoing state (gradient) leaves in this phase
    lo: int                      # segments [lo, hi) computed in this phase
    hi: int


@functools.lru_cache(maxsize=64)
def phases(plan: KCPPlan, backward: bool) -> tuple[tuple[Phase, ...], bool]:
    """(phases in execution order, covering): see the module docstring."""
    n = plan.num_segments
    before, after = (plan.succ, plan.pred) if backward else (plan.pred, plan.succ)
    key = {}
    for i in range(n):
        if before[i] or after[i]:
            key[i] = plan.num_stages[i] - 1 - plan.stage[i] if backward else plan.stage[i]
    if not key:
        return (Phase((), (), 0, n),), False
    groups = {}
    for i, k in key.items():
        groups.setdefault(k, []).append(i)
    stages = sorted(groups)
    spans = {k: [min(groups[k]), max(groups[k]) + 1] for k in stages}
    by_pos = sorted(stages, key=lambda k: spans[k][0])
    covering = any(spans[a][1] > spans[b][0] for a, b in zip(by_pos, by_pos[1:]))
    if covering:
        # early phases: the span of what they send; the last phase: everything
        out = []
        for k in stages[:-1]:
            send = tuple(i for i in groups[k] if after[i])
            lo, hi = (min(send), max(send) + 1) if send else (0, 0)
            out.append(Phase(tuple(i for i in groups[k] if before[i]), send, lo, hi))
        last = groups[stages[-1]]
        out.append(Phase(tuple(i for i in last if before[i]), tuple(i for i in last if after[i]), 0, n))
        return tuple(out), True
    # disjoint spans: segments outside every span (whole local sequences) join the span before them
    for a, b in zip(by_pos, by_pos[1:]):
        spans[a][1] = spans[b][0]
    spans[by_pos[0]][0], spans[by_pos[-1]][1] = 0, n
    return tuple(Phase(tuple(i for i in groups[k] if before[i]), tuple(i for i in groups[k] if after[i]),
                       *spans[k]) for k in stages), False


def _by_peer(segs, links):
    """{peer rank: [local segments]} in the peer's segment order, which both sides agree on."""
    out = {}
    for i in sorted(segs, key=lambda i: links[i][1]):
        out.setdefault(links[i][0], []).append(i)
    return out


def _receive(p2p: P2P, segs, links, into: torch.Tensor):
    """Post the receives of ``segs`` (from the ranks ``links`` names); calling the result waits for
    them and fills their rows of ``into``."""
    groups = _by_peer(segs, links)
    bufs = {peer: into.new_empty(len(s), *into.shape[1:]) for peer, s in groups.items()}
    pending = p2p.recv(bufs)

    def arrived():
        pending.wait()
        for peer, s in groups.items():
            into[list(s)] = bufs[peer]
    return arrived


def _send(p2p: P2P, segs, links, rows: torch.Tensor, lo: int) -> None:
    p2p.send({peer: rows[[i - lo for i in s]] for peer, s in _by_peer(segs, links).items()})


class Relay:
    name = "relay"

    def forward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor):
        """(output of the local stream, nothing for the backward); fills ``h0`` (every segment's
        initial state) as states arrive."""
        steps, covering = phases(plan, backward=False)
        p2p, outs = P2P(group), []
        for k, ph in enumerate(steps):
            _receive(p2p, ph.recv, plan.pred, h0)()
            if covering and k < len(steps) - 1:
                if ph.send:
                    _, ht = core.state(P, ph.lo, ph.hi, h0[ph.lo:ph.hi])
                    _send(p2p, ph.send, plan.succ, ht, ph.lo)
                continue
            st, ht = core.state(P, ph.lo, ph.hi, h0[ph.lo:ph.hi])
            _send(p2p, ph.send, plan.succ, ht, ph.lo)
            outs.append((ph.lo, core.output(P, ph.lo, ph.hi, st)))
        p2p.finish()
        return _assemble(outs), None

    def backward(self, core, P, plan: KCPPlan, group, h0: torch.Tensor, do: torch.Tensor, _=None):
        """(input gradients of the local stream, dh0 of every segment). Each phase prepares what does
        not need the incoming state gradient while that is on its way."""
        steps, covering = phases(plan, backward=True)
        p2p, outs = P2P(group), []
        dht, dh0 = torch.zeros_like(h0), torch.zeros_like(h0)
        for k, ph in enumerate(steps):
            arriving = _receive(p2p, ph.recv, plan.succ, dht)
            lo, hi = ph.lo, ph.hi
            if covering and k < len(steps) - 1:
                if ph.send:
                    bpre = core.backward_prepare(P, lo, hi, h0[lo:hi], do)
                    arriving()
                    _, d = core.backward_state(P, bpre, dht[lo:hi])
                    _send(p2p, ph.send, plan.pred, d, lo)
                else:
                    arriving()
                continue
            bpre = core.backward_prepare(P, lo, hi, h0[lo:hi], do)
            arriving()
            bst, d = core.backward_state(P, bpre, dht[lo:hi])
            _send(p2p, ph.send, plan.pred, d, lo)
            dh0[lo:hi] = d
            outs.append((lo, core.backward_rest(P, lo, hi, bst)))
        p2p.finish()
        return tuple(_assemble([(lo, g[j]) for lo, g in outs]) for j in range(len(outs[0][1]))), dh0


def _assemble(parts):
    """Concatenate per-phase results along tokens in local order (one part: as it is)."""
    if len(parts) == 1:
        return parts[0][1]
    return torch.cat([x for _, x in sorted(parts, key=lambda p: p[0])], 1)
