"""The KDA mixer's per-token kernels (``layers.kda.kda_gate``, ``gated_rms_norm``): fla's fused path against
the formulas in fp64, output and every input gradient, beside the eager path's errors in the same dtype.

Run on a GPU by ``tests/layers/test_layers_cuda.py`` and on the CPU under Triton's interpreter by
``tests/layers/test_kda.py`` (fp32 only there: the interpreter's bf16 rounding is not the GPU's).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_kcp.layers.kda import gated_rms_norm, kda_gate

T, H, K, EPS = 70, 4, 128, 1e-6         # 70 tokens: a partial last block of every kernel; K of the real models


def _gate_fp64(f, A_log, dt_bias):
    return -A_log.exp()[:, None] * F.softplus(f + dt_bias.view(H, K))


def _norm_fp64(x, gate, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight * torch.sigmoid(gate)


def _run(fn, leaves, dy, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    y = fn(*leaves, **kw)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad for t in leaves]


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def inputs(device):
    """``{name: (fused-or-eager fn, fp64 formula, leaves in fp64, names, which leaves take the dtype)}``."""
    g = torch.Generator().manual_seed(0)
    f = torch.randn(1, T, H, K, generator=g, dtype=torch.float64) * 4
    f[0, :5, :, 0] = 25.0                                   # softplus's linear side (threshold 20)
    A_log = torch.rand(H, generator=g, dtype=torch.float64) * 2.7
    dt_bias = torch.randn(H * K, generator=g, dtype=torch.float64)
    x, gate = (torch.randn(1, T, H, K, generator=g, dtype=torch.float64) * s for s in (1, 2))
    weight = torch.rand(K, generator=g, dtype=torch.float64) + 0.5
    on = [t.to(device) for t in (f, A_log, dt_bias, x, gate, weight)]
    return {
        "gate": (kda_gate, _gate_fp64, on[:3], ("out", "df", "dA_log", "ddt_bias"), (0,)),
        "norm": (lambda x, g, w, fused: gated_rms_norm(x, g, w, EPS, fused), _norm_fp64, on[3:],
                 ("out", "dx", "dgate", "dweight"), (0, 1, 2)),
    }


def errors(device, dtype: torch.dtype) -> dict[str, dict[str, tuple[float, float]]]:
    """``{gate|norm: {output or gradient: (fused's error, eager's error)}}``, relative to the fp64 formula
    (the gate's parameters stay fp32, as the mixer keeps them)."""
    out = {}
    for name, (fn, formula, leaves, names, cast) in inputs(device).items():
        dy = torch.randn(1, T, H, K, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)
        ref = _run(formula, leaves, dy)
        low = [t.to(dtype) if i in cast else t.float() for i, t in enumerate(leaves)]
        fused, eager = (_run(fn, low, dy, fused=b) for b in (True, False))
        out[name] = {n: (_rel(a, r), _rel(e, r)) for n, a, e, r in zip(names, fused, eager, ref)}
    return out


def dt_bias_transposed_error(device) -> float:
    """The control: the fused gate fed ``dt_bias`` key-major (a layout error) against the formula."""
    _, formula, (f, A_log, dt_bias), *_ = inputs(device)["gate"]
    wrong = dt_bias.view(H, K).t().reshape(-1)
    return _rel(kda_gate(f.float(), A_log.float(), wrong.float(), fused=True), formula(f, A_log, dt_bias))
