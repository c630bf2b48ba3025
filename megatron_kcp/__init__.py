"""megatron_kcp: Kimi Context Parallel for Gated DeltaNet and Kimi Delta Attention in Megatron-LM.

``megatron_kcp.ops`` (kernels and autograd functions), ``megatron_kcp.parallel`` (CP plan and
exchange), ``megatron_kcp.layers`` (Megatron mixers), ``megatron_kcp.spec`` (layer specs).
"""

__version__ = "0.1.0"

# the layer specs of megatron_kcp.spec by name: what `--spec megatron_kcp[.spec] NAME` resolves. Listed here,
# where they are known without importing megatron-core (the launcher checks presets against them);
# megatron_kcp.spec defines each of them and checks this list at import.
SPEC_NAMES = ("gdn_hybrid_layer_spec", "kda_hybrid_layer_spec", "default_spec", "cp2hp_gdn_hybrid_layer_spec",
              "cp2hp_kda_hybrid_layer_spec")


def split_spec_name(name: str, where: str) -> tuple[str, str]:
    """``NAME[:OPTIONS]`` as ``(NAME, OPTIONS)``; ValueError starting with ``where`` and naming the known
    specs if NAME is not one of :data:`SPEC_NAMES`. The options are read by
    :func:`megatron_kcp.spec.spec_from_name`."""
    base, _, options = name.partition(":")
    if base not in SPEC_NAMES:
        raise ValueError(f"{where}: unknown spec {base!r}; use one of {', '.join(SPEC_NAMES)}")
    return base, options


def is_spec_name(name: str) -> bool:
    """The names this package's and megatron_kcp.spec's ``__getattr__`` resolve as specs (``*_spec``, or
    with options); other missing attributes are ordinary AttributeErrors."""
    return not name.startswith("_") and (name.endswith("_spec") or ":" in name)


def __getattr__(name):
    """``--spec megatron_kcp NAME[:OPTIONS]`` (and the patch's one-token ``--spec megatron_kcp``): the spec
    of that name (:func:`megatron_kcp.spec.spec_from_name`; ``--spec megatron_kcp.spec`` takes the same
    names), built on first use so that the ops import without building any spec. Cached in the
    module's namespace, where an unpatched Megatron looks it up (``vars(module)[name]``, after the import
    machinery's ``hasattr`` brought it here). An unknown spec name raises ValueError, which stops Megatron
    (it passes over ImportError only)."""
    if is_spec_name(name):
        from megatron_kcp import spec
        globals()[name] = spec.spec_from_name(name)
        return globals()[name]
    raise AttributeError(f"module 'megatron_kcp' has no attribute {name!r}")
