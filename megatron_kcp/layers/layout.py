"""The layout of the hidden states around the linear mixers: convert only where the layout changes.

Megatron hands a packed THD batch to every layer in the per-document zigzag layout (each document cut
into 2W chunks, rank r holding chunks r and 2W-1-r), which softmax attention needs and which makes
every document a chain over all CP ranks for a linear mixer. The hidden states (d_model per token,
the smallest tensor of a layer) move to the contiguous layout, where at most W - 1 documents cross
a rank edge, with one all-to-all (:mod:`megatron_kcp.parallel.relayout`):

* in the hybrid specs, :class:`KCPTransformerLayer` keeps a run of consecutive linear layers (with
  their norms, MLPs and residuals, all per token) in the contiguous layout: the run's first layer
  moves its input there and its last moves its output back, so every softmax-attention layer, the
  model's output (and so the loss) and everything Megatron does between layers sees its own layout.
  A pipeline stage boundary inside a run passes the contiguous layout, which the next stage's
  layers expect; activation recompute re-runs the all-to-alls with the layer;
* a linear mixer outside such a layer converts its own input and output.

Whether to convert is :func:`megatron_kcp.parallel.cost_model.convert_pays`'s, from what all ranks
share (cu_seqlens, CP size, heads, head dims, d_model, dtype, the run's length): the all-to-alls
against the exchange they save. Under sequence parallelism the all-to-all runs over the
tensor-and-context-parallel group (a row may move to another TP rank's share); without it over the
CP group. A ``[s, b]`` batch with b > 1 (rows, not packed documents) is not converted.
"""
from __future__ import annotations

import functools
import os

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_kcp.parallel.cost_model import CONVERT_ENV, convert_pays
from megatron_kcp.parallel.plan import capturing, check_cu_seqlens
from megatron_kcp.parallel.relayout import check_tp_cp_group, relayout

SOURCE, TARGET = "zigzag_per_doc", "contiguous"


def is_linear(config, layer_number: int) -> bool:
    from megatron_kcp.spec import is_linear_layer
    return is_linear_layer(config, layer_number)


def run_of(config, layer_number: int) -> tuple[int, int]:
    """(first, last) layer numbers of the run of consecutive linear layers holding ``layer_number``."""
    first = last = layer_number
    while first > 1 and is_linear(config, first - 1):
        first -= 1
    while last < config.num_layers and is_linear(config, last + 1):
        last += 1
    return first, last


def thd_cu_seqlens(packed_seq_params) -> tuple[int, ...] | None:
    """The documents of a THD pack (``cu_seqlens_q_padded`` where given: Megatron's CP layout cuts the
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


def stream_cu(packed_seq_params, seq: int, batch: int, cp: int) -> tuple[int, ...] | None:
    """The global cu_seqlens of Megatron's batch (None: several rows, not converted)."""
    cu = thd_cu_seqlens(packed_seq_params)
    if cu is not None:
        return cu
    return (0, seq * cp) if batch == 1 else None


