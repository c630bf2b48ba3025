"""Lets megatron-core modules that assume a GPU be built on the CPU, for tests only.

megatron-core places some parameters with ``device=torch.cuda.current_device()`` and
initialises them under the CUDA RNG tracker; on a CPU-only machine both are redirected to the
CPU (the tracker's fork becomes a no-op, so initialisation draws from torch's CPU generator).
Activation recomputation saves and restores the CPU generator only, and the pipeline schedules'
token counter (``torch.zeros(..., device="cuda")``) and the causal mask of megatron-core's local attention live on
the CPU.
"""
from __future__ import annotations

import contextlib

import torch


class _CPUTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


def enable():
    if torch.cuda.is_available():
        return
    import megatron.core.ssm.gated_delta_net.common as gdn_common
    import megatron.core.tensor_parallel as tp
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None           # dist_checkpointing syncs before writing
    gdn_common.get_cuda_rng_tracker = tp.get_cuda_rng_tracker = lambda *a, **k: _CPUTracker()
    import megatron.training.arguments as arguments
    arguments.get_device_arch_version = lambda: 9            # argument checks ask the GPU generation
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rope
    rope.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank     # Megatron's moves its index to CUDA
    import megatron.core.tensor_parallel.random as tp_random        # recompute: CheckpointFunction, _fork_rng
    tp_random._get_all_rng_states = lambda: (torch.get_rng_state(), None, {})
    tp_random._set_all_rng_states = lambda cpu_state, cuda_state, tracker_states: torch.set_rng_state(cpu_state)
    import megatron.core.pipeline_parallel.schedules as schedules
    schedules.torch = _TorchOnCPU()
    import megatron.core.fusions.fused_softmax as fused_softmax       # megatron-core's local attention (MTP's layer)
    fused_softmax.get_default_causal_mask = _causal_mask


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


class _TorchOnCPU:
    """``torch`` for a module that creates tensors with ``device="cuda"``."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """RoPE table rows of this rank's zigzag shard: chunks r and 2W-1-r of 2W."""
    w, r = cp_group.size(), cp_group.rank()
    chunks = pos_emb.chunk(2 * w, seq_dim)
    return torch.cat([chunks[r], chunks[2 * w - 1 - r]], seq_dim)
