"""A toy local core, to show that a core is one file and one registration line: the reference's passes under
another name, for GDN on the CPU, ranked above the reference (below the GPU cores) and worth running where a
rank holds at least ``MIN_SHARE`` tokens. ``BUILT`` counts the cores the op built, so a test sees it ran.

    with CORES.registered(toy_core.ENTRY):
        ...
"""
from __future__ import annotations

from megatron_kcp.kernels.core_reference import ReferenceCore
from megatron_kcp.kernels.registry import CoreEntry

MIN_SHARE = 256
BUILT = []


class ToyCore(ReferenceCore):
    """The reference core: the same numbers."""


def build(device, dtype, kda, head_dims) -> ToyCore:
    BUILT.append((device.type, kda, head_dims))
    return ToyCore()


ENTRY = CoreEntry(name="toy", label="toy (the reference's passes)", runs_on="the CPU, GDN only",
                  runs=lambda p: not p.cuda and not p.kda, build=build, priority=15,
                  worth=lambda p: p.local_share >= MIN_SHARE)
