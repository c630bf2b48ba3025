"""The KCP GDN mixer on CPU ranks: same function as megatron-core's GatedDeltaNet, any TP x CP (x SP)."""
from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from megatron_kcp.testing.distributed import rel_err, spawn
from megatron_kcp.testing.layers import CPU, build, compare_tp_cp, config

# one sequence: in the contiguous layout the mixer runs, it crosses the rank edge
ONE_SEQUENCE = replace(CPU, seq=128, batch=1)


def test_tp2_cp2_matches_tp1_cp1():
    spawn(compare_tp_cp, 4, "gdn", CPU, 2, tp=2)


def test_cp2_carries_state_and_halo_across_ranks():
    """One sequence over two ranks with long-memory gates: CP equals CP = 1, and with the state exchange
    or the conv halo off the output misses by at least 10x the bound (the negative controls)."""
    spawn(functools.partial(compare_tp_cp, control=True), 2, "gdn", ONE_SEQUENCE, 1)


def test_tp2_alone_with_long_memory_gates():
    """TP = 2 with SP and CP = 1, as the GPU suite's (2, 2, True) case: the gates of the controls, but no
    exchange to switch off (the controls need CP > 1)."""
    spawn(functools.partial(compare_tp_cp, control=True), 2, "gdn", ONE_SEQUENCE, 2, True, tp=2)


@pytest.mark.slow
def test_sequence_parallel_tp2_cp2_matches_tp1_cp1():
    spawn(compare_tp_cp, 4, "gdn", CPU, 2, True, tp=2)


def _cp_beyond_heads():
    """2 heads, CP=4: megatron-core's cp2hp cannot split 2 heads over 4 ranks; KCP needs no split."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    shape = replace(CPU, heads=(2, 2))
    compare_tp_cp("gdn", shape, 1)
    gdn = build("gdn", config("gdn", shape, 4), ProcessGroupCollection.use_mpu_process_groups(), cls=GatedDeltaNet)
    with pytest.raises(AssertionError, match="divisible by cp_size"):
        gdn(torch.randn(shape.seq // 4, shape.batch, shape.hidden), None)


@pytest.mark.slow
def test_cp_larger_than_head_count():
    spawn(_cp_beyond_heads, 4)


def _same_as_megatron_gdn():
    """Weights of megatron-core's GatedDeltaNet load into KCPGatedDeltaNet and give the same output and
    the same gradients of the input and of every weight but the gate's (``A_log``, ``dt_bias``).
    megatron's module runs its pure-torch path (deterministic_mode) with fla's Triton l2norm swapped
    for the reference one, so it runs on CPU. That path's gate gradients (norm about 2e-6 here, against
    14 for ``in_proj``'s) differ from ours by about 40% in fp64 as in fp32; ours are checked against
    central differences of our module in fp64 instead."""
    import megatron.core.ssm.gated_delta_net.common as common
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_kcp.kernels.reference import l2norm
    common.l2norm = l2norm
    pg = ProcessGroupCollection.use_mpu_process_groups()
    theirs = build("gdn", config("gdn", CPU, deterministic_mode=True), pg, cls=GatedDeltaNet)
    ours = build("gdn", config("gdn", CPU), pg)
    ours.load_state_dict(theirs.state_dict())
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(CPU.seq, CPU.batch, CPU.hidden, generator=gen, requires_grad=True)
    dy = torch.randn(CPU.seq, CPU.batch, CPU.hidden, generator=gen)
    y_theirs, _ = theirs(x, None)
    y_ours, _ = ours(x)
    assert rel_err(y_ours, y_theirs) < 1e-5
    names = [n for n, _ in theirs.named_parameters() if n not in ("A_log", "dt_bias")]
    grads = [torch.autograd.grad(y, [x, *(dict(m.named_parameters())[n] for n in names)], dy)
             for y, m in ((y_theirs, theirs), (y_ours, ours))]
    for name, g_theirs, g_ours in zip(["input", *names], *grads):
        assert rel_err(g_ours, g_theirs) < 1e-5, name
    assert list(theirs.sharded_state_dict().keys()) == list(ours.sharded_state_dict().keys())

    ours, x, dy = ours.double(), x.detach().double(), dy.double()

    def loss():
        return (ours(x)[0] * dy).sum()
    eps = 1e-3                         # the gate is computed in fp32: a smaller step reads its rounding
    for p in (ours.A_log, ours.dt_bias):
        auto = torch.autograd.grad(loss(), [p])[0]
        central = torch.empty_like(p)
        with torch.no_grad():
            for i in range(p.numel()):
                p[i] += eps
                up = loss()
                p[i] -= 2 * eps
                central[i] = (up - loss()) / (2 * eps)
                p[i] += eps
        assert rel_err(auto, central) < 1e-3, (auto, central)


def test_same_function_and_checkpoint_as_megatron_gdn():
    spawn(_same_as_megatron_gdn, 1)


def _gdn_bad_configs():
    from megatron.core.process_groups_config import ProcessGroupCollection
    pg = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(ValueError, match="linear_num_key_heads=3 is not divisible by the tensor-parallel size 2"):
        build("gdn", config("gdn", replace(CPU, heads=(3, 6)), 1, 2), pg)


@pytest.mark.slow
def test_gdn_bad_config_fails_at_construction():
    spawn(_gdn_bad_configs, 2, tp=2)
