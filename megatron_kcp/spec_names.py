"""The layer specs' names, known without importing megatron-core: what ``--spec megatron_kcp[.spec] NAME``
resolves (the launcher checks presets against them; ``megatron_kcp.spec`` defines each and checks this list)."""
from __future__ import annotations

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
