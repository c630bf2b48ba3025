"""What Megatron hands the layers of one micro batch: the stream's documents and the CP layout they are cut in.

Megatron-LM 0.19 (``pretrain_gpt.py``, ``megatron.core.utils.get_batch_on_this_cp_rank``) cuts a batch
over the CP ranks in one of three ways, and a layer must know which to run the right recurrence:

* ``[s, b]`` rows (no ``packed_seq_params``): every row cut into 2W chunks, rank r holding chunks r and
  2W-1-r (the per-document zigzag with documents = rows).
* ``--sft``: a THD pack whose documents are padded to multiples of 2W (the padding is in ``cu_seqlens``),
  each document cut into 2W chunks (``zigzag_per_doc``).
* ``--dataloader-inter-document-masking``: a THD pack of raw document lengths (micro batch > 1: the rows
  flattened into one stream), the whole stream cut into 2W chunks (``zigzag``).

Both THD routes hand the layers the same ``PackedSeqParams`` (``cu_seqlens_q``, no ``cu_seqlens_q_padded``),
so the route is read from what every rank shares: Megatron's arguments (``--sft``,
``--dataloader-inter-document-masking``) where ``megatron.training`` set them; else :data:`THD_LAYOUT_ENV`
(a training loop of one's own); else ``cu_seqlens_q_padded`` marks the per-document zigzag (the
convention of TransformerEngine's THD attention). Where none of them says, the layers stop and name
them: a guess would train on wrong numbers without an error.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from megatron_kcp.options import THD_LAYOUT_ENV, Options
from megatron_kcp.plan import capturing, check_cu_seqlens

# the THD layouts Megatron cuts, and the flag that gives each
ROUTES = {"zigzag_per_doc": "--sft", "zigzag": "--dataloader-inter-document-masking"}


@dataclass(frozen=True)
class Batch:
    """One micro batch as the layers see it.

    Attributes:
        cu: global cu_seqlens of the stream (a THD pack's documents; an ``[s, b]`` batch's rows).
        layout: the CP layout this rank's tokens are in (:data:`megatron_kcp.plan.LAYOUTS`).
        thd: a THD pack (documents), or ``[s, b]`` rows.
        rows: b of an ``[s, b]`` batch (1 for a THD pack).
        source: the layout Megatron cut the batch in (``layout`` differs once the tokens are moved).
    """
    cu: tuple[int, ...]
    layout: str
    thd: bool
    rows: int = 1
    source: str = ""

    def __post_init__(self):
        if not self.source:
            object.__setattr__(self, "source", self.layout)

    @property
    def stream(self) -> bool:
        """One token stream (a THD pack or a single row), which the layers may move to another layout."""
        return self.rows == 1

    def moved(self, layout: str) -> Batch:
        return replace(self, layout=layout)

    def describe(self) -> str:
        """The ``KCP active`` line's words for what Megatron handed over."""
        if not self.thd:
            return f"[s, b] rows, {self.source}"
        route = ROUTES.get(self.source)
        return f"THD packed documents, {self.source}" + (f" ({route})" if route else "")


def thd_cu_seqlens(packed_seq_params) -> tuple[int, ...] | None:
    """The documents of a THD pack (``cu_seqlens_q_padded`` where given: the per-document zigzag cuts the
    padded documents), or None for a ``[s, b]`` batch."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None
    if capturing():
        raise ValueError("a THD pack inside a CUDA graph: KCP plans its exchange from the documents' lengths on "
                         "the host, and the graph would replay this batch's plan for every later batch. Keep the "
                         "linear-attention layers out of the capture (cuda_graph_modules without 'attn'), or "
                         "capture only steps without packed documents")
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = cu if cu is not None else packed_seq_params.cu_seqlens_q
    if cu is None:
        raise ValueError("a THD pack needs its documents: set packed_seq_params.cu_seqlens_q (and "
                         "cu_seqlens_q_padded where documents are padded to 2 * CP)")
    return check_cu_seqlens(cu)


def megatron_route() -> str | None:
    """The THD layout Megatron's arguments give (:data:`ROUTES`), or None where ``megatron.training`` set no
    arguments or they name no route."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    if args is None:
        return None
    if getattr(args, "hybrid_context_parallel", False):
        raise ValueError("--hybrid-context-parallel: its batches change the CP group per sample, which the KCP "
                         "mixers do not follow; drop the flag (--dataloader-inter-document-masking packs documents "
                         "at a fixed CP size)")
    if getattr(args, "sft", False):
        return "zigzag_per_doc"           # pretrain_gpt.py: per-document balancing whenever --sft is on
    if getattr(args, "dataloader_inter_document_masking", False):
        return "zigzag"
    return None


def thd_layout(packed_seq_params, cp: int) -> str:
    """The CP layout of a THD pack at CP size ``cp`` (see the module docstring); ValueError naming the
    flags where nothing says."""
    if cp == 1:
        return "contiguous"
    if getattr(packed_seq_params, "local_cp_size", None) is not None or \
            getattr(packed_seq_params, "cp_group", None) is not None:
        raise ValueError("a THD pack with its own CP group (--hybrid-context-parallel): the KCP mixers run on "
                         "Megatron's fixed CP group; drop --hybrid-context-parallel")
    declared = Options.from_env().thd_layout or None
    if declared is not None and declared not in ROUTES:
        raise ValueError(f"{THD_LAYOUT_ENV}={declared!r}: use one of {', '.join(ROUTES)} (or unset it)")
    route = megatron_route()
    if declared and route and declared != route:
        raise ValueError(f"{THD_LAYOUT_ENV}={declared} but Megatron's {ROUTES[route]} cuts the batch {route}: "
                         f"unset {THD_LAYOUT_ENV}")
    layout = route or declared
    if layout is None and packed_seq_params.cu_seqlens_q_padded is not None:
        layout = "zigzag_per_doc"
    if layout is None:
        raise ValueError(
            f"a THD pack at CP = {cp} without cu_seqlens_q_padded: its CP layout is not known. Megatron's "
            "pretrain_gpt.py cuts it per document with --sft and as one stream with "
            f"--dataloader-inter-document-masking; in a loop of your own set {THD_LAYOUT_ENV}=zigzag (the whole "
            "stream cut into 2 * CP chunks) or zigzag_per_doc (each document), or pass cu_seqlens_q_padded for "
            "the per-document cut")
    return layout


def batch_of(packed_seq_params, seq: int, rows: int, cp: int) -> Batch:
    """The :class:`Batch` of ``[seq, rows]`` hidden states of this rank (``seq``: its tokens before any
    sequence-parallel split) at CP size ``cp``."""
    cu = thd_cu_seqlens(packed_seq_params)
    if cu is None:
        cu = tuple(range(0, (rows + 1) * seq * cp, seq * cp))
        return Batch(cu, "zigzag_per_doc" if cp > 1 else "contiguous", thd=False, rows=rows)
    if rows != 1:
        raise ValueError(f"a THD pack with micro batch dimension {rows}: Megatron flattens the micro batch into one "
                         "stream ([t, 1, h], megatron.core.utils.flatten_batch_for_packed_sequences); pass it so")
    layout = thd_layout(packed_seq_params, cp)
    if layout == "zigzag" and cu[-1] % (2 * cp):
        raise ValueError(f"a THD pack of {cu[-1]} tokens cut as one stream (zigzag) over CP = {cp}: the stream must "
                         f"be a multiple of 2 * CP = {2 * cp} tokens (--seq-length)")
    return Batch(cu, layout, thd=True)
