"""Size checks shared by the launcher (preset sizes, before any process starts) and the trainer
(Megatron's arguments, at startup): each raises ValueError naming the fix.

``sizes`` is a mapping with Megatron's argument names (``num_attention_heads``,
``linear_num_key_heads``, ``seq_length``, ...); ``name(key)`` spells a size the way the user wrote
it (a preset key, or a command-line flag such as ``--seq-length``).
"""
from __future__ import annotations

from megatron_kcp.parallel.plan import MAX_HEAD_DIM

__all__ = ["MAX_HEAD_DIM", "check_head_dims", "check_split"]


def check_split(sizes, tp: int, cp: int, sequence_parallel: bool, name=str, tp_flag: str = "--tp") -> None:
    """Heads divisible by TP, value heads a multiple of q/k heads, and a sequence that Megatron's zigzag
    split can cut (2 x CP, times TP under sequence parallelism); ValueError naming the fix otherwise."""
    for key in ("num_attention_heads", "num_query_groups", "linear_num_key_heads", "linear_num_value_heads"):
        if sizes.get(key) is not None and sizes[key] % tp:
            raise ValueError(f"{name(key)} {sizes[key]} is not divisible by {tp_flag} {tp} "
                             "(the CP size needs no such match)")
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise ValueError(f"{name('linear_num_value_heads')} must be a multiple of {name('linear_num_key_heads')}")
    unit = (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)
    if sizes["seq_length"] % unit:
        raise ValueError(f"{name('seq_length')} {sizes['seq_length']} must be a multiple of {unit} (2 x CP for "
                         "Megatron's zigzag split"
                         + (", times TP for sequence parallelism)" if sequence_parallel else ")"))


def check_head_dims(sizes, name=str) -> None:
    """The linear mixers' head dims within the kernels' limit (:data:`MAX_HEAD_DIM`)."""
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        if sizes.get(key) is not None and sizes[key] > MAX_HEAD_DIM:
            raise ValueError(f"{name(key)} {sizes[key]} exceeds the kernels' limit of {MAX_HEAD_DIM}: "
                             f"use a head dim <= {MAX_HEAD_DIM} (more heads for the same width)")
