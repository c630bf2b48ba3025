"""Cheap Triton autotuning for the GPU correctness tests (``KCP_FAST_AUTOTUNE=1``).

fla autotunes every kernel over up to ~50 configs per shape key; on a fresh machine that is
minutes of compilation per op and per head count, which a 10-minute device call cannot afford
across the shapes the tests use. Correctness does not depend on the config, so the tests keep
the two configs with the fewest pipeline stages and warps (the least shared memory: they fit on
every GPU fla supports). Timed benchmarks never set this; they autotune fully (the peak-memory
report does, since the config does not change what is allocated).
"""
from __future__ import annotations

KEEP = 2


def _cost(config):
    return config.num_stages, config.num_warps, str(config.kwargs)


def enable() -> None:
    from triton.runtime.autotuner import Autotuner
    if getattr(Autotuner, "_kcp_fast", False):
        return
    prune = Autotuner.prune_configs

    def prune_configs(self, kwargs):
        return sorted(prune(self, kwargs), key=_cost)[:KEEP]

    Autotuner.prune_configs = prune_configs
    Autotuner._kcp_fast = True
