"""The line that says a run trains with KCP, printed once, on global rank 0, at the first forward of a
KCP mixer:

    [megatron_kcp] KCP active: KCPGatedDeltaNet (layer 1), CP size 2, TP size 1, layout zigzag_per_doc
    ([s, b] rows), exchange relay, kernels qla, layers local

An unmodified Megatron-LM that cannot import a ``--spec`` logs the error and trains its default GPT:
without this line, a run is not using the KCP mixers. Under pipeline parallelism rank 0 holds the
first stage; a first stage without any KCP layer prints nothing.
"""
from __future__ import annotations

import torch

from megatron_kcp.environment import te_available

_announced = False


def announce(mixer, plan, q, v, g, packed_seq_params=None, tp_size: int = 1, exchange: str = "auto", **options):
    """Print the line if this process has not yet (call before each forward's gated delta rule, with its
    inputs: they decide the kernels, ``kcp.kernels``)."""
    global _announced
    if _announced:
        return
    _announced = True
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    from megatron_kcp.ops import kcp
    if exchange == "cp2hp" and plan.world_size > 1:
        kernels = kcp._backend("auto", q)
    else:
        kernels, exchange, cut = kcp.kernels("auto", q, v, g, plan, exchange)
        if cut:
            kernels += f" (segments cut to {cut} tokens)"
        if kernels == "chunk":
            kernels = "fla's single-device call"
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    extra = "".join(f", {name}={val}" for name, val in options.items())
    print(f"[megatron_kcp] KCP active: {type(mixer).__name__} (layer {mixer.layer_number}{extra}), "
          f"CP size {plan.world_size}, TP size {tp_size}, layout {plan.layout} "
          f"({'THD packed documents' if thd else '[s, b] rows'}), "
          f"exchange {'none' if plan.world_size == 1 else exchange}, kernels {kernels}, "
          f"layers {'transformer_engine' if te_available() else 'local'}", flush=True)
