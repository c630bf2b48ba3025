"""One hybrid layer's submodules, built from the config by megatron-core's own builders.

Megatron's ``--spec MODULE NAME`` hands over a spec before the config exists, so the hybrid specs carry
only what megatron-core cannot build, the linear mixer (:class:`HybridLayerSubmodules`), and each
:class:`~megatron_kcp.layers.transformer_layer.KCPTransformerLayer` builds the rest for its layer number
with :func:`layer_submodules`, as megatron-core's experimental hybrid
(``get_transformer_layer_with_experimental_attention_variant_spec``) does for the same config:

* the mixer: the linear mixer, or softmax attention as megatron-core builds it for the config (output gate,
  QK norm, GQA, MLA), per :func:`~megatron_kcp.layers.pattern.linear_pattern`;
* the MLP: dense or MoE (routed and shared experts, router options, grouped GEMM with TE), per
  :func:`~megatron_kcp.layers.pattern.moe_pattern`;
* the norms: with TE fused into the next linear where megatron-core fuses them; without TE separate
  modules whose checkpoint keys are the fused ones (``sharded_state_dict_keys_map``, as megatron-core's
  local GPT spec maps them), so that a checkpoint is one format with and without TE, and megatron-core's
  own hybrid's.

Three swaps keep attention right where megatron-core's is not: ``SelfAttention`` becomes
:class:`~megatron_kcp.layers.attention.KCPSelfAttention` (RoPE on a pack cut as one stream),
``MLASelfAttention`` :class:`~megatron_kcp.layers.attention.KCPMLASelfAttention` (``--no-rope-freq``, NoPE
layers), and without TE the core attention becomes
:class:`~megatron_kcp.layers.attention.CPDotProductAttention` (megatron-core's local one refuses CP > 1).
Without TE a zero-centred norm (``--apply-layernorm-1p``) is
:class:`~megatron_kcp.layers.norm.ZeroCenteredRMSNorm`, which megatron-core's local norm refuses.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from megatron_kcp.environment import te_available
from megatron_kcp.layers.attention import CPDotProductAttention, KCPMLASelfAttention, KCPSelfAttention
from megatron_kcp.layers.norm import SeparateNorm, ZeroCenteredRMSNorm
from megatron_kcp.layers.pattern import is_linear_layer, is_moe_layer


class LinearMixerBuilder(Protocol):
    """The linear mixer's spec for a config and backend; ``metainfo["fuse_input_layernorm"]`` says whether
    its input projection holds the layer's input norm (TE's fused norm and linear)."""

    def __call__(self, config, backend: BackendSpecProvider) -> ModuleSpec: ...


@dataclasses.dataclass
class HybridLayerSubmodules:
    """What a hybrid layer spec carries before the config is known."""

    linear_mixer: LinearMixerBuilder


def backend_provider() -> BackendSpecProvider:
    """TransformerEngine's spec provider when TE imports, megatron-core's local one otherwise."""
    if te_available():
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        return TESpecProvider()
    return LocalSpecProvider()


def check_config(config) -> None:
    """ValueError naming the fix for a config the hybrid specs cannot build as asked."""
    variant = config.experimental_attention_variant
    if variant not in (None, "gated_delta_net"):
        raise ValueError(f"--experimental-attention-variant {variant}: the megatron_kcp specs build GDN or KDA "
                         "hybrids (the spec name picks the mixer); drop the flag")
    if config.transformer_impl == "inference_optimized" or config.use_kitchen:
        raise ValueError("--transformer-impl inference_optimized / --use-kitchen: the megatron_kcp specs build "
                         "TransformerEngine or local layers; use --transformer-impl transformer_engine or local")
    if config.num_moe_experts and config.moe_grouped_gemm and not te_available():
        raise ValueError("--moe-grouped-gemm needs TransformerEngine (megatron-core's local experts are a "
                         "SequentialMLP): install TE or drop --moe-grouped-gemm")
    if config.mtp_num_layers and config.context_parallel_size > 1 and not te_available():
        raise ValueError("--mtp-num-layers at --context-parallel-size > 1 needs TransformerEngine: Megatron builds "
                         "the MTP layer from megatron-core's own GPT spec, whose local attention refuses CP > 1; "
                         "install TE, or train MTP at --context-parallel-size 1")
    if config.mtp_num_layers and config.layernorm_zero_centered_gamma and not te_available():
        raise ValueError("--mtp-num-layers with --apply-layernorm-1p needs TransformerEngine: Megatron builds the MTP "
                         "layer from megatron-core's own local spec, whose norm refuses a zero-centred gamma; install "
                         "TE, or drop one of the two")
    if (config.recompute_granularity == "selective" and "layernorm" in (config.recompute_modules or ())
            and not te_available()):
        # megatron-core 0.19's CheckpointWithoutOutput() reads TE's FP8 state (NameError without TE)
        raise ValueError("--recompute-modules layernorm needs TransformerEngine in megatron-core 0.19: drop "
                         "layernorm from --recompute-modules (core_attn and mlp work) or install TE")


def attention_spec(config, backend: BackendSpecProvider) -> ModuleSpec:
    """Softmax attention as megatron-core builds it for ``config`` (output gate, QK norm, GQA, MLA), with
    :class:`KCPSelfAttention` for ``SelfAttention``, :class:`KCPMLASelfAttention` (NoPE layers) for
    ``MLASelfAttention`` and, without TE, :class:`CPDotProductAttention`."""
    if isinstance(backend, LocalSpecProvider):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
        spec = get_gpt_layer_local_submodules(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization, qk_l2_norm=config.qk_l2_norm).self_attention
        spec.metainfo["fuse_input_layernorm"] = False
        if config.multi_latent_attention and config.q_lora_rank is None:   # no q down projection, no q norm (as TE)
            spec.submodules.q_layernorm = IdentityOp
    else:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            _get_self_attention_module_spec)
        spec = _get_self_attention_module_spec(config, backend)
    submodules = spec.submodules
    if submodules.core_attention is DotProductAttention:
        submodules = dataclasses.replace(submodules, core_attention=CPDotProductAttention)
    module = {SelfAttention: KCPSelfAttention, MLASelfAttention: KCPMLASelfAttention}.get(spec.module, spec.module)
    return dataclasses.replace(spec, module=module, submodules=submodules)


def mlp_spec(config, backend: BackendSpecProvider, moe: bool):
    """(the MLP's builder, whether it holds the pre-MLP norm): megatron-core's dense MLP or MoE layer."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (_get_dense_mlp_module_spec,
                                                                                      _get_moe_module_spec)
    return (_get_moe_module_spec if moe else _get_dense_mlp_module_spec)(config, backend)


