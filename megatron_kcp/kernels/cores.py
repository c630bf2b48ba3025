"""Every local core, registered (each in its own module): import this to read a complete ``registry.CORES``."""
from __future__ import annotations

from megatron_kcp.kernels import core_fla, core_qla, core_reference  # noqa: F401  (each registers its core)
from megatron_kcp.kernels.registry import CORES, CoreEntry, by_priority, first_running, register

__all__ = ["CORES", "CoreEntry", "by_priority", "first_running", "register"]
