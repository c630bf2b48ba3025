"""Megatron layer specs with KCP mixers: ``pretrain_gpt.py --spec megatron_kcp <name>``.

``--spec megatron_kcp NAME`` and ``--spec megatron_kcp.spec NAME`` accept the same names: one of
:data:`SPEC_NAMES`, and for the KDA hybrid ``NAME:OPTION=VALUE,...`` (:func:`spec_from_name`, e.g.
``kda_hybrid_layer_spec:kda_gate_rank=64,kda_norm_eps=1e-6``), built on first use by the modules'
``__getattr__``.

Megatron's ``--spec MODULE NAME`` imports ``NAME`` from ``MODULE`` before the config exists, so a spec here
names only the linear mixer; each layer
(:class:`~megatron_kcp.layers.transformer_layer.KCPTransformerLayer`) builds everything else for its
layer number with megatron-core's own builders, as its experimental hybrid does for the same config
(:mod:`megatron_kcp.layers.hybrid`): the layer pattern (``linear_attention_freq``, ``moe_layer_freq``,
:mod:`megatron_kcp.layers.pattern`), attention as the config has it (output gate, QK norm, partial RoPE,
GQA, MLA), dense MLPs or MoE, TransformerEngine modules where TE imports and megatron-core's local
ones otherwise. The model's shape comes from Megatron's flags.
"""
from __future__ import annotations

import dataclasses
import functools

from megatron_kcp.spec_names import SPEC_NAMES, is_spec_name, split_spec_name
from megatron_kcp.environment import te_available
from megatron_kcp.wheel import skip_make_of_prebuilt_dataset_helpers

# Megatron's --spec import passes over an ImportError (it logs it and trains its default GPT): what this
# module needs and does not find is a RuntimeError, which stops the run
NEEDS = "megatron_kcp needs megatron-core 0.19.x and its own dependencies (pip install -e <megatron_kcp checkout>)"
try:
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_kcp.layers import gdn, kda  # noqa: F401  (the mixers' modules: a missing dependency stops here)
    from megatron_kcp.layers.hybrid import HybridLayerSubmodules
    from megatron_kcp.layers.norm import use_local_final_norm
    from megatron_kcp.layers.transformer_layer import KCPTransformerLayer
except ImportError as e:
    raise RuntimeError(f"megatron_kcp.spec: {e}; {NEEDS}") from e

skip_make_of_prebuilt_dataset_helpers()     # pretrain_gpt.py next to the megatron-core wheel (megatron_kcp/wheel.py)
if not te_available():
    use_local_final_norm()                  # the final norm of a zero-centred model (--apply-layernorm-1p)


def gdn_mixer_spec(config, backend, module=None) -> ModuleSpec:
    """The KCP GDN mixer, or ``module`` (megatron-core's cp2hp ``GatedDeltaNet``), as megatron-core's hybrid
    builds its GatedDeltaNet: with TE the input norm fused into ``in_proj``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_gated_delta_net_module_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules

    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    module = module or KCPGatedDeltaNet
    if not isinstance(backend, LocalSpecProvider):
        return dataclasses.replace(get_gated_delta_net_module_spec(config, backend), module=module)
    return ModuleSpec(module=module, metainfo={"fuse_input_layernorm": False}, submodules=GatedDeltaNetSubmodules(
        in_proj=backend.column_parallel_linear(),
        out_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
        out_proj=backend.row_parallel_linear()))


def kda_mixer_spec(config, backend, **options) -> ModuleSpec:
    """The KCP KDA mixer; ``options`` (``kda_gate_rank``, ``kda_norm_eps``, ``strategy``) go to its constructor."""
    from megatron_kcp.layers.kda import KCPKimiDeltaAttention, KDASubmodules
    return ModuleSpec(module=KCPKimiDeltaAttention, params=options, metainfo={"fuse_input_layernorm": False},
                      submodules=KDASubmodules(column_linear=backend.column_parallel_linear(),
                                               row_linear=backend.row_parallel_linear()))


def hybrid_layer_spec(linear_mixer) -> ModuleSpec:
    """The hybrid layer whose linear mixer is ``linear_mixer(config, backend)`` (a
    :class:`~megatron_kcp.layers.hybrid.LinearMixerBuilder`); every other submodule is megatron-core's for the
    config (:mod:`megatron_kcp.layers.hybrid`)."""
    return ModuleSpec(module=KCPTransformerLayer, submodules=HybridLayerSubmodules(linear_mixer=linear_mixer))


def kda_hybrid_layer_spec_with(**options) -> ModuleSpec:
    """The KDA hybrid with KDA options (``kda_gate_rank``, ``kda_norm_eps``) carried by the spec, so that they
    reach the mixer where the config has no KDA fields (Megatron-LM's pretrain_gpt.py). Bad options
    raise ValueError here; the mixer checks them again against the TP size and the config."""
    from megatron_kcp.layers.kda import kda_options
    kda_options(None, **options)
    return hybrid_layer_spec(functools.partial(kda_mixer_spec, **options))


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
gdn_hybrid_layer_spec = hybrid_layer_spec(gdn_mixer_spec)
kda_hybrid_layer_spec = hybrid_layer_spec(kda_mixer_spec)
default_spec = gdn_hybrid_layer_spec
# the same hybrid with megatron-core's own GatedDeltaNet (all-to-all to head shards): the peer that
# benchmarks and long-context runs compare against
cp2hp_gdn_hybrid_layer_spec = hybrid_layer_spec(functools.partial(gdn_mixer_spec, module=GatedDeltaNet))
# megatron-core has no KDA module: the KDA peer is our mixer with that all-to-all around its kernel
cp2hp_kda_hybrid_layer_spec = hybrid_layer_spec(functools.partial(kda_mixer_spec, strategy="cp2hp"))

# every spec above, by name (megatron_kcp.SPEC_NAMES): what --spec megatron_kcp[.spec] NAME resolves
# (spec_from_name adds options)
_defined = tuple(name for name, value in list(globals().items()) if isinstance(value, ModuleSpec))
if sorted(_defined) != sorted(SPEC_NAMES):
    raise RuntimeError(f"megatron_kcp.spec defines the specs {_defined}, megatron_kcp.SPEC_NAMES lists {SPEC_NAMES}: "
                       "list every spec there")
