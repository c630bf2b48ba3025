"""Megatron-core's local RMSNorm with the option its ``WrappedTorchNorm`` refuses: a zero-centred gamma.

``--apply-layernorm-1p`` (``config.layernorm_zero_centered_gamma``, Qwen3-Next's and Qwen3.5's norms) scales
by ``1 + w`` with ``w`` initialised to zero, as TransformerEngine's ``TENorm`` does; without TE megatron-core
has no such norm. Same parameter name (``weight``) and checkpoint format as the TE norm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``y = x / rms(x) * (1 + weight)``, computed in fp32.

    Args:
        config: the TransformerConfig (``sequence_parallel`` marks the weight for Megatron's gradient
            all-reduce over TP, as its own norms do).
        hidden_size: the normalised (last) dimension.
        eps: added to the mean square.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"--apply-layernorm-1p without TransformerEngine: the local zero-centred norm is an "
                             f"RMSNorm, the config asks for {config.normalization}; use --normalization RMSNorm")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), x.shape[-1:], self.weight.float() + 1, self.eps)
        return y.to(x.dtype)


class LocalNorm:
    """megatron-core's local norm (``WrappedTorchNorm``), or :class:`ZeroCenteredRMSNorm` where the config asks
    for a zero-centred gamma, which ``WrappedTorchNorm`` refuses. Same constructor."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.layernorm_zero_centered_gamma:
            return ZeroCenteredRMSNorm(config, hidden_size, eps)
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        return WrappedTorchNorm(config, hidden_size, eps, **kwargs)


class TEExtraState:
    """TE's norms' checkpoint entry: an empty uint8 ``_extra_state`` (TE's ``BasicOperation.get_extra_state``
    without FP8), which megatron-core's TE hybrid writes for every norm it keeps as a module of its own."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is not None and not (isinstance(state, torch.Tensor) and state.numel() == 0):
            raise ValueError("a norm's _extra_state holds FP8 metadata: load this checkpoint with TransformerEngine")


class _SeparateRMSNorm(TEExtraState, torch.nn.RMSNorm):
    pass


class _SeparateLayerNorm(TEExtraState, torch.nn.LayerNorm):
    pass


class _SeparateZeroCenteredRMSNorm(TEExtraState, ZeroCenteredRMSNorm):
    pass


class SeparateNorm:
    """:class:`LocalNorm` where megatron-core's TE hybrid keeps a ``TENorm`` of its own (the final norm, GDN's
    out_norm, q/k norms, an MoE layer's pre-MLP norm, a KDA or MLA layer's input norm): the same module and
    parameters plus TE's empty ``_extra_state``, so that a local checkpoint holds every entry a TE build reads.
    (A norm fused into the next linear under TE must not have one: its keys are the linear's.)"""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        if config.layernorm_zero_centered_gamma:
            return _SeparateZeroCenteredRMSNorm(config, hidden_size, eps)
        norm = LocalNorm(config, hidden_size, eps)      # megatron-core's checks, then the same class with the entry
        separate = {torch.nn.RMSNorm: _SeparateRMSNorm, torch.nn.LayerNorm: _SeparateLayerNorm}.get(type(norm))
        if separate is None:
            raise ValueError(f"normalization {config.normalization!r}: the local specs take RMSNorm or LayerNorm")
        return separate(hidden_size, eps=eps)


def use_local_final_norm() -> None:
    """Without TE and apex, megatron-core's TransformerBlock builds its final norm as ``WrappedTorchNorm``
    (``transformer_block.LayerNormImpl``), which refuses a zero-centred gamma: make it :class:`SeparateNorm`,
    which builds the same norm for every other config, with TE's checkpoint entry."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    if transformer_block.LayerNormImpl is WrappedTorchNorm:
        transformer_block.LayerNormImpl = SeparateNorm
