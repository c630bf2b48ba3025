"""Qwen3.5 dense and MoE language models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, and the text part
of the ``...ForConditionalGeneration`` checkpoints).

As Qwen3-Next (:mod:`megatron_kcp.convert.qwen3_next`), except that the GDN input projection is stored as four
section-major tensors (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), every layer of the MoE
model is MoE, and the dense model has no MoE. A composite (vision-language) checkpoint keeps its language
model under ``model.language_model.`` and its config under ``text_config``; its vision tower
(``model.visual.``) is left out with ``--drop-vision``.
"""
from __future__ import annotations

from megatron_kcp.convert.base import register
from megatron_kcp.convert.qwen3_next import Qwen3Next


@register
class Qwen35(Qwen3Next):
    model_types = ("qwen3_5_text",)
    architectures = ("Qwen3_5ForCausalLM",)
    fused_in_proj = False

    def moe_layers(self) -> list[bool]:
        return [False] * self.text()["num_hidden_layers"]


@register
class Qwen35Moe(Qwen3Next):
    model_types = ("qwen3_5_moe_text",)
    architectures = ("Qwen3_5MoeForCausalLM",)
    fused_in_proj = False

    def moe_layers(self) -> list[bool]:
        return [True] * self.text()["num_hidden_layers"]


class _Composite:
    """The language model of a vision-language checkpoint."""

    prefix = "model.language_model."
    droppable = {"mtp.": "--drop-mtp", "model.visual.": "--drop-vision"}

    def text(self) -> dict:
        return {"tie_word_embeddings": self.cfg.get("tie_word_embeddings", False), **self.need("text_config")}


@register
class Qwen35Composite(_Composite, Qwen35):
    model_types = ("qwen3_5",)
    architectures = ("Qwen3_5ForConditionalGeneration",)


@register
class Qwen35MoeComposite(_Composite, Qwen35Moe):
    model_types = ("qwen3_5_moe",)
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
