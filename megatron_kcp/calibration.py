"""The fitted constants of the cost model and the dispatch, in one record, each with where it was measured.

The record is read by ``megatron_kcp.parallel.cost_model`` (which exchange, whether to move the layout),
``megatron_kcp.ops.dispatch`` (which core, which split), the kernels (``min_group_heads``) and the benchmarks'
predictions (the link), so that one number has one home. ``CALIBRATION`` is the record of the machine the
constants were fitted on (one H200, NVLink between the ranks of one host).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def measured(value, where: str):
    """A record field's default and where it was measured (``dataclasses.fields(...)[i].metadata``)."""
    return field(default=value, metadata={"measured": where})


@dataclass(frozen=True)
class Link:
    """The link between two CP ranks: ``latency`` s per message, ``bandwidth`` bytes / s."""
    latency: float = measured(60e-6, "2 x H200 over NVLink: the measured collectives, fitted by benchmarks/"
                                     "exchange_model.py --fit (benchmarks/reports/2026-12-02-runs-a-to-bx.md)")
    bandwidth: float = measured(332e9, "2 x H200 over NVLink, the same fit")

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        """Seconds to move ``nbytes`` in ``messages`` messages."""
        return messages * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Calibration:
    """Every fitted constant of the cost model and the dispatch."""
    link: Link = field(default_factory=Link)
    min_group_heads: int = measured(64, "value heads a relay head group needs to fill the GPU (fla); two groups of "
                                        "16 heads, and two of 32, lost to one group on one long sequence "
                                        "(benchmarks/reports/, the relay's head groups on fla's core)")


CALIBRATION = Calibration()
