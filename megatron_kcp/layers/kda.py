"""Kimi Delta Attention mixer with KCP, in megatron-core's style.

Parameter names and math follow fla's ``KimiDeltaAttention`` (Kimi Linear): q/k/v projections
with short convs, a low-rank forget-gate projection ``f_proj`` with per-key-dim ``dt_bias`` and
per-head ``A_log``, ``b_proj`` for beta, a low-rank output gate ``g_proj``, a sigmoid-gated
RMSNorm ``o_norm`` and ``o_proj``; on GPUs the gate and the gated norm are fla's fused kernels, as in
fla's layer. Heads are split over TP; the sequence stays split over CP.
``strategy="cp2hp"`` (``cp2hp_kda_hybrid_layer_spec``) swaps KCP for megatron-core GatedDeltaNet's
all-to-all to head shards around the kernel: the same module as its own cp2hp peer.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint,
                                             sharded_state_dict_default)

from megatron_kcp.environment import check_fla
from megatron_kcp.layers.common import announce, packed_plan
from megatron_kcp.layers.layout import mixer_input
from megatron_kcp.ops import dispatch, kcp
from megatron_kcp.parallel.cp2hp import check_cp2hp
from megatron_kcp.plan import MAX_HEAD_DIM


@dataclass
class KDAConfig(TransformerConfig):
    """TransformerConfig plus the KDA options. Heads and dims come from the ``linear_*`` fields
    (``linear_num_key_heads`` = q/k heads, ``linear_num_value_heads`` = v heads, head dims, conv).
    The options can also come from the layer spec (:func:`megatron_kcp.spec.kda_hybrid_layer_spec_with`),
    which is how they reach the mixer through Megatron-LM's pretrain_gpt.py (a plain TransformerConfig)."""
    kda_gate_rank: int | None = None
    """Rank of the low-rank f_proj / g_proj bottlenecks; None: the value head dim (as fla)."""
    kda_norm_eps: float | None = None
    """Epsilon of the gated output RMSNorm; None: 1e-5 (as fla)."""


# the KDA options, their types and fla's defaults (None: the value head dim)
KDA_OPTIONS = {"kda_gate_rank": (int, None), "kda_norm_eps": (float, 1e-5)}


