"""The KCP KDA mixer on CPU ranks: TP=2 x CP=2 equals TP=1 x CP=1, output and every gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import rel_err, spawn
from tests.layers.test_gdn_cpu import B, HIDDEN, S, _solo_pg, _zigzag_rows, reduced_grads


def _config(cp, tp, **kw):
    from megatron_kcp.layers.kda import KDAConfig
    args = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, kda_gate_rank=8,
                context_parallel_size=cp, tensor_model_parallel_size=tp, activation_func=F.silu)
    return KDAConfig(**{**args, **kw})


def _build(config, pg):
    import tests.megatron_cpu
    tests.megatron_cpu.enable()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_kcp.layers.kda import KCPKimiDeltaAttention, KDASubmodules
    torch.manual_seed(0)
    return KCPKimiDeltaAttention(config, KDASubmodules(ColumnParallelLinear, RowParallelLinear), pg_collection=pg)


def _shard(module, full: dict, tp_rank, tp):
    """A TP=1 tensor dict sliced like ``module``'s TP-parallel parameters (megatron's attributes)."""
    params = dict(module.named_parameters())
    return {n: t.chunk(tp, params[n].partition_dim)[tp_rank]
            if n in params and getattr(params[n], "tensor_model_parallel", False) else t for n, t in full.items()}


def _kda_tp_cp(tp):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    cp = ps.get_context_parallel_world_size()
    ref = _build(_config(1, 1), _solo_pg())
    gen = torch.Generator().manual_seed(1)
    x, dy = torch.randn(S, B, HIDDEN, generator=gen), torch.randn(S, B, HIDDEN, generator=gen)
    xr = x.clone().requires_grad_()
    y_ref, _ = ref(xr)
    y_ref.backward(dy)
    mod = _build(_config(cp, tp), ProcessGroupCollection.use_mpu_process_groups())
    tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    mod.load_state_dict(_shard(mod, ref.state_dict(), tp_rank, tp))
    xl = _zigzag_rows(x, cp, cp_rank).clone().requires_grad_()
    y, _ = mod(xl)
    y.backward(_zigzag_rows(dy, cp, cp_rank))
    grads = reduced_grads(mod)
    ref_grads = _shard(mod, {n: p.grad for n, p in ref.named_parameters()}, tp_rank, tp)
    errs = {"y": rel_err(y, _zigzag_rows(y_ref, cp, cp_rank)), "dx": rel_err(xl.grad, _zigzag_rows(xr.grad, cp, cp_rank))}
    errs.update({"d" + n: rel_err(grads[n], ref_grads[n]) for n in grads})
    assert max(errs.values()) < 1e-5, errs


def test_kda_tp2_cp2_matches_tp1_cp1():
    spawn(_kda_tp_cp, 4, 2, tp=2)


def test_kda_cp4():
    spawn(_kda_tp_cp, 4, 1)


def _bad_configs():
    from megatron.core.process_groups_config import ProcessGroupCollection
    pg = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(ValueError, match="must be <= 256"):
        _build(_config(1, 2, linear_key_head_dim=512), pg)
    with pytest.raises(ValueError, match="linear_num_key_heads=3 must be divisible by the tensor-parallel size 2"):
        _build(_config(1, 2, linear_num_key_heads=3, linear_num_value_heads=6), pg)


def test_kda_bad_config_fails_at_construction():
    spawn(_bad_configs, 2, tp=2)
