"""Megatron layer specs with KCP mixers: ``pretrain_gpt.py --spec megatron_kcp <name>``.

``--spec megatron_kcp NAME`` and ``--spec megatron_kcp.spec NAME`` accept the same names: one of
:data:`SPEC_NAMES`, and for the KDA hybrid ``NAME:OPTION=VALUE,...`` (:func:`spec_from_name`, e.g.
``kda_hybrid_layer_spec:kda_gate_rank=64,kda_norm_eps=1e-6``), built on first use by the modules'
``__getattr__``.

Megatron's ``--spec MODULE NAME`` imports ``NAME`` from ``MODULE`` before the config exists, so the
specs here are config-independent: every layer is one ``KCPTransformerLayer`` (Megatron's
``TransformerLayer``, converting the layout around runs of linear layers) whose mixer,
:class:`HybridMixer`, becomes the linear mixer or softmax attention at construction, from
``config.linear_attention_freq`` (N: every Nth layer is attention; or a 0/1 list, 1 = linear) and
the global layer number. TransformerEngine modules are used when importable, Megatron's local
ones otherwise, except that softmax attention's core is then
:class:`megatron_kcp.layers.attention.CPDotProductAttention` (Megatron's local ``DotProductAttention``
refuses CP > 1).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_kcp import SPEC_NAMES, is_spec_name, split_spec_name
from megatron_kcp.environment import te_available
from megatron_kcp.layers.batch import megatron_route
from megatron_kcp.wheel import skip_make_of_prebuilt_dataset_helpers

# Megatron's --spec import passes over an ImportError (it logs it and trains its default GPT): what this
# module needs and does not find is a RuntimeError, which stops the run
NEEDS = "megatron_kcp needs megatron-core 0.19.x and its own dependencies (pip install -e <megatron_kcp checkout>)"
try:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
except ImportError as e:
    raise RuntimeError(f"megatron_kcp.spec: {e}; {NEEDS}") from e

skip_make_of_prebuilt_dataset_helpers()     # pretrain_gpt.py next to the megatron-core wheel (megatron_kcp/wheel.py)


def backend_provider():
    """TransformerEngine's spec provider when TE imports, Megatron's local one otherwise."""
    if te_available():
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
        return TESpecProvider()
    from megatron.core.models.backends import LocalSpecProvider
    return LocalSpecProvider()


def is_linear_layer(config, layer_number: int) -> bool:
    """Layer ``layer_number`` (1-based, global) is a linear mixer under ``config.linear_attention_freq``."""
    freq = getattr(config, "linear_attention_freq", None)
    if freq is None:
        return True
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"linear_attention_freq={freq}: use N >= 1 (every Nth layer is softmax attention)")
        return layer_number % freq != 0
    pattern = list(freq)
    if len(pattern) != config.num_layers or set(pattern) - {0, 1}:
        raise ValueError(f"linear_attention_freq pattern {pattern} must hold num_layers={config.num_layers} "
                         "entries of 1 (linear) or 0 (softmax attention)")
    return bool(pattern[layer_number - 1])


@dataclass
class HybridMixerSubmodules:
    linear: ModuleSpec
    attention: ModuleSpec


class HybridMixer(MegatronModule):
    """Builds the linear mixer or softmax attention for this layer (see module docstring)."""

    def __new__(cls, config, submodules: HybridMixerSubmodules, layer_number: int = 1, **kwargs):
        if (config.recompute_granularity == "selective" and "layernorm" in (config.recompute_modules or ())
                and not te_available()):
            # megatron-core 0.19's CheckpointWithoutOutput() reads TE's FP8 state (NameError without TE)
            raise ValueError("--recompute-modules layernorm needs TransformerEngine in megatron-core 0.19: drop "
                             "layernorm from --recompute-modules (core_attn and mlp work) or install TE")
        spec = submodules.linear if is_linear_layer(config, layer_number) else submodules.attention
        mixer = build_module(spec, config=config, layer_number=layer_number, **kwargs)
        if config.context_parallel_size > 1 and megatron_route() == "zigzag":      # before the first step
            from megatron_kcp.layers.layout import check_whole_stream
            check_whole_stream(mixer, layer_number)
        return mixer


def gdn_mixer_spec(backend=None, module=None) -> ModuleSpec:
    """The KCP GDN mixer, or ``module`` (megatron-core's cp2hp ``GatedDeltaNet``) with the same submodules."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules

    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    backend = backend or backend_provider()
    return ModuleSpec(module=module or KCPGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=backend.column_parallel_linear(), out_norm=backend.layer_norm(rms_norm=True, for_qk=False),
        out_proj=backend.row_parallel_linear()))


def kda_mixer_spec(backend=None, **options) -> ModuleSpec:
    """The KCP KDA mixer; ``options`` (``kda_gate_rank``, ``kda_norm_eps``, ``strategy``) go to its constructor."""
    from megatron_kcp.layers.kda import KCPKimiDeltaAttention, KDASubmodules
    backend = backend or backend_provider()
    return ModuleSpec(module=KCPKimiDeltaAttention, params=options, submodules=KDASubmodules(
        column_linear=backend.column_parallel_linear(), row_linear=backend.row_parallel_linear()))


def attention_spec(backend=None) -> ModuleSpec:
    from megatron.core.models.backends import LocalSpecProvider
    backend = backend or backend_provider()
    core_attention = backend.core_attention()
    from megatron_kcp.layers.attention import CPDotProductAttention, KCPSelfAttention
    if isinstance(backend, LocalSpecProvider):      # Megatron's local DotProductAttention refuses CP > 1
        core_attention = CPDotProductAttention
    # SelfAttention, with RoPE right on a pack cut as one stream (--dataloader-inter-document-masking)
    return ModuleSpec(module=KCPSelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(
                          linear_qkv=backend.column_parallel_linear(), core_attention=core_attention,
                          linear_proj=backend.row_parallel_linear()))


