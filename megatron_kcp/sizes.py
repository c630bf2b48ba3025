"""Size checks shared by the launcher (preset sizes, before any process starts) and the trainer
(Megatron's arguments, at startup): each raises ValueError naming the fix.

``sizes`` is a mapping with Megatron's argument names (``num_attention_heads``,
``linear_num_key_heads``, ``seq_length``, ...); ``name(key)`` spells a size the way the user wrote
it (a preset key, or a command-line flag such as ``--seq-length``).
"""
from __future__ import annotations

from megatron_kcp.plan import MAX_HEAD_DIM

__all__ = ["MAX_HEAD_DIM", "check_head_dims", "check_moe_split", "check_split", "divisors"]


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


def divisors(n: int, up_to: int = 64) -> list[int]:
    """The divisors of ``n`` up to ``up_to`` (the sizes a parallel dimension may take), for the fixes named."""
    return [d for d in range(1, min(n, up_to) + 1) if n % d == 0]


def check_moe_split(sizes, tp: int, ep: int, etp: int | None = None, name=str, tp_flag: str = "--tp",
                    ep_flag: str = "--ep", etp_flag: str = "--etp") -> None:
    """The MoE sizes against TP, EP and the expert TP size (``etp``; megatron-core's default: TP): EP
    divides ``num_experts``; the expert TP size divides each routed expert's FFN (``moe_ffn_hidden_size``,
    Megatron's ``ffn_hidden_size`` where unset), TP the shared expert's; EP > 1 needs experts. ValueError
    naming the fix otherwise. The world-size rule (EP x ETP x PP divides it) is the launcher's."""
    experts = sizes.get("num_experts")
    if not experts:
        if ep > 1:
            raise ValueError(f"{ep_flag} {ep} needs a mixture-of-experts model ({name('num_experts')} is not set): "
                             f"use {ep_flag} 1, or a MoE preset")
        if etp is not None and etp != tp:
            raise ValueError(f"{etp_flag} {etp} needs a mixture-of-experts model ({name('num_experts')} is not set): "
                             f"drop {etp_flag}")
        return
    if experts % ep:
        raise ValueError(f"{name('num_experts')} {experts} is not divisible by {ep_flag} {ep}: use an EP that divides "
                         f"it ({', '.join(map(str, divisors(experts)))})")
    etp, etp_named = (tp, tp_flag) if etp is None else (etp, etp_flag)
    routed = "moe_ffn_hidden_size" if sizes.get("moe_ffn_hidden_size") is not None else "ffn_hidden_size"
    for key, size, flag in ((routed, etp, etp_named), ("moe_shared_expert_intermediate_size", tp, tp_flag)):
        value = sizes.get(key)
        if value is not None and value % size:
            raise ValueError(f"{name(key)} {value} is not divisible by {flag} {size} (each expert's FFN is split "
                             f"over it): use {flag} in {', '.join(map(str, divisors(value)))}"
                             + (", or --etp 1 (experts whole on each rank, TP for the rest)"
                                if flag == tp_flag and key == routed else ""))
