"""A CPU stand-in for the TransformerEngine modules megatron-core's TE specs build, for tests only.

megatron-core's own hybrid (``get_transformer_block_with_experimental_attention_variant_spec``) builds only
with TransformerEngine, which needs a GPU. Inside :func:`te_standin` the classes below take the place of
megatron-core's TE wrappers (``megatron/core/extensions/transformer_engine.py``) in every module that holds a
reference to them, so that megatron-core's TE specs, and the KCP hybrid's TE path, build and run on the CPU
with TE's checkpoint format.

What the stand-in reproduces, checked against megatron-core 0.19.2's
``megatron/core/extensions/transformer_engine.py`` and the TransformerEngine source (mirror at commit
d0067d0, 2.20.0.dev0: ``transformer_engine/pytorch/module/{base,linear,layernorm_linear,rmsnorm,layernorm}.py``,
``transformer_engine/pytorch/ops/op.py``, ``transformer_engine/pytorch/ops/basic/{rmsnorm,layer_norm}.py``,
``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``):

* parameter names and local shapes: ``TELayerNormColumnParallelLinear``: ``layer_norm_weight``
  (``layer_norm_bias`` for LayerNorm only), ``weight [out / TP, in]``, ``bias`` only when ``bias=True`` (TE
  keeps a plain empty tensor attribute otherwise, in no state dict); ``TEColumnParallelLinear`` /
  ``TERowParallelLinear``: ``weight`` ``[out / TP, in]`` / ``[out, in / TP]``, ``bias``; TE's norms (what
  ``TENorm`` returns): ``weight`` (``bias`` for LayerNorm); zero-centred gamma (``1 + w``, ``w`` initialised to
  zero) in the norms and the fused norm, as TE's ``zero_centered_gamma``;
* ``_extra_state`` in ``state_dict()`` of every TE module (the linears, the norms, the core attention), an
  empty ``uint8`` tensor as TE writes it without FP8 (``TransformerEngineBaseModule.get_extra_state`` /
  ``BasicOperation.get_extra_state``), and ``set_extra_state`` accepting ``None`` and empty tensors;
* ``sharded_state_dict``: megatron-core's wrappers' own (column: ``{"weight": 0, "bias": 0}``; row:
  ``{"weight": 1}``; the core attention none unless ``softmax_type == "learnable"``); the norms have none, so
  megatron-core's ``sharded_state_dict_default`` wraps their state dict, ``_extra_state`` included, as it does
  for TE's ``RMSNorm``;
* the wrappers' constructor arguments and checks (``gather_output``, ``is_expert`` on the fused linear,
  ``input_is_parallel``), ``(output, bias)`` returns with ``skip_bias_add``, CPU initialisation
  (``_initialize_affine_weight_cpu`` as the wrappers call it), the expert parameter attributes
  (megatron-core's own ``_set_expert_parameter_attributes``) and the TP communication TE does inside its
  linears (identity / all-reduce, or the sequence-parallel all-gather / reduce-scatter; none for experts with
  TP or EP > 1, whose dispatcher communicates).

What it cannot reproduce: FP8 / FP4 / MXFP8 (the contents of a non-empty ``_extra_state``: recipes, scales,
amax histories; loading one raises), TE's kernels (the math is PyTorch's, in fp32 for the norms), userbuffer
overlap, delayed weight-gradient compute, grouped GEMM (``TEGroupedMLP``: the provider falls back to
``SequentialMLP``, as megatron-core does when TE's grouped linear is missing), ``TELinear`` in duplicated
mode (MLA's down projections), the op fuser (``TEFusedMLP``), TE's activation op, and TE attention's
backends (the core attention is :class:`~megatron_kcp.layers.attention.CPDotProductAttention`: causal
self-attention, vanilla softmax, THD packs or none).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn import Parameter

from megatron_kcp.layers.attention import CPDotProductAttention


def _extension():
    import megatron.core.extensions.transformer_engine as ext
    return ext


class _TEExtraState:
    """TE's ``_extra_state``: an empty uint8 tensor without FP8 (``TransformerEngineBaseModule.get_extra_state``)."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise NotImplementedError(f"{type(self).__name__} (TE stand-in): a non-empty _extra_state (FP8 metadata) "
                                  "cannot be loaded without TransformerEngine")