def kda_options(config, tp_size: int = 1, **given) -> dict:
    """Each KDA option from ``given`` (the spec's params), else from the config's field of that name
    (KDAConfig), else fla's default. ValueError naming the fix for an unknown option, a value that is
    not a positive number, a gate rank the TP size does not divide, or a spec and a config that disagree."""
    unknown = set(given) - set(KDA_OPTIONS)
    if unknown:
        raise ValueError(f"unknown KDA options {sorted(unknown)}: the options are {list(KDA_OPTIONS)}")
    out = {}
    for name, (kind, default) in KDA_OPTIONS.items():
        spec_value, config_value = given.get(name), getattr(config, name, None)
        if spec_value is not None and config_value is not None and spec_value != config_value:
            raise ValueError(f"{name}: the layer spec says {spec_value}, the config {config_value}; set it in one "
                             "place (the --spec name or --" + name.replace("_", "-") + ")")
        value = spec_value if spec_value is not None else config_value
        if value is not None:
            ok = (isinstance(value, int) and not isinstance(value, bool) if kind is int
                  else isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
            if not ok or value <= 0:
                raise ValueError(f"{name}={value!r}: must be a positive {kind.__name__}")
        out[name] = value if value is not None else default
    rank = out["kda_gate_rank"]
    if rank is not None and rank % tp_size:
        raise ValueError(f"kda_gate_rank={rank} must be divisible by the tensor-parallel size {tp_size}: "
                         "set kda_gate_rank to a multiple of it")
    return out


@dataclass
class KDASubmodules:
    column_linear: ModuleSpec | type
    row_linear: ModuleSpec | type


def _check_fla(x: torch.Tensor) -> None:
    """On a GPU, fla-core as pinned, or an error naming the fix before fla is imported (on the CPU the
    fused kernels run only under Triton's interpreter, in tests)."""
    if x.is_cuda:
        check_fla(x.device)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
    """The forget gate ``-exp(A_log) * softplus(f + dt_bias)`` in fp32: fla's fused kernel (one pass each
    way, the parameters' gradients reduced in it) where ``fused`` (default: on GPUs), else eagerly.

    Args:
        f: ``[..., HV, K]``, the second low-rank factor's output.
        A_log: ``[HV]``. dt_bias: ``[HV * K]``, head-major.
    Returns:
        ``[..., HV, K]`` fp32, the log decay per key dim.
    """
    if f.is_cuda if fused is None else fused:
        _check_fla(f)
        from fla.ops.kda.gate import fused_kda_gate
        return fused_kda_gate(f, A_log, dt_bias)
    return -A_log.exp()[:, None] * F.softplus(f.float() + dt_bias.view(f.shape[-2:]))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   fused: bool | None = None) -> torch.Tensor:
    """``rmsnorm(x) * weight * sigmoid(gate)`` over the last dim, in fp32, ``x``'s dtype out: fla's fused
    kernel (``rms_norm_gated``, one pass each way) where ``fused`` (default: on GPUs), else eagerly.

    Args:
        x, gate: ``[..., V]``. weight: ``[V]``.
    Returns:
        ``[..., V]``.
    """
    if x.is_cuda if fused is None else fused:
        _check_fla(x)
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        return rms_norm_gated(x, gate, weight, None, activation="sigmoid", eps=eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.sigmoid(gate.float())).to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    """fla's ``FusedRMSNormGated`` with sigmoid (:func:`gated_rms_norm`), its ``weight`` named as fla's."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x, gate):
        return gated_rms_norm(x, gate, self.weight, self.eps)


class KCPKimiDeltaAttention(MegatronModule):
    def __init__(self, config: TransformerConfig, submodules: KDASubmodules, layer_number: int = 1,
                 pg_collection=None, kda_gate_rank: int | None = None, kda_norm_eps: float | None = None,
                 strategy: str = "auto", **kwargs):
        super().__init__(config)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.layer_number, self.pg_collection = layer_number, pg_collection
        tp = pg_collection.tp.size()
        self.H, self.HV = config.linear_num_key_heads, config.linear_num_value_heads
        self.K, self.V = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_size = config.linear_conv_kernel_dim
        for what, n in (("linear_num_key_heads", self.H), ("linear_num_value_heads", self.HV)):
            if n % tp:
                raise ValueError(f"{what}={n} must be divisible by the tensor-parallel size {tp}: "
                                 "change the head count or --tensor-model-parallel-size")
        if self.HV % self.H:
            raise ValueError(f"linear_num_value_heads={self.HV} must be a multiple of linear_num_key_heads={self.H}")
        if max(self.K, self.V) > MAX_HEAD_DIM:
            raise ValueError(f"KDA head dims (K={self.K}, V={self.V}) must be <= {MAX_HEAD_DIM}: "
                             "use more heads of a smaller head dim")
        if "exchange" in kwargs:          # Megatron's build kwargs pass through **kwargs: a stale name must not vanish
            raise TypeError("KCPKimiDeltaAttention takes strategy=, not exchange=: rename it (e.g. strategy='cp2hp')")
        if strategy not in dispatch.strategy_names():
            raise ValueError(f"strategy={strategy!r}: use one of {dispatch.strategy_names()}")
        if strategy == "fla-cp":
            raise ValueError("strategy='fla-cp' is the op's (fla's own CP call, on the contiguous layout), and the "
                             "mixer's layout follows the cost model: use strategy='auto', which runs it after the "
                             "conversion where a rank's step is host-bound (or call "
                             "kcp.gated_delta_rule with it on a contiguous plan)")
        if strategy == "cp2hp" and pg_collection.cp.size() > 1:
            check_cp2hp(self.H // tp, self.HV // tp, pg_collection.cp.size())
        self.strategy = strategy
        self.any_layout = strategy != "cp2hp"     # cp2hp's all-to-all expects Megatron's layout
        self.options = kda_options(config, tp, kda_gate_rank=kda_gate_rank, kda_norm_eps=kda_norm_eps)
        rank, eps = self.options["kda_gate_rank"] or self.V, self.options["kda_norm_eps"]
        self.gate_rank = rank
        if rank % tp:
            raise ValueError(f"kda_gate_rank={rank} (the value head dim) must be divisible by the tensor-parallel "
                             f"size {tp}: set kda_gate_rank to a multiple of it")
        self.h_loc, self.hv_loc = self.H // tp, self.HV // tp

        # the second low-rank factors read the gathered rank-r activations, whose sequence is
        # already whole under sequence parallelism: they must not gather it again
        whole_seq = copy.copy(config)
        whole_seq.sequence_parallel = False

        def col(name, n_in, n_out, gather=False, bias=False, cfg=config):
            # TE's linears refuse gather_output: the gathered low-rank factors are megatron-core's local linear
            # (the same checkpoint entries) on every backend
            linear = ColumnParallelLinear if gather else submodules.column_linear
            return build_module(linear, n_in, n_out, config=cfg, init_method=config.init_method,
                                gather_output=gather, bias=bias, skip_bias_add=False, is_expert=False,
                                tp_comm_buffer_name=name, tp_group=pg_collection.tp)

        hid = config.hidden_size
        self.q_proj = col("q_proj", hid, self.H * self.K)
        self.k_proj = col("k_proj", hid, self.H * self.K)
        self.v_proj = col("v_proj", hid, self.HV * self.V)
        dev = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        for name, dim in (("q_conv1d", self.h_loc * self.K), ("k_conv1d", self.h_loc * self.K),
                          ("v_conv1d", self.hv_loc * self.V)):
            conv = torch.nn.Conv1d(dim, dim, self.conv_size, groups=dim, bias=False, device=dev,
                                   dtype=config.params_dtype)
            conv.weight.tensor_model_parallel, conv.weight.partition_dim = True, 0
            setattr(self, name, conv)
        # low-rank bottlenecks: the rank-r activations are gathered, so the second factor sees all of them
        self.f_proj = torch.nn.Sequential(col("f_proj0", hid, rank, gather=True),
                                          col("f_proj1", rank, self.HV * self.K, cfg=whole_seq))
        self.b_proj = col("b_proj", hid, self.HV)
        self.g_proj = torch.nn.Sequential(col("g_proj0", hid, rank, gather=True),
                                          col("g_proj1", rank, self.HV * self.V, bias=True, cfg=whole_seq))
        self.A_log = torch.nn.Parameter(torch.empty(self.hv_loc, device=dev, dtype=torch.float32))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.hv_loc * self.K, device=dev, dtype=torch.float32))
        for p in (self.A_log, self.dt_bias):
            p.tensor_model_parallel, p.partition_dim, p._no_weight_decay = True, 0, True
        self.o_norm = GatedRMSNorm(self.V, eps, dtype=config.params_dtype, device=dev)
        self.o_proj = build_module(submodules.row_linear, self.HV * self.V, hid, config=config,
                                   init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                   skip_bias_add=True, is_expert=False, tp_comm_buffer_name="o_proj",
                                   tp_group=pg_collection.tp)
        self.reset_kda_parameters()

    @torch.no_grad()
    def reset_kda_parameters(self):
        """fla's initialisation: A ~ U(1, 16) in log space, dt ~ logU(1e-3, 1e-1) through inverse softplus.
        Drawn from Megatron's model-parallel stream, as its linears are: the default CUDA generator is
        advanced at startup by a CP-dependent amount, and the weights must not depend on the CP size."""
        with tensor_parallel.get_cuda_rng_tracker().fork():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)
            dt = dt.exp().clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
                torch.nn.init.kaiming_uniform_(conv.weight, a=math.sqrt(5))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Megatron's default would save the tensors of plain torch modules (the short convs, the
        low-rank ``Sequential`` pairs) and our own parameters as replicated: A_log, dt_bias and the
        conv weights are split over TP by heads (dim 0), and the pairs hold Megatron linears."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp = self.pg_collection.tp
        by_heads = {n: p for n, p in self.named_parameters() if n in ("A_log", "dt_bias") or "_conv1d." in n}
        sd = make_sharded_tensors_for_checkpoint(by_heads, prefix, dict.fromkeys(by_heads, 0), sharded_offsets,
                                                 tp_group=tp, dp_cp_group=metadata["dp_cp_group"])
        for name, child in self.named_children():
            if name.endswith("_conv1d"):
                continue
            parts = child.named_children() if isinstance(child, torch.nn.Sequential) else [("", child)]
            for sub, m in parts:
                sd.update(sharded_state_dict_default(m, f"{prefix}{name}.{sub + '.' if sub else ''}",
                                                     sharded_offsets, metadata, tp_group=tp))
        return sd

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None, **kwargs):
        if inference_context is not None:
            raise NotImplementedError("KCPKimiDeltaAttention is a training module; inference is not supported")
        hidden_states, batch, restore = mixer_input(self, hidden_states, packed_seq_params)
        q, k, v, f_low, b, g_low = (m(hidden_states)[0] for m in (
            self.q_proj, self.k_proj, self.v_proj, self.f_proj[0], self.b_proj, self.g_proj[0]))
        s, bsz = q.shape[:2]
        cp_group = self.pg_collection.cp
        plan = packed_plan(batch, s, bsz, self.conv_size, cp_group)
        T = bsz * s

        def stream(x):                       # [s, b, d] -> the packed local stream [1, b*s, d]
            return x.transpose(0, 1).reshape(1, T, -1)

        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)      # their halos in one exchange
        q, k, v = kcp.causal_conv1ds([stream(x) for x in (q, k, v)], [c.weight.squeeze(1) for c in convs],
                                     activation="silu", plan=plan, group=cp_group)
        f = stream(self.f_proj[1](f_low)[0]).view(1, T, self.hv_loc, self.K)
        g = kda_gate(f, self.A_log, self.dt_bias)
        beta = stream(b).sigmoid()
        q, k, v = q.view(1, T, self.h_loc, self.K), k.view(1, T, self.h_loc, self.K), v.view(1, T, self.hv_loc, self.V)
        announce(self, plan, batch, q, v, g, self.pg_collection.tp.size(), self.strategy,
                 kda_gate_rank=self.gate_rank, kda_norm_eps=self.o_norm.eps)
        o = kcp.gated_delta_rule(q, k, v, g, beta, plan, cp_group, use_qk_l2norm=True, strategy=self.strategy)
        gate = stream(self.g_proj[1](g_low)[0]).view(1, T, self.hv_loc, self.V)
        o = self.o_norm(o, gate).reshape(bsz, s, -1).transpose(0, 1).contiguous()
        out, bias = self.o_proj(o)
        return restore(out), bias
