"""The KCP KDA mixer on CPU ranks: TP x CP (x SP) equals TP=1 x CP=1, output and every gradient."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from megatron_kcp.testing.distributed import spawn
from megatron_kcp.testing.layers import CPU, build, compare_tp_cp, config

# one sequence: in the contiguous layout the mixer runs, it crosses the rank edge
ONE_SEQUENCE = replace(CPU, seq=128, batch=1)


def test_kda_tp2_cp2_matches_tp1_cp1():
    spawn(compare_tp_cp, 4, "kda", CPU, 2, tp=2)


def test_kda_cp2_carries_state_and_halo_across_ranks():
    """One sequence over two ranks with long-memory gates: CP equals CP = 1, and with the state exchange
    or the conv halo off the output misses by at least 10x the bound (the negative controls)."""
    spawn(functools.partial(compare_tp_cp, control=True), 2, "kda", ONE_SEQUENCE, 1)


@pytest.mark.slow
def test_kda_sequence_parallel_tp2_cp2():
    spawn(compare_tp_cp, 4, "kda", CPU, 2, True, tp=2)


@pytest.mark.slow
def test_kda_cp4():
    spawn(compare_tp_cp, 4, "kda", CPU, 1)


def _cp2hp_tp2_cp2():
    """The cp2hp peer of the KDA mixer (``cp2hp_kda_hybrid_layer_spec``): the same function; heads it
    cannot split fail at construction."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    compare_tp_cp("kda", replace(CPU, heads=(4, 4)), 2, strategy="cp2hp")     # cp2hp: heads divisible by TP x CP
    with pytest.raises(ValueError, match="divisible by the CP size 2"):
        build("kda", config("kda", CPU, 2, 2, linear_num_key_heads=2, linear_num_value_heads=2),
              ProcessGroupCollection.use_mpu_process_groups(), strategy="cp2hp")


@pytest.mark.slow
def test_kda_cp2hp_tp2_cp2_matches_tp1_cp1():
    spawn(_cp2hp_tp2_cp2, 4, tp=2)


def _bad_configs():
    from megatron.core.process_groups_config import ProcessGroupCollection
    pg = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(ValueError, match="must be <= 256"):
        build("kda", config("kda", CPU, 1, 2, linear_key_head_dim=512), pg)
    with pytest.raises(ValueError, match="linear_num_key_heads=3 must be divisible by the tensor-parallel size 2"):
        build("kda", config("kda", CPU, 1, 2, linear_num_key_heads=3, linear_num_value_heads=6), pg)
    with pytest.raises(ValueError, match="strategy='fla-cp' is the op's"):
        build("kda", config("kda", CPU, 1, 2), pg, strategy="fla-cp")


@pytest.mark.slow
def test_kda_bad_config_fails_at_construction():
    spawn(_bad_configs, 2, tp=2)


FUSED = r"""
from megatron_kcp.testing import fast_autotune
fast_autotune.KEEP = 1                    # one config: the interpreter cannot time them
fast_autotune.enable()
import torch
from megatron_kcp.testing import kda_fused
for name, errs in kda_fused.errors("cpu", torch.float32).items():
    print(name, " ".join(f"{n}:{a:.1e}/{e:.1e}" for n, (a, e) in errs.items()), flush=True)
    assert max(a for a, _ in errs.values()) < 1e-6, (name, errs)
control = kda_fused.dt_bias_transposed_error("cpu")
print(f"dt_bias key-major: {control:.1e}")
assert control > 1e-2, control
print("fused ok")
"""


@pytest.mark.slow      # Triton's interpreter on the CPU; the GPU suite layers_w2 runs the kernels in bf16 and fp32
def test_kda_fused_gate_and_norm_match_the_formulas():
    """fla's fused gate and gated norm, which the mixer runs on GPUs, under Triton's interpreter in fp32:
    output and every gradient within 1e-6 of the formulas in fp64; ``dt_bias`` fed key-major misses by
    more than 1e-2 (the control). bf16 runs on the GPU (test_layers_cuda.py)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = subprocess.run([sys.executable, "-c", FUSED], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "fused ok" in run.stdout