def _norm(x, weight, bias, eps: float, rms: bool, zero_centered: bool):
    w = weight.float() + 1 if zero_centered else weight.float()
    b = None if bias is None else bias.float()
    y = F.rms_norm(x.float(), x.shape[-1:], w, eps) if rms else F.layer_norm(x.float(), x.shape[-1:], w, b, eps)
    return y.to(x.dtype)


class _TENormModule(_TEExtraState, torch.nn.Module):
    """TE's ``RMSNorm`` / ``LayerNorm`` (``weight``, LayerNorm's ``bias``, ``_extra_state``); no sharded_state_dict."""

    def __init__(self, hidden_size: int, eps: float, rms: bool, zero_centered_gamma: bool, sequence_parallel: bool,
                 dtype: torch.dtype):
        super().__init__()
        self.eps, self.rms, self.zero_centered_gamma = eps, rms, zero_centered_gamma
        self.sequence_parallel = sequence_parallel
        self.weight = Parameter(torch.empty(hidden_size, dtype=dtype))
        self.bias = None if rms else Parameter(torch.empty(hidden_size, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()
        for p in (self.weight, self.bias):
            if p is not None:
                p.sequence_parallel = self.sequence_parallel

    def forward(self, x):
        return _norm(x, self.weight, self.bias, self.eps, self.rms, self.zero_centered_gamma)


class TERMSNorm(_TENormModule):
    def __init__(self, hidden_size, eps, zero_centered_gamma, sequence_parallel, dtype):
        super().__init__(hidden_size, eps, True, zero_centered_gamma, sequence_parallel, dtype)


class TELayerNorm(_TENormModule):
    def __init__(self, hidden_size, eps, zero_centered_gamma, sequence_parallel, dtype):
        super().__init__(hidden_size, eps, False, zero_centered_gamma, sequence_parallel, dtype)


class TENorm:
    """megatron-core's ``TENorm``: a TE ``RMSNorm`` or ``LayerNorm`` for ``config.normalization``."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        if config.fused_residual_rmsnorm and has_residual:
            raise NotImplementedError("TE stand-in: TEFusedResidualRMSNorm (--fused-residual-rmsnorm) is not modelled")
        kinds = {"RMSNorm": TERMSNorm, "LayerNorm": TELayerNorm}
        if config.normalization not in kinds:
            raise Exception("Only LayerNorm and RMSNorm are currently supported")
        return kinds[config.normalization](hidden_size, eps, config.layernorm_zero_centered_gamma,
                                           config.sequence_parallel, config.params_dtype)


class _TELinearBase(_TEExtraState, torch.nn.Module):
    """What megatron-core's ``TELinear`` and TE's ``Linear`` / ``LayerNormLinear`` hold and do for the column and
    row modes: local weight and bias, TE's TP communication, ``(out, bias)`` returns."""

    def _setup(self, input_size, output_size, parallel_mode, config, init_method, bias, skip_bias_add, is_expert,
               tp_group, stride=1):
        from megatron.core.tensor_parallel.layers import (_initialize_affine_weight_cpu,
                                                          set_tensor_model_parallel_attributes)
        from megatron.core.tensor_parallel.utils import divide
        from megatron.core.utils import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none
        ext = _extension()
        self.config = config
        tp_group = get_tensor_model_parallel_group_if_none(tp_group, is_expert=is_expert)
        self._tp_group = tp_group
        self.tp_size, self.tp_rank = get_pg_size(tp_group), get_pg_rank(tp_group)
        self.parallel_mode = parallel_mode
        self.is_expert = is_expert
        self.expert_parallel = config.expert_model_parallel_size > 1
        # TELinear: experts with TP or EP > 1 communicate in the dispatcher, not in TE
        self.explicit_expert_comm = is_expert and (self.tp_size > 1 or self.expert_parallel)
        self.in_features, self.out_features = input_size, output_size
        self.use_bias = bias
        self.te_return_bias = skip_bias_add and bias
        self.stride = stride
        dim = 0 if parallel_mode == "column" else 1
        out_local = divide(output_size, self.tp_size) if parallel_mode == "column" else output_size
        in_local = divide(input_size, self.tp_size) if parallel_mode == "row" else input_size
        self.weight = Parameter(torch.empty(out_local, in_local, dtype=config.params_dtype))
        init = ext.condition_init_method(config, init_method)
        if config.use_cpu_initialization:
            _initialize_affine_weight_cpu(self.weight, output_size, input_size, out_local if dim == 0 else in_local,
                                          dim, init_method=init, stride=stride, return_master_weight=False,
                                          params_dtype=config.params_dtype, rank=self.tp_rank,
                                          world_size=self.tp_size, skip_set_tensor_parallel_attributes=True)
        else:
            init(self.weight)
        if bias:
            self.bias = Parameter(torch.zeros(out_local if parallel_mode == "column" else output_size,
                                              dtype=config.params_dtype))
        else:
            self.bias = None
        # TE's reset_parameters: TP attributes as TE's set_tensor_model_parallel_attributes puts them
        if not self.explicit_expert_comm:
            set_tensor_model_parallel_attributes(self.weight, True, dim, stride)
            if bias and parallel_mode == "column":
                set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        setattr(self.weight, "partition_stride", stride)
        if is_expert:
            use_expert_pgs = (config.expert_model_parallel_size > 1
                              or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
            ext._set_expert_parameter_attributes(self, parallel_mode, use_expert_pgs)
        else:
            for p in self.parameters():
                p.allreduce = True
            if bias and parallel_mode == "row":
                self.bias.sequence_parallel = config.sequence_parallel

    def _linear(self, x):
        from megatron.core.tensor_parallel import mappings
        comm = self.tp_size > 1 and not self.explicit_expert_comm
        sp = self.config.sequence_parallel
        if self.parallel_mode == "column":
            if comm:
                x = (mappings.gather_from_sequence_parallel_region(x, group=self._tp_group) if sp
                     else mappings.copy_to_tensor_model_parallel_region(x, group=self._tp_group))
            out = F.linear(x, self.weight)
        else:
            out = F.linear(x, self.weight)
            if comm:
                out = (mappings.reduce_scatter_to_sequence_parallel_region(out, group=self._tp_group) if sp
                       else mappings.reduce_from_tensor_model_parallel_region(out, group=self._tp_group))
        if self.bias is None:
            return out, None
        if self.te_return_bias:
            return out, self.bias
        return out + self.bias, None

    def forward(self, x):
        return self._linear(x)

    def _sharded(self, prefix, sharded_offsets, metadata, axis_map):
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, axis_map, sharded_offsets,
                                                   tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}, " \
               f"TP={self.tp_size} (TE stand-in)"


class TEColumnParallelLinear(_TELinearBase):
    """megatron-core's ``TEColumnParallelLinear`` (TE ``Linear``, column mode)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name=None, tp_group=None, stride: int = 1, name=None):
        super().__init__()
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        if skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers do not support skip_weight_param_allocation")
        self._setup(input_size, output_size, "column", config, init_method, bias, skip_bias_add, is_expert,
                    tp_group, stride)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Sharding along axis 0, bias sharded"""
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})


