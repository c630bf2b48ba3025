"""The local cores by name: what each runs on and the traits the dispatch and the cost model read.

A core registers itself in its own module with one line, ``registry.register(CoreEntry(...))``, as fla
registers its backends; :mod:`megatron_kcp.kernels.cores` imports every core module, so that ``CORES`` is
complete. ``backend="auto"`` takes, for a state exchange, the first core in ``priority`` order (highest
first) that runs the problem and is worth running there (``worth``; on an all-gather with transition maps,
only a core with ``gather_maps``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_kcp.kernels.core import LocalCore
from megatron_kcp.problem import Problem
from megatron_kcp.registry import Registry


def _always(problem: Problem) -> bool:
    return True


def _no_split(problem: Problem) -> int:
    return 0


@dataclass(frozen=True)
class CoreEntry:
    """One local core.

    Args:
        name: the value of the op's ``backend`` argument that names it.
        label: how the ``KCP active`` line names it.
        runs_on: what it runs on, in words.
        runs: whether it runs the problem here (device, dtype, head dims, libraries present).
        build: the core, after its environment check: ``build(device, dtype, kda, (K, V)) -> LocalCore``.
        priority: its place in ``backend="auto"``'s order (highest first).
        env: the environment variable that forces it, where one does.
        min_group_heads: value heads a relay head group needs to fill the GPU on it (None: groups never pay).
        worth: where ``auto`` takes it on a state exchange (measured against the cores below it).
        gather_maps: whether ``auto`` takes it (and the default keeps the all-gather) where the all-gather
            needs transition maps.
        split: its kernels' split (tokens a part, 0: none), taken ahead of the exchange: the all-gather
            chains the parts.
        maps_cut: its kernels' cut under the all-gather with transition maps (tokens a part, 0: none).
        saves: seconds a step (fwd+bwd) saves against fla's kernels, per token and value head at
            K = V = 128 (only fla's and flash-qla's are measured against each other).
    """
    name: str
    label: str
    runs_on: str
    runs: Callable[[Problem], bool]
    build: Callable[[torch.device, torch.dtype, bool, tuple[int, int]], LocalCore]
    priority: int
    env: str | None = None
    min_group_heads: int | None = None
    worth: Callable[[Problem], bool] = _always
    gather_maps: bool = True
    split: Callable[[Problem], int] = _no_split
    maps_cut: Callable[[Problem], int] = _no_split
    saves: float = 0.0


CORES: Registry[CoreEntry] = Registry("a local core", reserved=("auto",))
register, unregister = CORES.register, CORES.unregister


def by_priority() -> list[CoreEntry]:
    """The cores in ``backend="auto"``'s order."""
    return sorted(CORES, key=lambda c: -c.priority)


def first_running(problem: Problem) -> CoreEntry:
    """The first core in ``auto``'s order that runs the problem (the reference runs everywhere)."""
    return next(c for c in by_priority() if c.runs(problem))
