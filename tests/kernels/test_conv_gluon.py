"""fla's Gluon conv under the halo: the halo fix kernel on the CPU (Triton's interpreter), the backend's pick.

fla's Gluon backward treats every segment as a sequence start; ``_halo_fix_kernel`` adds what the halo
changes. Here the fix is applied to the gradients of the conv without halo (what fla's backward
computes) and must give those of the conv with it, against autograd in fp64; the gradients without
the fix miss by 1e-2 and more. The Gluon kernels themselves run only on a GPU (tests/ops/test_kcp_cuda.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_kcp.ops import kcp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import itertools
import torch, triton
import torch.nn.functional as F
from megatron_kcp.kernels.conv_gluon import FIX_BD, _halo_fix_kernel


def conv(xs, w, b, act, halos):
    W, out = w.shape[1], []
    for x, h in zip(xs, halos):
        xe = torch.cat([h if h is not None else x.new_zeros(W - 1, x.shape[1]), x])
        y = sum(xe[j:j + len(x)] * w[:, j] for j in range(W)) + (b if b is not None else 0)
        out.append(F.silu(y) if act else y)
    return torch.cat(out)


def rel(a, r):
    return ((a.double() - r).norm() / r.norm()).item()


torch.manual_seed(0)
lens = [1, 7, 2, 30, 3, 64, 2]                    # pieces shorter than the halo, and long ones
cont = [True, False, True, True, True, False, True]
bos = [sum(lens[:i]) for i in range(len(lens))]
segs = [i for i, c in enumerate(cont) if c]
n, D, f = len(segs), 200, torch.float32            # 200 channels: two blocks, the second partial
for W, has_b, act in itertools.product((2, 3, 4), (False, True), ("silu", None)):
    HL = W - 1
    x, dy = torch.randn(sum(lens), D, dtype=torch.float64), torch.randn(sum(lens), D, dtype=torch.float64)
    w, b = torch.randn(D, W, dtype=torch.float64), torch.randn(D, dtype=torch.float64) if has_b else None
    halo = torch.randn(len(lens) * HL, D, dtype=torch.float64)

    def grads(with_halo):
        leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b, halo)]
        xl, wl, bl, hl = leaves
        hs = [hl[i * HL:(i + 1) * HL] if c and with_halo else None for i, c in enumerate(cont)]
        conv(list(xl.split(lens)), wl, bl, act, hs).backward(dy)
        return [t.grad if t is not None else None for t in leaves]
    dx1, dw1, db1, dh1 = grads(True)
    dx0, dw0, db0, _ = grads(False)
    rows = torch.tensor([bos[i] for i in segs] + [lens[i] for i in segs] + segs)    # piece i starts segment i
    dx, dh = dx0.to(f).clone(), torch.zeros(len(lens) * HL, D, dtype=f)
    dwp, dbp = torch.zeros(n, D, W, dtype=f), torch.zeros(n, D, dtype=f)
    _halo_fix_kernel[(triton.cdiv(D, FIX_BD), n)](
        x.to(f), dy.to(f), w.to(f), b.to(f) if has_b else None, halo.to(f), rows, dx, dh, dwp, dbp, n, 0, D, D,
        D=D, W=W, BR=max(2, triton.next_power_of_2(HL)), BLOCK=FIX_BD, HAS_BIAS=has_b, ACTIVATION=act)
    errs = dict(dx=rel(dx, dx1), dw=rel(dw0.to(f) + dwp.sum(0), dw1), dhalo=rel(dh, dh1))
    if has_b:
        errs["db"] = rel(db0.to(f) + dbp.sum(0), db1)
    unfixed = dict(dw=rel(dw0, dw1), **(dict(dx=rel(dx0, dx1)) if act else {}))
    print(W, has_b, act, errs, unfixed, flush=True)
    assert max(errs.values()) < 1e-6, (W, has_b, act, errs)
    assert min(unfixed.values()) > 1e-2, (W, has_b, act, unfixed)
print("halo fix ok")
"""


@pytest.mark.slow      # Triton's interpreter on the CPU; the GPU suite ops_conv runs the kernel itself
def test_halo_fix_gives_the_gradients_with_the_halo():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "halo fix ok" in run.stdout


def test_conv_backend_pick_and_errors(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kcp.CONV_ENV, raising=False)
    assert kcp.conv_backend(cpu, torch.bfloat16, 4) == "reference"
    assert kcp.conv_backend(cpu, torch.bfloat16, 4, "qla") == "fla"
    with pytest.raises(RuntimeError, match="use backend='reference'"):
        kcp.conv_backend(cpu, torch.bfloat16, 4, "gluon")
    with pytest.raises(ValueError, match="use backend='fla'"):
        kcp.conv_backend(cpu, torch.float64, 4, "gluon")
    with pytest.raises(ValueError, match="kernel sizes 2 to 4"):
        kcp.conv_backend(cpu, torch.bfloat16, 5, "gluon")
    with pytest.raises(ValueError, match="unknown conv backend"):
        kcp.conv_backend(cpu, torch.bfloat16, 4, "cuda")
    monkeypatch.setenv(kcp.CONV_ENV, "reference")
    assert kcp.conv_backend(cpu, torch.bfloat16, 4) == "reference"
    monkeypatch.setenv(kcp.CONV_ENV, "gluon")               # set, it is asked for: an error where it cannot run
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        kcp.conv_backend(cpu, torch.bfloat16, 4)
    monkeypatch.setenv(kcp.CONV_ENV, "triton")
    with pytest.raises(ValueError, match="KCP_CONV='triton' is not a conv backend"):
        kcp.conv_backend(cpu, torch.bfloat16, 4)
