"""The hybrid layer pattern: which layers mix with a linear mixer or softmax attention, and which have an
MoE or a dense MLP (megatron-core's ``hybrid_layer_allocation.py`` and experimental hybrid spec, read from
the same config fields).

* ``config.linear_attention_freq``: N (every Nth layer is softmax attention, the others linear), a 0/1
  list of ``num_layers`` entries (1 = linear), or None (every layer linear).
* ``config.moe_layer_freq`` with ``config.num_moe_experts`` set: N (layers 1, N + 1, 2N + 1, ... are MoE,
  as megatron-core counts), or a 0/1 list (1 = MoE); without experts every MLP is dense.

Layer numbers are 1-based and global (over pipeline stages).
"""
from __future__ import annotations


def linear_pattern(config) -> list[int]:
    """Per layer 1 (linear mixer) or 0 (softmax attention); ValueError naming the fix for a bad value."""
    freq, n = getattr(config, "linear_attention_freq", None), config.num_layers
    if freq is None:
        return [1] * n
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"linear_attention_freq={freq}: use N >= 1 (every Nth layer is softmax attention)")
        return [int(i % freq != 0) for i in range(1, n + 1)]
    pattern = list(freq)
    if len(pattern) != n or set(pattern) - {0, 1}:
        raise ValueError(f"linear_attention_freq pattern {pattern} must hold num_layers={n} "
                         "entries of 1 (linear) or 0 (softmax attention)")
    return pattern


def moe_pattern(config) -> list[int]:
    """Per layer 1 (MoE) or 0 (dense MLP); ValueError naming the fix for a bad ``moe_layer_freq``."""
    n = config.num_layers
    if not getattr(config, "num_moe_experts", None):
        return [0] * n
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"moe_layer_freq={freq}: use N >= 1 (every Nth layer, from the first, is MoE)")
        return [int(i % freq == 0) for i in range(n)]
    pattern = list(freq)
    if len(pattern) != n or set(pattern) - {0, 1}:
        raise ValueError(f"moe_layer_freq pattern {pattern} must hold num_layers={n} entries of 1 (MoE) or 0 (dense)")
    return pattern


def is_linear_layer(config, layer_number: int) -> bool:
    """Layer ``layer_number`` (1-based, global) has a linear mixer."""
    return bool(linear_pattern(config)[layer_number - 1])


def is_moe_layer(config, layer_number: int) -> bool:
    """Layer ``layer_number`` (1-based, global) has an MoE MLP."""
    return bool(moe_pattern(config)[layer_number - 1])


def run_of(config, layer_number: int) -> tuple[int, int]:
    """(first, last) layer numbers of the run of consecutive linear layers holding ``layer_number``."""
    pattern = linear_pattern(config)
    first = last = layer_number
    while first > 1 and pattern[first - 2]:
        first -= 1
    while last < config.num_layers and pattern[last]:
        last += 1
    return first, last
