"""The fitted constants of the cost model and the dispatch, in one record, each with where it was measured.

The record is read by ``megatron_kcp.parallel.cost_model`` (which exchange, whether to move the layout), the
cores' and strategies' rules of the dispatch (which core, which split, where fla's CP call runs), the kernels
(``min_group_heads``) and the benchmarks' predictions (the link), so that one number has one home; each field's
``measured`` metadata says where it was measured. ``CALIBRATION`` is the record of the machine the
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
    latency: float = measured(60e-6, "2 x H200 over NVLink: fitted to the measured collectives "
                                     "(benchmarks/reports/2026-12-02-runs-a-to-bx.md)")
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

    # the exchanges (parallel/cost_model.py)
    state_pass: float = measured(4e-8, "s per token of a state pass (fla, H200, H = 64): one-GPU timings of each "
                                       "rank's work (benchmarks/simulate.py, benchmarks/kernel_costs.py)")
    state_pass_heads: int = measured(64, "the value heads state_pass was measured at")
    state_pass_dim: int = measured(128, "the head dims state_pass was measured at")
    map_pass: float = measured(4.4, "a transition-map pass against a state pass over the same tokens: the same "
                                    "one-GPU timings")
    hop: float = measured(9e-6, "s a sequence cut over ranks costs beyond its chain's state passes, per cut and step "
                                "(fwd+bwd): the measured KDA op rows at 32 heads, 32k and 128k tokens, 100 and 300 "
                                "documents (perdoc_h200x2.csv), our step on the layout against ours on the same "
                                "documents laid out contiguously, less the modelled exchange, least squares over the "
                                "cuts, taken as hop + 32 hop_head "
                                "(tests/layers/test_layout.py::test_cut_price_fits_the_measured_rows)")
    hop_head: float = measured(0.65e-6, "hop's slope in the heads: the per-document zigzag against the contiguous "
                                        "layout at H = 16 and 64 (ops_h200x2.csv)")
    relayout_bw: float = measured(100e9, "bytes / s a layout move carries, its local work included (a third of the "
                                         "link's): the measured op rows of benchmarks/results/perdoc_h200x2.csv, "
                                         "Megatron-LM dev's scheme against fla's CP call on the same contiguous "
                                         "documents (benchmarks/reports/, packed documents measured)")
    heads_relayout_bw: float = measured(140e9, "the same for the op's move to head shards (parallel/cp2hp.py): least "
                                               "squares over the measured KDA op rows of benchmarks/results/"
                                               "perdoc_heads_pack_h200x2.csv, the head-shard step less fla's one-GPU "
                                               "call on the pack over W, 10 to 300 documents (tests/layers/"
                                               "test_layout.py::test_head_shard_price_fits_the_measured_rows)")
    qla_saves: float = measured(4.3e-9, "s per token and value head of a step (fwd+bwd, K = V = 128) flash-qla's GDN "
                                        "core saves against fla's: least squares over fla's one-GPU call less "
                                        "flash-qla's on the same packed documents (perdoc_h200x2.csv, 10 to 300 "
                                        "documents, 32k and 128k tokens: tests/layers/test_layout.py::"
                                        "test_core_price_fits_the_measured_rows)")
    group_cost: float = measured(30e-6, "s a relay head group adds per direction (launches, messages, host work): "
                                        "not fitted, an estimate")
    # flash-qla against fla (kernels/core_qla.py), fitted on GPU runs (benchmarks/reports/)
    qla_min_chains: int = measured(32, "heads x (local tokens / longest local segment) below which fla's kernels "
                                       "beat flash-qla's (GPU runs, benchmarks/reports/)")
    qla_max_interleaved: int = measured(64, "segments a rank holds on per-document zigzag above which flash-qla's "
                                            "covering passes lose (GPU runs, benchmarks/reports/)")
    qla_split_chains: int = measured(128, "scans a rank runs side by side once its segments are split (about one "
                                          "per SM)")
    qla_split_below: int = measured(80, "heads x chains below which the split pays for its maps' passes "
                                        "(benchmarks/reports/)")
    qla_split_min_work: int = measured(1 << 18, "local tokens x heads below which a split step is bound by its host "
                                                "launches")
    qla_split_min_part: int = measured(4096, "tokens: the floor of a split part, lowered only while the sequence "
                                             "holds at most qla_split_max_parts parts")
    qla_split_max_parts: int = measured(32, "parts a sequence holds at most before the part floor stays "
                                            "qla_split_min_part: each adds states to the all-gather and a step to "
                                            "its fold (shorter parts paid with 16 parts, W = 2 and 4, and lost with "
                                            "64, W = 8 predicted; benchmarks/reports/)")
    # fla's core (kernels/core_fla.py) and fla's CP call (parallel/fla_cp.py)
    fla_split_min_part: int = measured(8192, "tokens: the shortest part of the cut of the zigzag middle rank's "
                                             "segment on fla's core (one sequence, predicted W = 8 and 16 runs: parts "
                                             "of 8192 tokens measured faster, KDA 128k at W = 8; parts of 4096 slower, "
                                             "W = 16, a rank's step bound by launches)")
    fla_cp_max_local: int = measured(16384, "tokens a rank up to which fla's CP call runs KDA on the contiguous layout "
                                            "faster than our step, measured in the KDA mixers (benchmarks/reports/): "
                                            "faster or level at 8k tokens a rank (our step host-bound), level at "
                                            "16k, level or slower at 64k")


CALIBRATION = Calibration()
