"""megatron_kcp: Kimi Context Parallel for Gated DeltaNet and Kimi Delta Attention in Megatron-LM.

``megatron_kcp.ops`` (kernels and autograd functions), ``megatron_kcp.parallel`` (CP plan and
exchange), ``megatron_kcp.layers`` (Megatron mixers), ``megatron_kcp.spec`` (layer specs).
"""

__version__ = "0.1.0"


def __getattr__(name):
    """``--spec megatron_kcp NAME[:OPTIONS]`` (and the patch's one-token ``--spec megatron_kcp``): the spec
    of that name, built on first use so that the ops import without building any spec. Cached in the
    module's namespace, where an unpatched Megatron looks it up (``vars(module)[name]``, after the import
    machinery's ``hasattr`` brought it here). An unknown spec name raises ValueError, which stops Megatron
    (it passes over ImportError only)."""
    if not name.startswith("_") and (name.endswith("_spec") or ":" in name):
        from megatron_kcp import spec
        globals()[name] = spec.spec_from_name(name)
        return globals()[name]
    raise AttributeError(f"module 'megatron_kcp' has no attribute {name!r}")
