"""Whether TransformerEngine serves Megatron's TE modules here, and what Megatron needs without it.

Megatron's defaults assume TE (and apex) kernels: without them ``pretrain_gpt.py`` stops at startup
(RoPE fusion, persistent layer norm) or at the first linear (gradient accumulation fusion) unless
these flags turn them off. Apart from spec.py so that the launcher need not build the specs.
"""
from __future__ import annotations

NO_TE_ARGS = (("--transformer-impl", "local"), ("--no-rope-fusion",), ("--no-gradient-accumulation-fusion",),
              ("--no-persist-layer-norm",))


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider  # noqa: F401
        return True
    except ImportError:
        return False


def no_te_args(argv) -> list[str]:
    """The flags of :data:`NO_TE_ARGS` that ``argv`` does not set itself; none when TE is available."""
    if te_available():
        return []
    return [x for flag in NO_TE_ARGS if flag[0] not in argv for x in flag]
