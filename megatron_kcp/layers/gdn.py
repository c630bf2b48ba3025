"""Gated DeltaNet mixer with KCP: megatron-core's ``GatedDeltaNet`` without the all-to-all.

Subclassing keeps parameters, names, shapes, initialisation and ``sharded_state_dict``
identical to megatron-core 0.19's module, so checkpoints move freely between the two. What
changes is the forward: every CP rank keeps its sequence shard and all of its TP heads (the
parent's head math runs with ``cp_size = 1``), the short conv takes its halo from earlier ranks
and the gated delta rule exchanges affine state maps (``megatron_kcp.ops.kcp``). CP size is
therefore not bounded by the head count.
"""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.jit import jit_fuser
from megatron.core.ssm.gated_delta_net import GatedDeltaNet

from megatron_kcp.layers.common import announce, packed_plan
from megatron_kcp.layers.layout import mixer_input
from megatron_kcp.ops import kcp
from megatron_kcp.kernels import reference
from megatron_kcp.plan import MAX_HEAD_DIM


def split_heads(qkv: torch.Tensor, sizes: list[int], head_dims: list[int], qk_l2norm: bool):
    """q, k, v of the conv's output ``[1, T, x]`` as ``[1, T, heads, dim]``, q and k l2-normalised where
    ``qk_l2norm`` (as megatron-core's GatedDeltaNet does before its kernel call); v a view."""
    q, k, v = (x.reshape(*x.shape[:2], -1, d) for x, d in zip(torch.split(qkv, sizes, dim=-1), head_dims))
    if not qk_l2norm:
        return q, k, v
    return reference.l2norm(q.float()).to(q.dtype), reference.l2norm(k.float()).to(k.dtype), v     # fp32 math


@jit_fuser
def split_heads_contiguous(qkv: torch.Tensor, sizes: list[int], head_dims: list[int], qk_l2norm: bool):
    """``split_heads`` made contiguous, as the kernels take them, in one fused kernel with the norms (its
    backward one more) instead of three strided copies, a concatenation and the norms' own launches."""
    return tuple(x.contiguous() for x in split_heads(qkv, sizes, head_dims, qk_l2norm))


class KCPGatedDeltaNet(GatedDeltaNet):
    """``GatedDeltaNet`` with Kimi Context Parallel; same constructor and checkpoint format.

    ``cp_size`` keeps megatron-core's meaning, the factor its all-to-all to head shards divides a rank's heads
    by (``feat_dim_split``, the conv's groups): 1 here, every rank keeps all of its TP heads. The CP size and
    group are ``pg_collection.cp`` (the plan's ``world_size``), as megatron-core's modules read them.
    """

    any_layout = True     # runs in the layout its hidden states come in (megatron_kcp.layers.layout)

    def _setup_variant_attrs(self):
        self.cp_size = 1      # heads stay whole on every CP rank: the parent's head math must not divide by CP
        for name, dim in (("linear_key_head_dim", self.key_head_dim), ("linear_value_head_dim", self.value_head_dim)):
            if dim > MAX_HEAD_DIM:
                raise ValueError(f"{name}={dim}: the chunked kernels support head dims up to {MAX_HEAD_DIM}; "
                                 "use more heads of a smaller head dim")
        for name, n in (("linear_num_key_heads", self.num_key_heads), ("linear_num_value_heads", self.num_value_heads)):
            if n % self.tp_size:
                raise ValueError(f"{name}={n} is not divisible by the tensor-parallel size {self.tp_size}: "
                                 "change the head count or --tensor-model-parallel-size (CP size needs no such match)")
        super()._setup_variant_attrs()

    def reset_parameters(self):
        super().reset_parameters()
        if self.config.perform_initialization and self.conv_init is None:
            # the parent leaves conv1d to nn.Conv1d's init, drawn from the default CUDA generator, which
            # Megatron's startup (fusion warm-up on [seq / CP, ...] random tensors) advances by a CP-dependent
            # amount: the same distribution, redrawn from the model-parallel stream, is the same at every CP size
            with tensor_parallel.get_cuda_rng_tracker().fork():
                self.conv1d.reset_parameters()

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                sequence_len_offset=None, *, inference_params=None, **kwargs):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("KCPGatedDeltaNet is a training module; inference is not supported")
        hidden_states, batch, restore = mixer_input(self, hidden_states, packed_seq_params)
        qkvzba, _ = self.in_proj(hidden_states)                    # [s, b, x], sequence gathered over TP
        s, b, _ = qkvzba.shape
        plan = packed_plan(batch, s, b, self.conv_kernel_dim, self.pg_collection.cp)
        # [s, b, x] -> one packed local stream [1, b*s, x]: rows become documents
        qkvzba = qkvzba.transpose(0, 1).reshape(1, b * s, -1)
        qkv, gate, beta, alpha = torch.split(qkvzba, self.feat_dim_split, dim=-1)
        gate = gate.reshape(1, b * s, -1, self.value_head_dim)
        qkv = kcp.causal_conv1d(qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias if self.conv_bias else None,
                                self.activation, plan=plan, group=self.pg_collection.cp)
        # on GPUs torch.compile fusions: q/k/v made contiguous with q's and k's norms, the parent's decay and
        # gated norm (one kernel each, not ~8 eager ones over [T, H, 128] fp32); on the CPU the same math
        # eagerly (inductor needs a compiler)
        fused = qkvzba.is_cuda
        sizes = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        dims = [self.key_head_dim, self.key_head_dim, self.value_head_dim]
        q, k, v = (split_heads_contiguous if fused else split_heads)(qkv, sizes, dims, self.use_qk_l2norm)
        if fused:
            g, beta = self._compute_g_and_beta(self.A_log, self.dt_bias, alpha, beta)
        else:
            g = -self.A_log.float().exp() * torch.nn.functional.softplus(alpha.float() + self.dt_bias.float())
            beta = beta.sigmoid()
        announce(self, plan, batch, q, v, g, self.tp_size)
        # grouped heads: kernels map value head i to q/k head i // (HV / H), as repeat_interleave does
        o = kcp.gated_delta_rule(q, k, v, g, beta, plan, self.pg_collection.cp)      # q and k normalised above
        if fused:
            o = self._apply_gated_norm(o, gate)
        else:
            gate = gate.reshape(-1, self.value_head_dim).float()
            o = self.out_norm(o.reshape(-1, self.value_head_dim)) * self.act_fn(gate)
        o = o.to(qkv.dtype).reshape(b, s, -1).transpose(0, 1).contiguous()
        out, bias = self.out_proj(o)
        return restore(out), bias