def _fused_norm_keys(spec: ModuleSpec) -> dict[str, str]:
    """Where megatron-core's TE hybrid keeps this mixer's norms: the key prefixes of the linears they fuse into."""
    if spec.module.__name__ in ("GatedDeltaNet", "KCPGatedDeltaNet"):
        return {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    if issubclass(spec.module, SelfAttention):
        return {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if issubclass(spec.module, MLASelfAttention):
        return {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
    return {}


def _with_local_norms(spec, config):
    """``spec`` with megatron-core's local norm replaced by :class:`ZeroCenteredRMSNorm` everywhere in it."""
    if spec is WrappedTorchNorm:
        return ZeroCenteredRMSNorm
    if isinstance(spec, ModuleSpec) or dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _with_local_norms(getattr(spec, f.name), config) for f in dataclasses.fields(spec)
                   if f.name in ("submodules", "module") or not isinstance(spec, ModuleSpec)}
        return dataclasses.replace(spec, **changes)
    return spec


def layer_submodules(config, layer_number: int, hybrid: HybridLayerSubmodules,
                     backend: BackendSpecProvider | None = None) -> TransformerLayerSubmodules:
    """The ``TransformerLayerSubmodules`` of layer ``layer_number`` (1-based, global) for ``config``."""
    check_config(config)
    backend = backend or backend_provider()
    local = isinstance(backend, LocalSpecProvider)
    mixer = (hybrid.linear_mixer(config, backend) if is_linear_layer(config, layer_number)
             else attention_spec(config, backend))
    moe = is_moe_layer(config, layer_number)
    mlp, mlp_holds_norm = mlp_spec(config, backend, moe)
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    mixer_holds_norm = mixer.metainfo.get("fuse_input_layernorm", False)
    keys = {}
    if local:       # the checkpoint keys of TE's fused norms (megatron-core's TE hybrid fuses the same ones)
        keys.update(_fused_norm_keys(mixer))
        if not moe:
            keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    submodules = TransformerLayerSubmodules(
        input_layernorm=IdentityOp if mixer_holds_norm else norm, self_attention=mixer,
        self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=IdentityOp if mlp_holds_norm else norm,
        mlp=mlp, mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys)
    if local and config.layernorm_zero_centered_gamma:
        submodules = _with_local_norms(submodules, config)
    return _with_separate_norms(submodules) if local else submodules


def _with_separate_norms(sub: TransformerLayerSubmodules) -> TransformerLayerSubmodules:
    """The local norms that megatron-core's TE hybrid keeps as modules of their own (no fused key in the
    map) as :class:`SeparateNorm`, which writes TE's empty ``_extra_state``."""
    local_norms = (WrappedTorchNorm, ZeroCenteredRMSNorm)
    keys = sub.sharded_state_dict_keys_map
    changes = {name: SeparateNorm for name in ("input_layernorm", "pre_mlp_layernorm")
               if f"{name}." not in keys and getattr(sub, name) in local_norms}
    mixer = sub.self_attention
    inner = {name: SeparateNorm for name in ("out_norm", "q_layernorm", "k_layernorm", "kv_layernorm")
             if getattr(mixer.submodules, name, None) in local_norms and f"self_attention.{name}." not in keys}
    if inner:
        changes["self_attention"] = dataclasses.replace(mixer, submodules=dataclasses.replace(mixer.submodules,
                                                                                              **inner))
    return dataclasses.replace(sub, **changes)