class TERowParallelLinear(_TELinearBase):
    """megatron-core's ``TERowParallelLinear`` (TE ``Linear``, row mode)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name=None,
                 tp_group=None, name=None):
        super().__init__()
        if not input_is_parallel:
            raise ValueError("Transformer Engine linear layers do not support input_is_parallel = False")
        self._setup(input_size, output_size, "row", config, init_method, bias, skip_bias_add, is_expert, tp_group)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Sharding along axis 1, bias not sharded"""
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 1})


class TELayerNormColumnParallelLinear(_TELinearBase):
    """megatron-core's ``TELayerNormColumnParallelLinear`` (TE ``LayerNormLinear``): the norm
    (``layer_norm_weight``, LayerNorm's ``layer_norm_bias``, ``eps = config.layernorm_epsilon``) fused before a
    column-parallel linear."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, gather_output: bool, bias: bool,
                 skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name=None, tp_group=None, stride: int = 1, name=None):
        super().__init__()
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output = True")
        if is_expert:
            raise ValueError("Transformer Engine linear layers do not yet support MoE")
        if skip_weight_param_allocation:
            raise ValueError("Transformer Engine linear layers do not support skip_weight_param_allocation")
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        # TE registers the norm's parameters before the linear's (state-dict order as TE's)
        self.layer_norm_weight = Parameter(torch.full((input_size,), float(not self.zero_centered_gamma),
                                                      dtype=config.params_dtype))
        self.layer_norm_bias = (None if self.normalization == "RMSNorm"
                                else Parameter(torch.zeros(input_size, dtype=config.params_dtype)))
        for p in (self.layer_norm_weight, self.layer_norm_bias):
            if p is not None:
                p.sequence_parallel = config.sequence_parallel
        self._setup(input_size, output_size, "column", config, init_method, bias, skip_bias_add, False, tp_group,
                    stride)

    def forward(self, x):
        x = _norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization == "RMSNorm",
                  self.zero_centered_gamma)
        return self._linear(x)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Sharding along axis 0, bias sharded"""
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})


