"""Tiny random Hugging Face checkpoints of the converter's families and their fp32 reference forward (CPU).

``save_tiny(family, dir, dtype)`` writes a checkpoint of one of :data:`FAMILIES` (built with transformers,
random weights, no hub access); :func:`reference_logits` runs transformers' own model on it in fp32 on the
CPU. Transformers binds fla's and causal_conv1d's kernels wherever they import, and those need a GPU:
its model modules are therefore imported with both packages hidden (:func:`pure_torch_modeling`), which
selects its pure-PyTorch paths, and ``sys.modules`` is restored afterwards, so the rest of the process
still sees fla. The sizes make every layout mistake visible: >= 4 layers with both mixer kinds, GQA, and
head counts and head dims that differ (attention heads != KV heads != linear key heads != value heads).
"""
from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys

import torch

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear")
HIDDEN = ("fla", "causal_conv1d")
VOCAB = 96
# written as transformers holds them in memory (experts.gate_up_proj, experts.down_proj: the Qwen3.6 layout), not
# expert by expert as save_pretrained writes them, so that the converter's packed-expert mapping is tested too
PACKED_ON_DISK = ("qwen3_5_moe",)

# transformers' config and model class names, and the modeling module, per family
_CLASSES = {
    "qwen3_next": ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "kimi_linear": ("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM"),
}

_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=10,
            linear_conv_kernel_dim=4)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, max_position_embeddings=128, rms_norm_eps=1e-6,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


def tiny_config_kwargs(family: str) -> dict:
    """The constructor arguments of ``family``'s tiny config.

    Args:
        family: one of :data:`FAMILIES`.

    Returns:
        A dict for the transformers config class of the family.
    """
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if family == "qwen3_next":
        return {**_COMMON, **_ATTN, **_GDN, **_MOE, "intermediate_size": 40, "mlp_only_layers": [0],
                "decoder_sparse_step": 1, "norm_topk_prob": True, "tie_word_embeddings": False,
                "rope_parameters": {**rope, "partial_rotary_factor": 0.5}}
    if family == "qwen3_5":
        return {**_COMMON, **_ATTN, **_GDN, "intermediate_size": 40, "tie_word_embeddings": True,
                "rope_parameters": rope}
    if family == "qwen3_5_moe":
        return {**_COMMON, **_ATTN, **_GDN, **_MOE, "tie_word_embeddings": False, "rope_parameters": rope}
    if family == "kimi_linear":
        return {**_COMMON, "rms_norm_eps": 1e-5, "num_attention_heads": 4, "num_key_value_heads": 4,
                "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
                "v_head_dim": 6, "linear_num_heads": 2, "linear_head_dim": 8, "linear_conv_kernel_dim": 4,
                "intermediate_size": 40, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
                "n_shared_experts": 1, "routed_scaling_factor": 2.446, "n_group": 1, "topk_group": 1,
                "norm_topk_prob": True, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
                "tie_word_embeddings": False, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2}
    raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")


@contextlib.contextmanager
def pure_torch_modeling(*packages: str):
    """Within: ``packages`` (default fla and causal_conv1d) cannot be imported, and transformers' model modules
    imported here are fresh ones, bound to their pure-PyTorch paths. On exit the ``sys.modules`` entries of
    the hidden packages and of transformers are as before (the fresh modules are dropped from it; objects
    taken from them keep working)."""
    packages = packages or HIDDEN
    hidden = tuple(p for p in packages)
    fresh = "transformers.models."
    before = dict(sys.modules)
    for name in list(sys.modules):
        if name.split(".")[0] in hidden or name.startswith(fresh):
            del sys.modules[name]
    for p in hidden:
        sys.modules[p] = None
    try:
        yield
    finally:        # drop what was imported within from the hidden packages and transformers, restore the rest
        for name in list(sys.modules):
            if name.split(".")[0] in (*hidden, "transformers") and name not in before:
                del sys.modules[name]
        sys.modules.update({k: v for k, v in before.items() if k.split(".")[0] in (*hidden, "transformers")})


def hf_classes(family: str, pure_torch: bool = True):
    """(config class, model class) of ``family``; with ``pure_torch`` from a modeling module imported
    under :func:`pure_torch_modeling`."""
    module, config_name, model_name = _CLASSES[family]
    ctx = pure_torch_modeling() if pure_torch else contextlib.nullcontext()
    with ctx:
        configuration = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(configuration, config_name), getattr(modeling, model_name)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights that exercise every mapping: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms
    that scale by ``1 + w`` get ``w ~ 0.1 N(0, 1)``, norms that scale by ``w`` get ``1 + 0.1 N(0, 1)``
    (inside [0.5, 2], where the converter's ``w - 1`` is exact), decays and biases their usual ranges."""
    g = torch.Generator().manual_seed(seed)

    def normal(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("A_log"):
            new = torch.rand(t.shape, generator=g).mul(15).add(1).log()
        elif leaf == "dt_bias":
            new = normal(t.shape, 0.5)
        elif "e_score_correction_bias" in name:
            new = normal(t.shape, 0.1)
        elif "norm" in name and t.dim() == 1:
            if torch.count_nonzero(t) == 0:          # transformers initialises the (1 + w) norms to 0
                new = normal(t.shape, 0.1)
            else:
                new = normal(t.shape, 0.1, 1.0).clamp(0.55, 1.9)
        elif "embed_tokens" in name:
            new = normal(t.shape)
        elif t.dim() >= 2:
            new = normal(t.shape, 1 / math.sqrt(t.shape[-1]))
        else:
            new = normal(t.shape, 0.1)
        t.copy_(new.to(t.dtype))


def tiny_model(family: str, seed: int = 0, pure_torch: bool = True):
    """The tiny transformers model of ``family`` with random weights (fp32, eager attention, eval mode)."""
    config_cls, model_cls = hf_classes(family, pure_torch)
    config = config_cls(**tiny_config_kwargs(family))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def save_tiny(family: str, directory, dtype: torch.dtype = torch.float32, seed: int = 0) -> str:
    """Write ``family``'s tiny random checkpoint (config.json + model.safetensors) to ``directory``.

    Args:
        family: one of :data:`FAMILIES`.
        directory: where to write (created).
        dtype: the weights' dtype on disk.
        seed: the weights' seed.

    Returns:
        ``directory`` as a string.
    """
    directory = os.fspath(directory)
    # built from transformers' regular modules: save_pretrained then writes the checkpoint format (Moonshot's names
    # for Kimi Linear) deterministically (it skips that for classes of modules it does not know as its own)
    model = tiny_model(family, seed, pure_torch=False)
    model.to(dtype)
    if family in PACKED_ON_DISK:
        from safetensors.torch import save_file
        model.config.save_pretrained(directory)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(directory)
    return directory


@torch.no_grad()
def reference_logits(family: str, tokens: torch.Tensor, seed: int = 0, dtype: torch.dtype = torch.float32):
    """transformers' fp32 logits for ``tokens`` ([batch, seq]) of the checkpoint :func:`save_tiny` writes for
    ``family``, ``seed`` and ``dtype`` (its weights rounded to ``dtype``), on the CPU with the pure-PyTorch
    linear-attention paths and eager attention.

    The model is rebuilt in memory rather than loaded from the directory: transformers 5.24 writes Kimi
    Linear in Moonshot's names (q/k/v_conv1d, f_a_proj, block_sparse_moe.experts.{e}.w1 ...) and Qwen3.5-MoE
    expert by expert, but does not load either back (it leaves those weights newly initialised)."""
    model = tiny_model(family, seed)
    model.to(dtype).float()
    return model(input_ids=tokens, use_cache=False).logits.float()