def hybrid_layer_spec(linear: ModuleSpec, backend=None) -> ModuleSpec:
    """A pre-norm TransformerLayer whose mixer is ``linear`` or attention per ``linear_attention_freq``;
    a run of linear layers runs in the contiguous layout where that pays (``layers/layout.py``)."""
    backend = backend or backend_provider()
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    from megatron_kcp.layers.layout import KCPTransformerLayer
    return ModuleSpec(module=KCPTransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm,
        self_attention=ModuleSpec(module=HybridMixer, submodules=HybridMixerSubmodules(
            linear=linear, attention=attention_spec(backend))),
        self_attn_bda=_bda(),
        pre_mlp_layernorm=norm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear())),
        mlp_bda=_bda()))


def _bda():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    return get_bias_dropout_add


def kda_hybrid_layer_spec_with(**options) -> ModuleSpec:
    """The KDA hybrid with KDA options (``kda_gate_rank``, ``kda_norm_eps``) carried by the spec, so that they
    reach the mixer where the config has no KDA fields (Megatron-LM's pretrain_gpt.py). Bad options
    raise ValueError here; the mixer checks them again against the TP size and the config."""
    from megatron_kcp.layers.kda import kda_options
    kda_options(None, **options)
    return hybrid_layer_spec(kda_mixer_spec(**options))


def spec_from_name(name: str, where: str | None = None) -> ModuleSpec:
    """``NAME`` or ``NAME:option=value,...``, as ``--spec megatron_kcp[.spec] <name>`` gives it, e.g.
    ``kda_hybrid_layer_spec:kda_gate_rank=64,kda_norm_eps=1e-5``. A name with options is built once and
    kept in this module's namespace (the same object through either module path). ValueError naming the
    fix otherwise, its message starting with ``where`` (default ``--spec megatron_kcp NAME``)."""
    from megatron_kcp.layers.kda import KDA_OPTIONS
    where = where or f"--spec megatron_kcp {name}"
    base, text = split_spec_name(name, where)
    if not text:
        return globals()[base]
    if base != "kda_hybrid_layer_spec":
        raise ValueError(f"{where}: {base} takes no options; options "
                         f"({', '.join(KDA_OPTIONS)}) go with kda_hybrid_layer_spec")
    if name in globals():
        return globals()[name]
    options = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if key not in KDA_OPTIONS or not eq:
            raise ValueError(f"{where}: {item!r} is not OPTION=VALUE with OPTION one of {', '.join(KDA_OPTIONS)}")
        kind = KDA_OPTIONS[key][0]
        try:
            options[key] = kind(value)
        except ValueError:
            raise ValueError(f"{where}: {key}={value!r} is not a {kind.__name__}") from None
    try:
        built = kda_hybrid_layer_spec_with(**options)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    globals()[name] = built
    return built


def __getattr__(name):
    """``--spec megatron_kcp.spec NAME[:OPTIONS]``: the spec of that name (:func:`spec_from_name`), as
    ``--spec megatron_kcp NAME[:OPTIONS]`` gives it. An unknown spec name raises ValueError, which stops
    Megatron (its ``import_module`` passes over ImportError only)."""
    if is_spec_name(name):
        return spec_from_name(name, where=f"--spec megatron_kcp.spec {name}")
    raise AttributeError(f"module 'megatron_kcp.spec' has no attribute {name!r}")


# Megatron's unpatched import_module runs ``__import__(module, fromlist=[NAME])`` and then reads
# ``vars(module)[NAME]``. The import machinery asks ``hasattr(module, NAME)``, and so runs __getattr__
# above, which keeps the spec in this namespace, only for a package: an empty __path__ makes this module
# one for that lookup (it has no submodules).
__path__: list[str] = []


# what `--spec megatron_kcp.spec <name>` imports (and, with patches/, the one-token `--spec megatron_kcp`)
try:
    gdn_hybrid_layer_spec = hybrid_layer_spec(gdn_mixer_spec())
    kda_hybrid_layer_spec = hybrid_layer_spec(kda_mixer_spec())     # softmax layers: Megatron attention, not MLA
    default_spec = gdn_hybrid_layer_spec
    # the same hybrid with megatron-core's own GatedDeltaNet (all-to-all to head shards): the peer that
    # benchmarks and long-context runs compare against
    cp2hp_gdn_hybrid_layer_spec = hybrid_layer_spec(gdn_mixer_spec(module=GatedDeltaNet))
    # megatron-core has no KDA module: the KDA peer is our mixer with that all-to-all around its kernel
    cp2hp_kda_hybrid_layer_spec = hybrid_layer_spec(kda_mixer_spec(strategy="cp2hp"))
except ImportError as e:      # the mixers' modules (see NEEDS above)
    raise RuntimeError(f"megatron_kcp.spec: {e}; {NEEDS}") from e

# every spec above, by name (megatron_kcp.SPEC_NAMES): what --spec megatron_kcp[.spec] NAME resolves
# (spec_from_name adds options)
_defined = tuple(name for name, value in list(globals().items()) if isinstance(value, ModuleSpec))
if sorted(_defined) != sorted(SPEC_NAMES):
    raise RuntimeError(f"megatron_kcp.spec defines the specs {_defined}, megatron_kcp.SPEC_NAMES lists {SPEC_NAMES}: "
                       "list every spec there")
