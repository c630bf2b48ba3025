"""The method registry: every row a table can hold, peers and our picks, and what each one sets.

A method is the default (``kcp``) or a peer, with its ablation declared, never a patch of a library's
internals where the library takes an option: ``options`` go to ``megatron_kcp.ops.kcp.gated_delta_rule``
(``strategy=``, ``backend=``, ``max_segment=``), ``env`` to the process (the documented ``KCP_*`` and
``FLA_*`` overrides, read at each call), ``exchange`` swaps an entry of the exchange registry
(``EXCHANGES.swapped``: the op looks its strategy up at each call) for a benchmark's subclass (the all-gather
with every sequence start on a pass of its own, or folding with PyTorch's loop).

    METHODS.register(Method("kcp-whole", "ours", "the default with no segment split", options={"max_segment": 0}))
    with METHODS["kcp-whole"].applied() as options:
        kcp.gated_delta_rule(..., **options)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

from megatron_kcp.parallel.gather import AllGather, fold_reference


class OwnStartsGather(AllGather):
    """The all-gather with every sequence start on a state pass of its own, not through the maps pass
    that a fused core's rank runs anyway (the peer of ``AllGather._through_maps``)."""

    def _through_maps(self, core, P, done, middle):
        return []


class FoldLoopGather(AllGather):
    """The all-gather folding chains of several sources with PyTorch's loop (``fold_reference``) on the GPU
    too, not fla's merge kernel."""
    merge = staticmethod(fold_reference)


@dataclass(frozen=True)
class Method:
    name: str
    kind: str                                   # one-gpu | peer | ours
    about: str
    levels: tuple[str, ...] = ("ops", "mixer", "block")
    by_name: bool = False                       # run only where asked for by name
    options: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)     # None: unset
    exchange: dict[str, Callable] = field(default_factory=dict)   # strategy name: the class swapped in

    @contextlib.contextmanager
    def applied(self):
        """The method's environment and exchange in place; yields its op options."""
        from benchmarks.common import env
        from megatron_kcp.parallel.exchanges import EXCHANGES
        swaps = [cls() for cls in self.exchange.values()]
        with env(**self.env), EXCHANGES.swapped(*swaps):
            yield dict(self.options)


class Registry(dict):
    def register(self, method: Method) -> Method:
        if method.name in self:
            raise ValueError(f"method {method.name!r} is registered twice")
        self[method.name] = method
        return method

    def names(self, by_name: bool | None = False, level: str | None = None) -> tuple[str, ...]:
        """The methods (``by_name``: False the default rows, True the by-name ones, None every one)."""
        return tuple(m.name for m in self.values() if (by_name is None or m.by_name == by_name)
                     and (level is None or level in m.levels))


METHODS = Registry()
for _m in (
    Method("noCP", "one-gpu", "the whole pack on one GPU, fla's call"),
    Method("noCP-qla", "one-gpu", "the whole pack on one GPU, flash-qla's call (GDN)", env={"FLA_FLASH_QLA": "1"}),
    Method("cp2hp", "peer", "megatron-core's all-to-all to head shards around fla's call"),
    Method("cp2hp-qla", "peer", "megatron-core's all-to-all around flash-qla's call (fla hands GDN to it)",
           env={"FLA_FLASH_QLA": "1"}),
    Method("mlm-chunkwise", "peer", "Megatron-LM dev: an all-to-all to the contiguous layout, fla's CP call, back",
           env={"KCP_CONVERT": "1"}),
    Method("fla-cp", "peer", "fla's CP call on the same tokens fed contiguous", levels=("ops",)),
    Method("kcp-noconvert", "ours", "ours on the per-document layout, never converted", env={"KCP_CONVERT": "0"}),
    Method("kcp-unpipelined", "ours", "the default with the relay on one head group", levels=("ops",),
           env={"KCP_RELAY_GROUPS": "1"}),
    Method("kcp", "ours", "the default (note: its strategy and layout)"),
    Method("kcp-foldloop", "ours", "the default with the all-gather's fold as PyTorch's loop", levels=("ops",),
           by_name=True, exchange={"gather": FoldLoopGather}),
    Method("kcp-ownstart", "ours", "the default with every sequence start on a state pass of its own",
           levels=("ops",), by_name=True, exchange={"gather": OwnStartsGather}),
    Method("kcp-whole", "ours", "the default with no segment split by the kernels' pick", levels=("ops",),
           by_name=True, options={"max_segment": 0}),
    Method("kcp-graph", "ours", "the default's step captured in a CUDA graph and replayed", levels=("ops",),
           by_name=True),
    Method("kcp-ownstart-graph", "ours", "kcp-ownstart captured in a CUDA graph", levels=("ops",), by_name=True,
           exchange={"gather": OwnStartsGather}),
    Method("kcp-convert", "ours", "ours converting the op's inputs whatever the cost model says", levels=("ops",),
           by_name=True, env={"KCP_CONVERT": "1"}),
    Method("kcp-gather", "ours", "the default with the all-gather step", by_name=True,
           env={"KCP_STRATEGY": "gather"}),
    Method("kcp-contiguous", "ours", "the default fed the same documents in the contiguous layout", by_name=True,
           env={"KCP_CONVERT": "1"}),
):
    METHODS.register(_m)