def hidden_bytes(config) -> int:
    return config.hidden_size * (torch.finfo(config.params_dtype).bits // 8)


def run_traffic(hidden_bytes_per_token: float, run_length: int) -> tuple[float, float]:
    """(bytes per token, all-to-alls) that each layer of a converted run of ``run_length`` linear layers
    pays: the run moves its hidden states four times (in and out, forward and backward)."""
    return 4 * hidden_bytes_per_token / run_length, 4 / run_length


@functools.lru_cache(maxsize=256)
def _converts(cu, cp, heads, head_dim, bytes_per_token, messages, forced) -> bool:
    return convert_pays(cu, SOURCE, cp, heads, head_dim, bytes_per_token, messages)


def converts(config, cu: tuple[int, ...] | None, cp: int, tp: int, run_length: int) -> bool:
    """Whether a run of ``run_length`` linear layers (1: a mixer on its own) runs in the contiguous layout
    (what it moves: :func:`run_traffic`)."""
    if cu is None or cp == 1:
        return False
    heads = config.linear_num_value_heads // tp
    return _converts(cu, cp, heads, config.linear_value_head_dim, *run_traffic(hidden_bytes(config), run_length),
                     os.environ.get(CONVERT_ENV))      # the override is part of the key


def conversion_group(pg_collection, sequence_parallel: bool):
    """(group, tp) of the all-to-all: the CP group, or under sequence parallelism the TP x CP group."""
    tp = pg_collection.tp.size()
    if not sequence_parallel or tp == 1:
        return pg_collection.cp, 1
    check_tp_cp_group(pg_collection.tp_cp, pg_collection.cp.rank(), pg_collection.tp.rank(), tp)
    return pg_collection.tp_cp, tp


def move(hidden: torch.Tensor, cu: tuple[int, ...], source: str, target: str, group, tp: int) -> torch.Tensor:
    """``[s, 1, h]`` hidden states of this rank from layout ``source`` to ``target`` (squeezed and
    unsqueezed as views, whose backward copies nothing)."""
    return relayout([hidden.squeeze(1)], cu, source, target, group, tp)[0][:, None]


class KCPTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer``; in a run of linear layers it runs in the contiguous layout where
    that pays (see the module docstring). Its linear mixer is given the run (``mixer.layer_run``)."""

    def __init__(self, config, submodules, layer_number: int = 1, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, **kwargs)
        # a mixer that runs in any layout says so (megatron-core's cp2hp GatedDeltaNet does not)
        self.linear = is_linear(config, self.layer_number) and getattr(self.self_attention, "any_layout", False)
        self.run = run_of(config, self.layer_number) if self.linear else None
        if self.linear:
            self.self_attention.layer_run = self.run

    def layout(self, hidden_states, packed_seq_params) -> tuple[tuple[int, ...] | None, bool]:
        """(cu_seqlens, whether this layer's run is converted)."""
        pg = self.pg_collection
        tp = pg.tp.size() if self.config.sequence_parallel else 1
        cu = stream_cu(packed_seq_params, hidden_states.shape[0] * tp, hidden_states.shape[1], pg.cp.size())
        run_length = self.run[1] - self.run[0] + 1
        return cu, converts(self.config, cu, pg.cp.size(), pg.tp.size(), run_length)

    def forward(self, hidden_states, *args, **kwargs):
        if not self.linear:
            return super().forward(hidden_states, *args, **kwargs)
        cu, convert = self.layout(hidden_states, kwargs.get("packed_seq_params"))
        if not convert:
            return super().forward(hidden_states, *args, **kwargs)
        group, tp = conversion_group(self.pg_collection, self.config.sequence_parallel)
        if self.layer_number == self.run[0]:
            hidden_states = move(hidden_states, cu, SOURCE, TARGET, group, tp)
        out, context = super().forward(hidden_states, *args, **kwargs)
        if self.layer_number == self.run[1]:
            out = move(out, cu, TARGET, SOURCE, group, tp)
        return out, context


def mixer_input(mixer, hidden_states, packed_seq_params):
    """(the mixer's input in the layout it runs in, that layout (None: Megatron's), a function that
    puts the mixer's output back in Megatron's). Inside a :class:`KCPTransformerLayer` the layer has
    moved its run already; a mixer on its own moves its input and output itself where that pays."""
    pg, config = mixer.pg_collection, mixer.config
    tp = pg.tp.size() if config.sequence_parallel else 1
    cu = stream_cu(packed_seq_params, hidden_states.shape[0] * tp, hidden_states.shape[1], pg.cp.size())
    if not mixer.any_layout:
        return hidden_states, None, lambda out: out
    run = getattr(mixer, "layer_run", None)
    if run is not None:
        converted = converts(config, cu, pg.cp.size(), pg.tp.size(), run[1] - run[0] + 1)
        return hidden_states, TARGET if converted else None, lambda out: out
    if not converts(config, cu, pg.cp.size(), pg.tp.size(), 1):
        return hidden_states, None, lambda out: out
    group, tp = conversion_group(pg, config.sequence_parallel)

    def back(out):
        return move(out, cu, TARGET, SOURCE, group, tp)
    return move(hidden_states, cu, SOURCE, TARGET, group, tp), TARGET, back


def describe(mixer, plan) -> str:
    """What the ``KCP active`` line says of the conversions (empty where none runs)."""
    if plan.layout != TARGET or plan.world_size == 1:
        return ""
    if getattr(mixer, "layer_run", None) is not None:
        config = mixer.config
        runs = sum(is_linear(config, n) and (n == 1 or not is_linear(config, n - 1))
                   for n in range(1, config.num_layers + 1))
        return (f", hidden states moved from {SOURCE} at the edges of each run of linear layers: {2 * runs} "
                "all-to-alls per forward, as many backward")
    return f", hidden states moved from {SOURCE} by each mixer: 2 all-to-alls per layer and pass"
