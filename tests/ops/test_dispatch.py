"""``dispatch.decide``'s picks on a catalogue of problems: GDN and KDA, W = 1 to 8, every layout, one sequence to
300 packed documents, 32k and 128k tokens, 16 to 64 heads, the CPU and a Hopper GPU with and without flash-qla,
and the documented overrides (named backend, strategy and split, an initial state, the environment options). The
expected picks are data (recorded from the code); nothing runs but the decision. A new core or strategy that
changes a pick here is a change of behaviour: record the new pick with the measurement that justifies it."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from megatron_kcp import environment
from megatron_kcp.ops import dispatch
from megatron_kcp.plan import all_plans

ENV = ("KCP_STRATEGY", "KCP_CONVERT", "KCP_RELAY_GROUPS")


@dataclass
class Probe:
    """What decide reads of a tensor: its device, dtype and shape (a CUDA device needs no GPU here)."""
    shape: tuple[int, ...]
    device: torch.device
    dtype: torch.dtype = torch.bfloat16

    def dim(self) -> int:
        return len(self.shape)


def documents(n: int, T: int, pad: int) -> tuple[int, ...]:
    """cu_seqlens of ``n`` documents of seeded random lengths summing to ``T`` (each a multiple of ``pad``)."""
    if n == 1:
        return (0, T)
    rng = random.Random(n * 7919 + T)
    cuts = sorted(rng.sample(range(1, T // pad), n - 1))
    return (0, *(c * pad for c in cuts), T)


def decided(monkeypatch, kind, W, layout, docs, T, heads, device, head_dim=128, qk_heads=None, backend="auto",
            strategy="auto", max_segment=None, initial_state=False, env=()):
    """decide's pick for one problem, as (core, strategy, max_segment, layout), or ``error: <message>``."""
    qla_present = device == "hopper+qla"
    monkeypatch.setattr(environment, "qla_runs", lambda *a: qla_present)
    monkeypatch.setattr(dispatch, "qla_runs", lambda *a: qla_present, raising=False)
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env:
        monkeypatch.setenv(name, value)
    dev = torch.device("cpu" if device == "cpu" else "cuda")
    H = heads if qk_heads is None else qk_heads
    plan = all_plans(documents(docs, T, 2 * W), layout, W)[0]
    q = Probe((1, T // W, H, head_dim), dev)
    v = Probe((1, T // W, heads, head_dim), dev)
    g = Probe((1, T // W, heads, head_dim) if kind == "kda" else (1, T // W, heads), dev)
    h0 = torch.zeros(1) if initial_state else None
    for cache in (getattr(dispatch, "_decide", None), getattr(dispatch, "decide_problem", None),
                  getattr(dispatch, "_qla_max_segment", None)):
        if cache is not None and hasattr(cache, "cache_clear"):
            cache.cache_clear()
    try:
        d = dispatch.decide(plan, q, v, g, backend, strategy, max_segment, h0)
    except ValueError as e:
        return f"error: {e}"
    return (d.core, d.strategy, d.max_segment, d.layout)


# (kind, W, layout, documents, tokens, value heads, device, the pick with every argument "auto")
AUTO = [
    ('gdn', 1, 'contiguous', 1, 32768, 32, 'hopper+qla',
     ('fla', 'none', 0, '')),
    ('gdn', 1, 'contiguous', 300, 32768, 64, 'cpu',
     ('reference', 'gather', 0, '')),
    ('gdn', 1, 'zigzag', 1, 131072, 32, 'cpu',
     ('reference', 'gather', 0, '')),
    ('gdn', 1, 'zigzag', 100, 131072, 64, 'hopper',
     ('fla', 'none', 0, '')),
    ('gdn', 1, 'zigzag', 300, 131072, 16, 'cpu',
     ('reference', 'gather', 0, '')),
    ('gdn', 1, 'zigzag_per_doc', 1, 131072, 64, 'hopper',
     ('fla', 'none', 0, '')),
    ('gdn', 1, 'zigzag_per_doc', 100, 32768, 64, 'hopper',
     ('fla', 'none', 0, '')),
    ('gdn', 2, 'contiguous', 1, 131072, 16, 'cpu',
     ('reference', 'gather', 0, '')),
    ('gdn', 2, 'contiguous', 1, 131072, 16, 'hopper+qla',
     ('qla', 'gather', 8192, '')),
    ('gdn', 2, 'contiguous', 1, 32768, 16, 'hopper+qla',
     ('qla', 'gather', 2048, '')),
    ('gdn', 2, 'zigzag', 1, 131072, 16, 'cpu',
     ('reference', 'relay', 0, '')),
    ('gdn', 2, 'zigzag', 10, 131072, 16, 'hopper',
     ('fla', 'gather', 0, '')),
    ('gdn', 2, 'zigzag', 100, 131072, 16, 'cpu',
     ('reference', 'gather', 0, '')),
    ('gdn', 2, 'zigzag', 300, 131072, 16, 'hopper',
     ('fla', 'gather', 0, '')),
    ('gdn', 2, 'zigzag_per_doc', 100, 131072, 32, 'hopper',
     ('fla', 'relay', 0, '')),
    ('gdn', 2, 'zigzag_per_doc', 100, 32768, 32, 'hopper+qla',
     ('qla', 'cp2hp', 0, '')),
    ('gdn', 4, 'contiguous', 300, 131072, 64, 'hopper',
     ('fla', 'gather', 0, '')),
    ('gdn', 4, 'contiguous', 300, 32768, 64, 'hopper+qla',
     ('qla', 'gather', 0, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 64, 'hopper',
     ('fla', 'relay', 0, '')),
    ('gdn', 4, 'zigzag', 10, 131072, 16, 'cpu',
     ('reference', 'relay', 0, '')),
    ('gdn', 4, 'zigzag_per_doc', 300, 32768, 16, 'hopper',
     ('fla', 'cp2hp', 0, '')),
    ('gdn', 8, 'contiguous', 10, 131072, 32, 'hopper+qla',
     ('qla', 'gather', 4096, '')),
    ('gdn', 8, 'contiguous', 300, 131072, 32, 'hopper+qla',
     ('qla', 'gather', 0, '')),
    ('gdn', 8, 'contiguous', 300, 131072, 64, 'hopper+qla',
     ('qla', 'gather', 0, '')),
    ('gdn', 8, 'zigzag', 1, 131072, 16, 'hopper+qla',
     ('qla', 'gather', 4096, '')),
    ('gdn', 8, 'zigzag', 10, 131072, 64, 'cpu',
     ('reference', 'relay', 0, '')),
    ('gdn', 8, 'zigzag', 300, 32768, 64, 'hopper',
     ('fla', 'gather', 0, '')),
    ('gdn', 8, 'zigzag_per_doc', 100, 131072, 16, 'hopper',
     ('fla', 'cp2hp', 0, '')),
    ('gdn', 8, 'zigzag_per_doc', 300, 131072, 64, 'hopper+qla',
     ('qla', 'cp2hp', 0, '')),
    ('kda', 1, 'contiguous', 10, 131072, 32, 'hopper',
     ('fla', 'none', 0, '')),
    ('kda', 1, 'contiguous', 300, 131072, 64, 'cpu',
     ('reference', 'gather', 0, '')),
    ('kda', 1, 'zigzag', 100, 131072, 32, 'hopper+qla',
     ('fla', 'none', 0, '')),
    ('kda', 1, 'zigzag', 300, 131072, 64, 'cpu',
     ('reference', 'gather', 0, '')),
    ('kda', 1, 'zigzag', 300, 32768, 32, 'hopper',
     ('fla', 'none', 0, '')),
    ('kda', 1, 'zigzag_per_doc', 1, 32768, 32, 'hopper+qla',
     ('fla', 'none', 0, '')),
    ('kda', 2, 'zigzag', 300, 131072, 32, 'hopper',
     ('fla', 'gather', 0, '')),
    ('kda', 2, 'zigzag_per_doc', 10, 131072, 32, 'hopper',
     ('fla', 'relay', 0, '')),
    ('kda', 2, 'zigzag_per_doc', 100, 32768, 64, 'cpu',
     ('reference', 'cp2hp', 0, '')),
    ('kda', 4, 'contiguous', 100, 32768, 32, 'hopper',
     ('fla', 'fla-cp', 0, '')),
    ('kda', 4, 'zigzag', 100, 131072, 32, 'hopper+qla',
     ('qla', 'gather', 0, '')),
    ('kda', 4, 'zigzag', 100, 131072, 64, 'hopper',
     ('fla', 'gather', 0, '')),
    ('kda', 4, 'zigzag', 100, 32768, 32, 'hopper',
     ('fla', 'gather', 0, '')),
    ('kda', 4, 'zigzag_per_doc', 1, 131072, 16, 'cpu',
     ('reference', 'relay', 0, '')),
    ('kda', 4, 'zigzag_per_doc', 10, 131072, 16, 'hopper',
     ('fla', 'relay', 0, '')),
    ('kda', 4, 'zigzag_per_doc', 10, 131072, 32, 'hopper',
     ('fla', 'relay', 0, '')),
    ('kda', 4, 'zigzag_per_doc', 100, 131072, 16, 'hopper+qla',
     ('qla', 'cp2hp', 0, '')),
    ('kda', 4, 'zigzag_per_doc', 100, 32768, 64, 'cpu',
     ('reference', 'cp2hp', 0, '')),
    ('kda', 8, 'contiguous', 1, 32768, 32, 'cpu',
     ('reference', 'gather', 0, '')),
    ('kda', 8, 'contiguous', 10, 32768, 32, 'hopper',
     ('fla', 'relay', 0, '')),
    ('kda', 8, 'zigzag', 1, 131072, 32, 'cpu',
     ('reference', 'gather', 0, '')),
    ('kda', 8, 'zigzag_per_doc', 10, 32768, 16, 'cpu',
     ('reference', 'cp2hp', 0, '')),
    ('kda', 8, 'zigzag_per_doc', 100, 32768, 32, 'cpu',
     ('reference', 'cp2hp', 0, '')),
]

# (kind, W, layout, documents, tokens, value heads, device, overrides, the pick)
OVERRIDES = [
    ('gdn', 2, 'zigzag_per_doc', 100, 32768, 32, 'hopper+qla', {'initial_state': True},
     ('qla', 'gather', 0, 'contiguous')),
    ('gdn', 2, 'zigzag_per_doc', 100, 32768, 32, 'hopper+qla', {'env': (('KCP_CONVERT', '0'),)},
     ('fla', 'relay', 0, '')),
    ('gdn', 2, 'zigzag_per_doc', 100, 32768, 32, 'hopper+qla', {'env': (('KCP_CONVERT', '1'),)},
     ('qla', 'gather', 0, 'contiguous')),
    ('gdn', 2, 'zigzag_per_doc', 10, 32768, 32, 'hopper', {'env': (('KCP_CONVERT', '1'),)},
     ('fla', 'gather', 0, 'contiguous')),
    ('gdn', 2, 'zigzag_per_doc', 100, 32768, 32, 'hopper', {'env': (('KCP_CONVERT', '2'),)},
     "error: KCP_CONVERT='2': use 1 (convert), 0 (keep the layout), or unset it"),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper', {'env': (('KCP_STRATEGY', 'relay'),)},
     ('fla', 'relay', 0, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper', {'env': (('KCP_STRATEGY', 'gather'),)},
     ('fla', 'gather', 16384, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper', {'env': (('KCP_STRATEGY', 'ring'),)},
     "error: KCP_STRATEGY='ring': use relay or gather (or unset it for the cost model)"),
    ('kda', 4, 'contiguous', 100, 32768, 32, 'hopper', {'env': (('KCP_STRATEGY', 'gather'),)},
     ('fla', 'gather', 0, '')),
    ('gdn', 4, 'zigzag_per_doc', 100, 32768, 32, 'hopper', {'strategy': 'convert'},
     ('fla', 'gather', 0, 'contiguous')),
    ('gdn', 4, 'zigzag_per_doc', 100, 32768, 32, 'hopper+qla', {'strategy': 'convert'},
     ('qla', 'gather', 0, 'contiguous')),
    ('kda', 4, 'zigzag_per_doc', 100, 32768, 6, 'hopper', {'strategy': 'convert'},
     ('fla', 'gather', 0, 'contiguous')),
    ('kda', 4, 'zigzag_per_doc', 100, 32768, 6, 'hopper', {},
     ('fla', 'fla-cp', 0, 'contiguous')),
    ('gdn', 2, 'contiguous', 10, 32768, 32, 'hopper', {'strategy': 'convert'},
     ('fla', 'gather', 0, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper', {'strategy': 'relay'},
     ('fla', 'relay', 0, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper', {'strategy': 'gather'},
     ('fla', 'gather', 16384, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper+qla', {'strategy': 'gather'},
     ('qla', 'gather', 8192, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper+qla', {'strategy': 'relay'},
     ('qla', 'relay', 0, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper+qla', {'backend': 'qla'},
     ('qla', 'gather', 8192, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'hopper+qla', {'backend': 'fla'},
     ('fla', 'relay', 0, '')),
    ('gdn', 4, 'zigzag', 1, 131072, 32, 'cpu', {'backend': 'reference'},
     ('reference', 'relay', 0, '')),
    ('gdn', 2, 'zigzag', 1, 32768, 16, 'hopper+qla', {'max_segment': 0},
     ('fla', 'relay', 0, '')),
    ('gdn', 2, 'zigzag', 1, 32768, 16, 'hopper+qla', {'max_segment': 2048},
     ('qla', 'gather', 2048, '')),
    ('gdn', 2, 'zigzag', 1, 32768, 16, 'cpu', {'max_segment': 2048},
     ('reference', 'gather', 2048, '')),
    ('gdn', 2, 'zigzag', 1, 32768, 16, 'hopper', {'max_segment': 2048, 'strategy': 'relay'},
     "error: segments split by max_segment are chained through the all-gather's fold: use "
     "strategy='gather' (or 'auto'), or max_segment=0 for the relay"),
    ('gdn', 2, 'zigzag', 1, 32768, 16, 'hopper', {'max_segment': -1},
     "error: max_segment must be >= 0 (0: segments not split; None: the kernels' pick), got -1"),
    ('gdn', 2, 'zigzag', 1, 32768, 16, 'hopper', {'backend': 'flash'},
     "error: unknown KCP backend 'flash': choose one of ('auto', 'reference', 'fla', 'qla')"),
    ('gdn', 2, 'zigzag', 1, 32768, 16, 'hopper', {'strategy': 'ring'},
     "error: unknown KCP exchange strategy 'ring': choose one of ('auto', 'relay', 'gather', 'cp2hp', "
     "'convert', 'fla-cp')"),
    ('gdn', 4, 'zigzag_per_doc', 100, 32768, 32, 'hopper', {'strategy': 'cp2hp'},
     ('fla', 'cp2hp', 0, '')),
    ('gdn', 4, 'zigzag_per_doc', 100, 32768, 32, 'cpu', {'strategy': 'cp2hp'},
     ('reference', 'cp2hp', 0, '')),
    ('gdn', 4, 'zigzag_per_doc', 100, 32768, 32, 'hopper', {'strategy': 'cp2hp', 'backend': 'reference'},
     ('reference', 'cp2hp', 0, '')),
    ('gdn', 4, 'zigzag_per_doc', 100, 32768, 32, 'hopper', {'strategy': 'cp2hp', 'max_segment': 4096},
     "error: max_segment splits KCP's segments and strategy 'cp2hp' has none: drop it, or use a KCP strategy"),
    ('gdn', 1, 'contiguous', 10, 32768, 32, 'hopper', {'strategy': 'cp2hp'},
     ('fla', 'none', 0, '')),
    ('kda', 2, 'contiguous', 100, 32768, 32, 'hopper', {'strategy': 'fla-cp'},
     ('fla', 'fla-cp', 0, '')),
    ('kda', 2, 'contiguous', 100, 32768, 32, 'cpu', {'strategy': 'fla-cp'},
     "error: strategy 'fla-cp' is fla's own CP call: it runs fla's kernels on CUDA, its segments whole: "
     "use backend 'auto' or 'fla' and no max_segment, or a KCP strategy (relay, gather)"),
    ('kda', 2, 'contiguous', 100, 32768, 32, 'hopper', {'strategy': 'fla-cp', 'backend': 'qla'},
     "error: strategy 'fla-cp' is fla's own CP call: it runs fla's kernels on CUDA, its segments whole: "
     "use backend 'auto' or 'fla' and no max_segment, or a KCP strategy (relay, gather)"),
    ('kda', 2, 'contiguous', 100, 32768, 32, 'hopper', {'strategy': 'fla-cp', 'max_segment': 4096},
     "error: strategy 'fla-cp' is fla's own CP call: it runs fla's kernels on CUDA, its segments whole: "
     "use backend 'auto' or 'fla' and no max_segment, or a KCP strategy (relay, gather)"),
    ('kda', 1, 'contiguous', 100, 32768, 32, 'hopper', {'strategy': 'fla-cp'},
     ('fla', 'none', 0, '')),
    ('kda', 2, 'contiguous', 100, 32768, 32, 'hopper', {'backend': 'fla'},
     ('fla', 'gather', 0, '')),
    ('kda', 2, 'contiguous', 100, 32768, 32, 'hopper', {'max_segment': 0},
     ('fla', 'gather', 0, '')),
    ('kda', 2, 'contiguous', 100, 32768, 32, 'hopper', {'initial_state': True},
     ('fla', 'gather', 0, '')),
    ('gdn', 4, 'zigzag_per_doc', 300, 131072, 32, 'hopper+qla', {'qk_heads': 16},
     ('qla', 'cp2hp', 0, '')),
    ('gdn', 4, 'zigzag_per_doc', 300, 131072, 6, 'hopper+qla', {'qk_heads': 3},
     ('qla', 'gather', 0, 'contiguous')),
    ('gdn', 4, 'zigzag_per_doc', 300, 131072, 32, 'hopper+qla', {'head_dim': 64},
     ('qla', 'cp2hp', 0, '')),
    ('gdn', 1, 'contiguous', 10, 32768, 32, 'hopper', {'backend': 'fla'},
     ('fla', 'gather', 0, '')),
    ('gdn', 1, 'contiguous', 10, 32768, 32, 'hopper', {'max_segment': 0},
     ('fla', 'gather', 0, '')),
    ('gdn', 1, 'contiguous', 1, 131072, 16, 'hopper+qla', {'backend': 'qla'},
     ('qla', 'gather', 16384, '')),
    ('gdn', 1, 'contiguous', 10, 32768, 32, 'cpu', {},
     ('reference', 'gather', 0, '')),
]


@pytest.mark.parametrize("case", AUTO, ids=lambda c: "-".join(map(str, c[:7])))
def test_auto_picks(monkeypatch, case):
    *problem, pick = case
    assert decided(monkeypatch, *problem) == pick


@pytest.mark.parametrize("case", OVERRIDES, ids=lambda c: "-".join(map(str, c[:7])) + "-" + "-".join(
    f"{k}={v}" for k, v in c[7].items()))
def test_override_picks(monkeypatch, case):
    *problem, overrides, pick = case
    assert decided(monkeypatch, *problem, **overrides) == pick


def test_every_rank_decides_alike(monkeypatch):
    """decide reads only what the ranks share: each rank's plan of a problem gets the same pick."""
    for kind, W, layout, docs, T, heads, device, _ in AUTO:
        if W == 1:
            continue
        picks = set()
        for rank in range(W):
            dispatch.decide_problem.cache_clear()
            plan = all_plans(documents(docs, T, 2 * W), layout, W)[rank]
            monkeypatch.setattr(environment, "qla_runs", lambda *a: device == "hopper+qla")
            monkeypatch.setattr(dispatch, "qla_runs", lambda *a: device == "hopper+qla", raising=False)
            dev = torch.device("cpu" if device == "cpu" else "cuda")
            g = (1, T // W, heads, 128) if kind == "kda" else (1, T // W, heads)
            d = dispatch.decide(plan, Probe((1, T // W, heads, 128), dev), Probe((1, T // W, heads, 128), dev),
                                Probe(g, dev))
            picks.add(d)
        assert len(picks) == 1, (kind, W, layout, docs, T, heads, device, picks)
