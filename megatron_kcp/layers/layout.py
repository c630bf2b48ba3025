"""The layout of the hidden states around the linear mixers: convert only where the layout changes.

Megatron hands a packed THD batch to every layer in the layout it cut it in (:mod:`megatron_kcp.layers.batch`):
with ``--sft`` the per-document zigzag (each document cut into 2W chunks, rank r holding chunks r and
2W-1-r), which balances softmax attention and makes every document a chain over all CP ranks for a
linear mixer; with ``--dataloader-inter-document-masking`` the whole stream cut into 2W chunks, where at
most 2W - 1 documents cross a rank edge. The hidden states (d_model per token, the smallest tensor of a
layer) move to the contiguous layout, where at most W - 1 documents cross a rank edge, with one
all-to-all (:mod:`megatron_kcp.parallel.relayout`) where that pays:

* in the hybrid specs, :class:`KCPTransformerLayer` keeps a run of consecutive linear layers (with
  their norms, MLPs and residuals, all per token) in the contiguous layout: the run's first layer
  moves its input there and its last moves its output back, so every softmax-attention layer, the
  model's output (and so the loss) and everything Megatron does between layers sees its own layout.
  A pipeline stage boundary inside a run passes the contiguous layout, which the next stage's
  layers expect; activation recompute re-runs the all-to-alls with the layer;
* a linear mixer outside such a layer converts its own input and output.

Whether to convert is :func:`megatron_kcp.parallel.cost_model.relayout_pays`'s, from what all ranks
share (cu_seqlens, CP size, heads, head dims, d_model, dtype, the run's length): the all-to-alls
against the exchange they save. Under sequence parallelism the all-to-all runs over the
tensor-and-context-parallel group (a row may move to another TP rank's share); without it over the
CP group. A ``[s, b]`` batch with b > 1 (rows, not packed documents) is not converted.
"""
from __future__ import annotations

import functools

import torch

from megatron_kcp.layers.batch import Batch, batch_of
from megatron_kcp.layers.pattern import linear_pattern
from megatron_kcp.options import Options
from megatron_kcp.parallel.cost_model import relayout_pays
from megatron_kcp.parallel.relayout import check_tp_cp_group, relayout

TARGET = "contiguous"


def hidden_bytes(config) -> int:
    return config.hidden_size * (torch.finfo(config.params_dtype).bits // 8)


def run_traffic(hidden_bytes_per_token: float, run_length: int) -> tuple[float, float]:
    """(bytes per token, all-to-alls) that each layer of a converted run of ``run_length`` linear layers
    pays: the run moves its hidden states four times (in and out, forward and backward)."""
    return 4 * hidden_bytes_per_token / run_length, 4 / run_length


@functools.lru_cache(maxsize=256)
def _converts(cu, source, cp, heads, head_dim, bytes_per_token, messages, options: Options) -> bool:
    return relayout_pays(cu, source, cp, heads, head_dim, bytes_per_token, messages, options=options)


def converts(config, batch: Batch, cp: int, tp: int, run_length: int) -> bool:
    """Whether a run of ``run_length`` linear layers (1: a mixer on its own) runs in the contiguous layout
    (what it moves: :func:`run_traffic`); never for an ``[s, b]`` batch of several rows."""
    if not batch.stream or cp == 1:
        return False
    heads = config.linear_num_value_heads // tp
    return _converts(batch.cu, batch.source, cp, heads, config.linear_value_head_dim,
                     *run_traffic(hidden_bytes(config), run_length),
                     Options.from_env())      # the overrides are part of the key


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


def layer_batch(module, hidden_states, packed_seq_params) -> Batch:
    """The :class:`Batch` a layer or mixer of ``module``'s process groups and config is handed."""
    pg, config = module.pg_collection, module.config
    tp = pg.tp.size() if config.sequence_parallel else 1
    return batch_of(packed_seq_params, hidden_states.shape[0] * tp, hidden_states.shape[1], pg.cp.size())


def check_whole_stream(mixer, layer_number: int) -> None:
    """A mixer whose module takes only Megatron's per-document zigzag (TransformerEngine's THD attention,
    megatron-core's own GatedDeltaNet) stops where a THD pack comes cut as one stream, naming the route
    that works (the layer's forward checks each batch; the specs check at construction where Megatron's
    arguments say --dataloader-inter-document-masking)."""
    if type(mixer).__module__.startswith("megatron.core.transformer.multi_latent_attention"):
        raise ValueError(
            f"layer {layer_number}: megatron-core's {type(mixer).__name__} rotates a THD pack under CP as every "
            "document cut into 2 * CP chunks (--sft); --dataloader-inter-document-masking cuts the whole stream. "
            "Train the documents with --sft, or at --context-parallel-size 1")
    module = getattr(mixer, "core_attention", mixer)
    name = type(module).__module__
    if name.startswith("megatron.core.extensions.transformer_engine"):
        raise ValueError(
            f"layer {layer_number}: TransformerEngine's THD attention under CP reads every document as cut "
            "into 2 * CP chunks (--sft) and, given the whole stream cut into 2 * CP chunks "
            "(--dataloader-inter-document-masking), attends across the wrong tokens without an error. Train the "
            "documents with --sft (each padded to a multiple of 2 * CP), or at --context-parallel-size 1; without "
            "TransformerEngine the specs' own CP attention takes either cut")
    if name.startswith("megatron.core.ssm"):
        raise ValueError(
            f"layer {layer_number}: megatron-core's {type(module).__name__} takes each document cut into "
            "2 * CP chunks (--sft), and --dataloader-inter-document-masking cuts the whole stream; use --sft, or "
            "the KCP mixers (--spec megatron_kcp gdn_hybrid_layer_spec), which take either cut")


def mixer_input(mixer, hidden_states, packed_seq_params):
    """(the mixer's input in the layout it runs in, its :class:`Batch` in that layout, a function that
    puts the mixer's output back in Megatron's). Inside a :class:`KCPTransformerLayer` the layer has
    moved its run already; a mixer on its own moves its input and output itself where that pays."""
    pg, config = mixer.pg_collection, mixer.config
    batch = layer_batch(mixer, hidden_states, packed_seq_params)
    run = getattr(mixer, "layer_run", None)
    length = 1 if run is None else run[1] - run[0] + 1
    if not mixer.any_layout or not converts(config, batch, pg.cp.size(), pg.tp.size(), length):
        return hidden_states, batch, lambda out: out
    if run is not None:
        return hidden_states, batch.moved(TARGET), lambda out: out
    group, tp = conversion_group(pg, config.sequence_parallel)

    def back(out):
        return move(out, batch.cu, TARGET, batch.source, group, tp)
    return move(hidden_states, batch.cu, batch.source, TARGET, group, tp), batch.moved(TARGET), back


def describe(mixer, batch: Batch) -> str:
    """What the ``KCP active`` line says of the conversions (empty where none runs)."""
    if batch.layout == batch.source:
        return ""
    if getattr(mixer, "layer_run", None) is not None:
        pattern = linear_pattern(mixer.config)
        runs = sum(linear and (n == 0 or not pattern[n - 1]) for n, linear in enumerate(pattern))
        return (f", hidden states moved to {batch.layout} at the edges of each run of linear layers: {2 * runs} "
                "all-to-alls per forward, as many backward")
    return f", hidden states moved to {batch.layout} by each mixer: 2 all-to-alls per layer and pass"
