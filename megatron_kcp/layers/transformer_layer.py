"""The hybrid specs' layer: megatron-core's ``TransformerLayer``, built per layer from the config and run
in the contiguous layout across a run of linear layers where that pays (:mod:`megatron_kcp.layers.layout`)."""
from __future__ import annotations

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from megatron_kcp.environment import te_available
from megatron_kcp.layers.batch import Batch, megatron_route
from megatron_kcp.layers.hybrid import HybridLayerSubmodules, layer_submodules
from megatron_kcp.layers import layout
from megatron_kcp.layers.layout import TARGET, check_whole_stream, conversion_group, converts, layer_batch
from megatron_kcp.layers.pattern import is_linear_layer, run_of


class KCPTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer``. Given :class:`HybridLayerSubmodules` (the hybrid specs) it builds its
    submodules for its global layer number (:func:`~megatron_kcp.layers.hybrid.layer_submodules`); given
    ``TransformerLayerSubmodules`` it takes them as they are. In a run of linear layers it runs in the
    contiguous layout where that pays; its linear mixer is given the run (``mixer.layer_run``)."""

    def __init__(self, config, submodules, layer_number: int = 1, *, vp_stage=None, pg_collection=None,
                 is_mtp_layer: bool = False, add_layer_offset: bool = True, **kwargs):
        pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
        if isinstance(submodules, HybridLayerSubmodules):
            number = layer_number
            if not is_mtp_layer and add_layer_offset:       # TransformerLayer's own numbering
                number += get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
            submodules = layer_submodules(config, number, submodules)
        super().__init__(config, submodules, layer_number=layer_number, vp_stage=vp_stage,
                         pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, add_layer_offset=add_layer_offset,
                         **kwargs)
        if megatron_route() is not None and config.mtp_num_layers and not te_available():   # before the first step
            raise ValueError("--mtp-num-layers on documents (--sft, --dataloader-inter-document-masking) needs "
                             "TransformerEngine: Megatron builds the MTP layer from megatron-core's own local spec, "
                             "whose attention takes no THD packs; install TE, or train MTP on rows")
        if config.context_parallel_size > 1 and megatron_route() is not None:
            self._check_moe_on_packs()
        if config.context_parallel_size > 1 and megatron_route() == "zigzag":
            check_whole_stream(self.self_attention, self.layer_number)
            if config.mtp_num_layers:
                raise ValueError("--mtp-num-layers with --dataloader-inter-document-masking at CP > 1: Megatron "
                                 "builds the MTP layer from megatron-core's own GPT spec, whose RoPE and TE attention "
                                 "take only the per-document cut; use --sft, or CP 1")
        # a mixer that runs in any layout says so (megatron-core's cp2hp GatedDeltaNet does not)
        self.linear = (not is_mtp_layer and is_linear_layer(config, self.layer_number)
                       and getattr(self.self_attention, "any_layout", False))
        self.run = run_of(config, self.layer_number) if self.linear else None
        if self.linear:
            self.self_attention.layer_run = self.run

    def _maybe_unflatten_for_moe(self, hidden_states, padding_mask, packed_seq_params):
        """megatron-core regroups a pack of ``micro batch`` samples into rows of ``tokens_per_sample`` tokens for
        the MoE's sequence-level aux loss; under CP a rank holds a share of each sample, cut per document or
        across samples (the whole stream), so those rows would be wrong: an error naming the fix where that
        loss is on, the tokens left as they are otherwise (routing is per token)."""
        if (packed_seq_params is None or self.pg_collection.cp.size() == 1
                or getattr(packed_seq_params, "tokens_per_sample", None) is None):
            return super()._maybe_unflatten_for_moe(hidden_states, padding_mask, packed_seq_params)
        self._check_moe_on_packs()
        return hidden_states, padding_mask, None

    def _check_moe_on_packs(self):
        if self.is_moe_layer and "seq_aux_loss" in str(self.config.moe_router_load_balancing_type):
            raise ValueError("--moe-router-load-balancing-type seq_aux_loss on THD packs at CP > 1: megatron-core "
                             "groups a rank's tokens into samples that CP has cut; use aux_loss or global_aux_loss")

    def layout(self, hidden_states, packed_seq_params) -> tuple[Batch, bool]:
        """(the batch Megatron hands this layer, whether this layer's run is converted)."""
        batch = layer_batch(self, hidden_states, packed_seq_params)
        if not self.linear:
            return batch, False
        pg = self.pg_collection
        return batch, converts(self.config, batch, pg.cp.size(), pg.tp.size(), self.run[1] - self.run[0] + 1)

    def forward(self, hidden_states, *args, **kwargs):
        batch, convert = self.layout(hidden_states, kwargs.get("packed_seq_params"))
        if not self.linear:
            if batch.source == "zigzag" and batch.thd and self.pg_collection.cp.size() > 1:
                check_whole_stream(self.self_attention, self.layer_number)
            return super().forward(hidden_states, *args, **kwargs)
        if not convert:
            return super().forward(hidden_states, *args, **kwargs)
        group, tp = conversion_group(self.pg_collection, self.config.sequence_parallel)
        if self.layer_number == self.run[0]:
            hidden_states = layout.move(hidden_states, batch.cu, batch.source, TARGET, group, tp)
        out, context = super().forward(hidden_states, *args, **kwargs)
        if self.layer_number == self.run[1]:
            out = layout.move(out, batch.cu, TARGET, batch.source, group, tp)
        return out, context
