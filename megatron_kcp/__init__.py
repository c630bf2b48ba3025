"""megatron_kcp: Kimi Context Parallel for Gated DeltaNet and Kimi Delta Attention in Megatron-LM.

From the bottom up: ``megatron_kcp.kernels`` (the local cores and convs), ``megatron_kcp.parallel`` (the CP
exchange and its cost model), ``megatron_kcp.ops`` (the public op and its dispatch), ``megatron_kcp.layers``
(Megatron mixers and the hybrid layer), ``megatron_kcp.spec`` (layer specs), the trainer, the launcher and
``megatron_kcp.convert`` (Hugging Face checkpoints); ``plan``, ``calibration`` and ``environment`` are read by all.
"""

__version__ = "0.1.0"

from megatron_kcp.spec_names import SPEC_NAMES, is_spec_name, split_spec_name  # noqa: F401


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