class TEDotProductAttention(_TEExtraState, CPDotProductAttention):
    """megatron-core's ``TEDotProductAttention``'s constructor, ``_extra_state`` and sharded state dict around
    :class:`CPDotProductAttention`'s causal attention (the math TE's fused attention computes here)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, num_splits=None, cp_comm_type="p2p",
                 pg_collection=None):
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection,
                         k_channels=k_channels, v_channels=v_channels)
        self._tp_group = self.tp_group
        self.num_splits = num_splits

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, num_splits=None):
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Sharded state dict for the learnable softmax offset parameter"""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state_dict = self.state_dict(prefix="", keep_vars=True) if self.config.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])


TE_CLASSES = {"TENorm": TENorm, "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinear,
              "TEColumnParallelLinear": TEColumnParallelLinear, "TERowParallelLinear": TERowParallelLinear,
              "TEDotProductAttention": TEDotProductAttention}
STANDIN_VERSION = "2.20.0"      # the TE source the stand-in follows: every is_te_min_version check passes


@contextlib.contextmanager
def te_standin():
    """Within: megatron-core's TE spec provider, TE specs and experimental hybrid build the stand-in modules,
    the TransformerBlock's final norm is :class:`TENorm`, and the KCP hybrid takes its TE path."""
    from packaging.version import Version

    import megatron.core.extensions.transformer_engine_spec_provider as provider
    import megatron.core.models.gpt.experimental_attention_variant_module_specs as experimental
    import megatron.core.models.gpt.gpt_layer_specs as gpt_specs
    import megatron.core.models.gpt.moe_module_specs as moe_specs
    import megatron.core.transformer.transformer_block as block

    import megatron_kcp.layers.common as kcp_common
    import megatron_kcp.layers.hybrid as hybrid
    ext = _extension()
    patches = [(ext, name, cls) for name, cls in TE_CLASSES.items()]
    patches += [(provider, name, cls) for name, cls in TE_CLASSES.items()]
    patches += [
        # no grouped linear: grouped_mlp_modules builds SequentialMLP with the stand-in linears
        (provider, "TEColumnParallelGroupedLinear", None), (provider, "TERowParallelGroupedLinear", None),
        (provider, "is_te_min_version", lambda version, check_equality=True: Version(STANDIN_VERSION) >= Version(
            version) if check_equality else Version(STANDIN_VERSION) > Version(version)),
        (provider, "get_te_version", lambda: Version(STANDIN_VERSION)),
        (gpt_specs, "TESpecProvider", provider.TESpecProvider), (gpt_specs, "TENorm", TENorm),
        (experimental, "TESpecProvider", provider.TESpecProvider),
        (moe_specs, "TESpecProvider", provider.TESpecProvider),
        (block, "LayerNormImpl", TENorm),
        (hybrid, "te_available", lambda: True), (kcp_common, "te_available", lambda: True),
    ]
    missing = object()
    saved = [(module, name, getattr(module, name, missing)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in reversed(saved):
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


def is_standin(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of the stand-in's TE modules."""
    return isinstance(module, (_TENormModule, _TELinearBase, TEDotProductAttention))
