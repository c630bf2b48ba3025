"""KCP on CUDA through fla-core's Triton kernels and its own CP ops (``fla.ops.cp``).

fla's CP context expresses two of Megatron's layouts directly: ``contiguous`` and ``zigzag``
(the stream cut in 2W chunks, rank r holding r and 2W-1-r). Megatron's ``zigzag_per_doc``
(each document cut in 2W chunks) is, document by document, exactly fla's ``zigzag`` of a
one-sequence stream, so it runs as one fla CP call per document on that document's two local
pieces: no tokens move between ranks and fla's kernels and exchange do all the work. The price
is one launch set and one small all-gather per document, not yet measured (BENCHMARKS.md, Open).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megatron_kcp.parallel.plan import KCPPlan

FLA_VERSION = "0.6.0"


def check_fla_environment(device: torch.device | None = None) -> None:
    """Fail early, with the fix, where fla would fail late or compute wrong numbers."""
    try:
        import fla
        import triton
    except ImportError as e:
        raise RuntimeError(f"the CUDA path of megatron_kcp needs fla-core=={FLA_VERSION} and triton: "
                           f"pip install fla-core=={FLA_VERSION} ({e})") from e
    if getattr(fla, "__version__", None) != FLA_VERSION:
        raise RuntimeError(f"megatron_kcp is built and tested against fla-core {FLA_VERSION}, found "
                           f"{getattr(fla, '__version__', 'unknown')}: pip install fla-core=={FLA_VERSION}")
    if not torch.cuda.is_available():
        raise RuntimeError("fla's kernels need a CUDA GPU; on CPU use backend='reference'")
    idx = (device or torch.device("cuda")).index
    major, minor = torch.cuda.get_device_capability(idx if idx is not None else torch.cuda.current_device())
    if major < 8:
        raise RuntimeError(f"fla's CP kernels need an Ampere or newer GPU (compute capability >= 8.0), this one "
                           f"is {major}.{minor}: use backend='reference' (slow) or another GPU")
    from packaging.version import Version
    tv = Version(triton.__version__.split("+")[0])
    if major == 9 and Version("3.4.0") <= tv < Version("3.7.1"):
        try:
            import tilelang  # noqa: F401
        except ImportError:
            raise RuntimeError(f"Triton {tv} on Hopper computes gated GDN backward wrongly and fla 0.6.0 then refuses "
                               "it: pip install tilelang (fla dispatches that kernel to it) or triton>=3.7.1") from None


@dataclass(frozen=True)
class _Part:
    """One fla CP call: local tokens [start, end) and its fla context."""
    start: int
    end: int
    context: object


@functools.lru_cache(maxsize=32)
def _fla_parts(plan: KCPPlan, group, device_index: int) -> tuple[_Part, ...]:
    from fla.ops.cp import build_cp_context
    device = torch.device("cuda", device_index)
    if plan.layout == "zigzag_per_doc":
        seqs = []
        off = 0
        for (s0, e0), (s1, e1) in zip(plan.pieces[0::2], plan.pieces[1::2]):
            n = (e0 - s0) * 2 * plan.world_size
            seqs.append((off, off + (e0 - s0) + (e1 - s1), torch.tensor([0, n]), "zigzag"))
            off += (e0 - s0) + (e1 - s1)
    else:
        seqs = [(0, plan.num_local_tokens, torch.tensor(plan.global_cu_seqlens), plan.layout)]
    parts = []
    for a, b, cu, layout in seqs:
        ctx = build_cp_context(cu.to(device), group=group, conv1d_kernel_size=plan.conv_kernel_size,
                               cu_seqlens_cpu=cu, layout=layout)
        parts.append(_Part(a, b, ctx))
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def _checked(device_index: int) -> int:
    check_fla_environment(torch.device("cuda", device_index))
    return device_index


def _parts(plan, group, x):
    idx = _checked(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return _fla_parts(plan, group, idx)


def gated_delta_rule(q, k, v, g, beta, plan: KCPPlan, group, scale, initial_state, use_qk_l2norm):
    if initial_state is not None:
        raise ValueError("fla's CP path takes no initial_state (each global sequence starts from zero): "
                         "drop it, or use backend='reference'")
    if plan.world_size == 1:
        return _call(q, k, v, g, beta, scale, use_qk_l2norm, cu_seqlens=plan.cu_seqlens_tensor(q.device),
                     cu_seqlens_cpu=plan.cu_seqlens_tensor())
    outs = [_call(*(x[:, p.start:p.end] for x in (q, k, v, g, beta)), scale, use_qk_l2norm, cp_context=p.context)
            for p in _parts(plan, group, q)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def _call(q, k, v, g, beta, scale, l2, **kw):
    if g.dim() == 4:
        from fla.ops.kda import chunk_kda
        o, _ = chunk_kda(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=l2, **kw)
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=l2, **kw)
    return o


def causal_conv1d(x, weight, bias, activation, plan: KCPPlan, group):
    # piece lengths are equal on all ranks in every layout, so every rank takes the same branch
    if any(e - s < plan.halo_len for s, e in plan.pieces) and plan.world_size > 1:
        # fla's conv CP takes its halo from the neighbouring rank only; shorter pieces need
        # tokens from several ranks, which the generic halo exchange provides
        from megatron_kcp.ops import conv_reference
        return conv_reference.causal_conv1d(x, weight, bias, activation, plan, group)
    if plan.world_size == 1:
        from fla.modules.causal_conv1d import causal_conv1d as conv
        y, _ = conv(x, weight, bias, activation=activation, cu_seqlens=plan.cu_seqlens_tensor(x.device),
                    cu_seqlens_cpu=plan.cu_seqlens_tensor())
        return y
    from fla.modules.causal_conv1d.cp import causal_conv1d_cp
    outs = [causal_conv1d_cp(x[:, p.start:p.end], weight, bias, activation=activation, cp_context=p.context)
            for p in _parts(plan, group, x)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)
