"""The family registry: one :class:`Family` subclass per Hugging Face model family, registered with
:func:`register` and found by the checkpoint's ``model_type`` (or, failing that, its ``architectures``).

A family turns the HF ``config.json`` (a dict) into the Megatron model (:class:`ModelSpec`: the
TransformerConfig fields, the GPTModel arguments, the layer spec's name and the Megatron-LM flags that
build the same model) and the list of :class:`~megatron_kcp.convert.rules.Rule` between the two state dicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_kcp.convert.rules import ConvertError, Rule

FAMILIES: dict[str, type["Family"]] = {}


def register(cls: type["Family"]) -> type["Family"]:
    """Class decorator: make ``cls`` the family of its ``model_types`` and ``architectures``."""
    for key in (*cls.model_types, *cls.architectures):
        if key in FAMILIES:
            raise RuntimeError(f"{key} is registered twice ({FAMILIES[key].__name__}, {cls.__name__})")
        FAMILIES[key] = cls
    return cls


def supported() -> str:
    """The registered model types, for error messages."""
    return ", ".join(sorted({t for cls in set(FAMILIES.values()) for t in cls.model_types}))


def family_for(hf_config: dict) -> "Family":
    """The family instance for an HF config dict.

    Args:
        hf_config: the parsed ``config.json``.

    Returns:
        The registered :class:`Family` built on that config.

    Raises:
        ConvertError: the model type and architectures are none of the registered ones.
    """
    keys = [hf_config.get("model_type"), *(hf_config.get("architectures") or [])]
    for key in keys:
        if key in FAMILIES:
            return FAMILIES[key](hf_config)
    raise ConvertError(f"unknown architecture: model_type={hf_config.get('model_type')!r}, architectures="
                       f"{hf_config.get('architectures')}; supported model types: {supported()}")


@dataclass
class ModelSpec:
    """What builds the Megatron model of a family.

    Args:
        spec: the layer spec's name in ``megatron_kcp.spec`` (with options, as ``--spec megatron_kcp NAME``).
        config: TransformerConfig fields.
        gpt: GPTModel keyword arguments (vocab size, RoPE, tied embeddings ...).
        flags: the Megatron-LM command-line flags that build this model.
        config_class: "kda", "mla" or "kda_mla" for megatron_kcp's KDAConfig / megatron-core's
            MLATransformerConfig; "" for TransformerConfig.
    """

    spec: str
    config: dict
    gpt: dict
    flags: list[str] = field(default_factory=list)
    config_class: str = ""


class Family:
    """One HF model family. Subclasses set ``model_types``, ``architectures`` and implement
    :meth:`model_spec` and :meth:`rules`; ``self.cfg`` is the HF config dict."""

    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    # HF tensors that are not part of the model and may be dropped with a flag: prefix -> flag name
    droppable: dict[str, str] = {}

    def __init__(self, hf_config: dict):
        self.cfg = hf_config

    @property
    def name(self) -> str:
        return self.model_types[0]

    def get(self, key: str, default=None):
        return self.cfg.get(key, default)

    def need(self, key: str):
        """A config field the conversion needs; ConvertError naming it when absent."""
        if self.cfg.get(key) is None:
            raise ConvertError(f"config.json of {self.name} has no {key!r}, which the conversion needs")
        return self.cfg[key]

    def refuse(self, field_name: str, value, why: str):
        raise ConvertError(f"config field {field_name}={value!r} of {self.name} cannot be honoured: {why}")

    def model_spec(self, options: dict) -> ModelSpec:
        raise NotImplementedError

    def rules(self, options: dict) -> list[Rule]:
        raise NotImplementedError
