"""The KCP mixers on GPUs with fla's kernels: TP x CP equals TP=1 x CP=1 (skip without CUDA).

Ranks use NCCL when every rank has its own GPU, else gloo with ranks sharing GPUs
(tests/distributed.py). fp32 runs fla's products as 3xTF32, like the op tests.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_kcp.testing.distributed import spawn
from megatron_kcp.testing.layers import GPU, compare_tp_cp

pytestmark = pytest.mark.gpu


def _compare(model, tp, sequence_parallel, shape=GPU, control=False):
    from megatron.core import parallel_state as ps
    errs = compare_tp_cp(model, shape, tp, sequence_parallel, control)
    if torch.distributed.get_rank() == 0:
        cp = ps.get_context_parallel_world_size()
        sp = " SP" if sequence_parallel else ""
        line = (f"{model.upper()} mixer T={shape.seq} TP={tp} CP={cp}{sp} vs TP=1 CP=1: "
                + " ".join(f"{n}:{e:.1e}" for n, e in errs.items()))
        print(line, flush=True)
        if os.environ.get("KCP_EVIDENCE_DIR"):
            with open(os.path.join(os.environ["KCP_EVIDENCE_DIR"], "layers_gpu.txt"), "a") as f:
                f.write(line + "\n")


@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("world_size,tp,sp", [(2, 1, False), (2, 2, True), (4, 2, True), (4, 1, False)])
def test_mixer_on_gpu(model, world_size, tp, sp, monkeypatch):
    """With long-memory gates and, at CP > 1, the negative controls (state exchange off, conv halo off:
    each must miss by 10x the bound). ``world_size`` counts TP x CP ranks: (2, 2, True) is TP alone."""
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    spawn(_compare, world_size, model, tp, sp, GPU, True, tp=tp)


# GPU's 1024 tokens give CP pieces of 256; a 32k sequence gives pieces of 8192, as the measured tables'
# one-sequence rows run (no controls: a halo of 3 tokens a piece is too small a part of such pieces)
GPU_LONG = dataclasses.replace(GPU, seq=32768)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gdn", "kda"])
def test_mixer_with_long_pieces_on_gpu(model, monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    spawn(_compare, 2, model, 1, False, GPU_LONG)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_fused_gate_and_norm_on_gpu(dtype):
    """fla's fused gate and gated norm, which the KDA mixer runs on GPUs, against the formulas in fp64:
    output and every gradient within 1.5x of the eager path's error in the same dtype (fp32: or 1e-6);
    ``dt_bias`` fed key-major misses by more than 1e-2 (the control)."""
    from megatron_kcp.testing import kda_fused
    errs = kda_fused.errors("cuda", dtype)
    for name, e in errs.items():
        print(f"KDA {name} {dtype}: " + " ".join(f"{n}:{a:.1e}/{b:.1e}" for n, (a, b) in e.items()), flush=True)
        floor = 1e-6 if dtype == torch.float32 else 0.0
        assert all(a <= max(1.5 * b, floor) for a, b in e.values()), (name, e)
    assert kda_fused.dt_bias_transposed_error("cuda") > 1e-2
