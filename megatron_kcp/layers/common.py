"""What the KCP mixers share: the plan of Megatron's batch, and the line that says a run uses KCP.

The line, printed once by global rank 0 at the first forward of a KCP mixer::

    [megatron_kcp] KCP active: KCPGatedDeltaNet (layer 1), CP size 2, TP size 1, layout contiguous
    (THD packed documents, zigzag_per_doc (--sft), hidden states moved to contiguous at the edges of each run
    of linear layers: 4 all-to-alls per forward, as many backward), strategy gather, core flash-qla, conv gluon,
    layers local

``layout`` is the one the mixer runs in; the parenthesis says what Megatron handed over (THD documents
or ``[s, b]`` rows, the CP layout it cut them in and the flag that gives it) and any conversion.

An unmodified Megatron-LM that cannot import a ``--spec`` logs the error and trains its default GPT:
without this line, a run is not using the KCP mixers. Under pipeline parallelism rank 0 holds the
first stage; a first stage without any KCP layer prints nothing.
"""
from __future__ import annotations

import torch
from megatron_kcp.environment import te_available
from megatron_kcp.layers import layout as hidden
from megatron_kcp.layers.batch import Batch
from megatron_kcp.ops import dispatch
from megatron_kcp.ops.kcp import conv_backend
from megatron_kcp.plan import KCPPlan, plan_for_cp_group

_announced = False


def packed_plan(batch: Batch, seq_len: int, rows: int, conv_kernel_size: int, group) -> KCPPlan:
    """The KCP plan of a mixer's ``[seq_len, rows]`` tokens of ``batch`` (in the layout the mixer runs in):
    a THD pack's documents, or each of the rows a document."""
    if batch.rows != rows:
        raise ValueError(f"the mixer's projections give {rows} rows, its batch has {batch.rows}")
    return plan_for_cp_group(batch.cu, batch.layout, conv_kernel_size, group)


def announce(mixer, plan: KCPPlan, batch: Batch, q, v, g, tp_size: int = 1, strategy: str = "auto",
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
    extra = "".join(f", {name}={val}" for name, val in options.items())
    print(f"[megatron_kcp] KCP active: {type(mixer).__name__} (layer {mixer.layer_number}{extra}), "
          f"CP size {plan.world_size}, TP size {tp_size}, layout {plan.layout} "
          f"({batch.describe()}{hidden.describe(mixer, batch)}), {chosen.describe()}, "
          f"conv {conv_backend(q.device, q.dtype, plan.conv_kernel_size)}, "
          f"layers {'transformer_engine' if te_available() else 'local'}", flush=True)
