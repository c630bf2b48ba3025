"""megatron_kcp: Kimi Context Parallel for Gated DeltaNet and Kimi Delta Attention in Megatron-LM.

``megatron_kcp.ops`` (kernels and autograd functions), ``megatron_kcp.parallel`` (CP plan and
exchange), ``megatron_kcp.layers`` (Megatron mixers), ``megatron_kcp.spec`` (layer specs).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # `--spec megatron_kcp` (patched Megatron) asks the package for its specs; import them lazily
    # so that the ops stay importable without building any spec
    if name in ("default_spec", "gdn_hybrid_layer_spec", "kda_hybrid_layer_spec"):
        from megatron_kcp import spec
        return getattr(spec, name)
    raise AttributeError(f"module 'megatron_kcp' has no attribute {name!r}")
