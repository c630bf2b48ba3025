"""What the KCP mixers share: the plan of Megatron's batch, and the line that says a run uses KCP.

The line, printed once by global rank 0 at the first forward of a KCP mixer::

    [megatron_kcp] KCP active: KCPGatedDeltaNet (layer 1), CP size 2, TP size 1, layout contiguous
    (THD packed documents, hidden states moved from zigzag_per_doc at the edges of each run of linear
    layers: 4 all-to-alls per forward, as many backward), strategy gather, core flash-qla, conv gluon, layers local

An unmodified Megatron-LM that cannot import a ``--spec`` logs the error and trains its default GPT:
without this line, a run is not using the KCP mixers. Under pipeline parallelism rank 0 holds the
first stage; a first stage without any KCP layer prints nothing.
"""
from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_kcp.environment import te_available
from megatron_kcp.layers import layout as hidden
from megatron_kcp.ops import dispatch
from megatron_kcp.ops.kcp import conv_backend
from megatron_kcp.parallel.plan import KCPPlan, plan_for_cp_group

_announced = False


def packed_plan(packed_seq_params: PackedSeqParams | None, seq_len: int, batch: int, cp_size: int,
                conv_kernel_size: int, group, layout: str | None = None) -> KCPPlan:
    """The KCP plan of Megatron's batch: THD packs documents per-document-zigzag (cu_seqlens_padded
    when given); a ``[s, b]`` batch is b rows, each split zigzag over CP (or whole at CP = 1).
    ``layout``: the one the tokens were moved to (:mod:`megatron_kcp.layers.layout`), if any."""
    cu = hidden.thd_cu_seqlens(packed_seq_params)
    if cu is not None:
        if batch != 1:
            raise ValueError(f"THD packed sequences need micro batch size 1, got {batch}: "
                             "set --micro-batch-size 1 and pack more documents per sequence instead")
    else:
        cu = torch.arange(batch + 1) * (seq_len * cp_size)
    layout = layout or ("zigzag_per_doc" if cp_size > 1 else "contiguous")
    return plan_for_cp_group(cu, layout, conv_kernel_size, group)


def announce(mixer, plan: KCPPlan, q, v, g, packed_seq_params=None, tp_size: int = 1, strategy: str = "auto",
             **options) -> None:
    """Print the ``KCP active`` line if this process has not yet (call before each forward's gated delta
    rule, with its inputs: they decide what runs, :func:`megatron_kcp.ops.dispatch.decide`)."""
    global _announced
    if _announced:
        return
    _announced = True
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    chosen = dispatch.decide(plan, q, v, g, strategy=strategy)
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    extra = "".join(f", {name}={val}" for name, val in options.items())
    print(f"[megatron_kcp] KCP active: {type(mixer).__name__} (layer {mixer.layer_number}{extra}), "
          f"CP size {plan.world_size}, TP size {tp_size}, layout {plan.layout} "
          f"({'THD packed documents' if thd else '[s, b] rows'}{hidden.describe(mixer, plan)}), {chosen.describe()}, "
          f"conv {conv_backend(q.device, q.dtype, plan.conv_kernel_size)}, "
          f"layers {'transformer_engine' if te_available() else 'local'}", flush=True)
