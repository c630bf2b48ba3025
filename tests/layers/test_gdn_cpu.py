"""The KCP GDN mixer on CPU ranks: same function as megatron-core's GatedDeltaNet, any TP x CP."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import rel_err, spawn

HIDDEN, S, B = 32, 64, 2


def _config(cp, tp=1, heads=(2, 4), **kw):
    from megatron.core.transformer import TransformerConfig
    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=heads[0], linear_num_value_heads=heads[1], normalization="RMSNorm",
        activation_func=F.silu, context_parallel_size=cp, tensor_model_parallel_size=tp, **kw)


def _build(cls, config, pg):
    import tests.megatron_cpu
    tests.megatron_cpu.enable()
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)
    torch.manual_seed(0)
    return cls(config, sub, layer_number=1, pg_collection=pg)


def _solo_pg():
    from megatron.core.process_groups_config import ProcessGroupCollection
    solo, _ = dist.new_subgroups(group_size=1)
    return ProcessGroupCollection(tp=solo, cp=solo)


def _tp_shard(full: dict, module, tp_rank, tp):
    """Slice a TP=1 state dict into this TP rank's shard, section by section as megatron-core splits it."""
    def split(t, sections, dim=0):
        parts = torch.split(t, sections, dim)
        return torch.cat([p.chunk(tp, dim)[tp_rank] for p in parts], dim)
    qk, v, nv = module.qk_dim, module.v_dim, module.num_value_heads
    return {
        "in_proj.weight": split(full["in_proj.weight"], [qk, qk, v, v, nv, nv]),
        "conv1d.weight": split(full["conv1d.weight"], [qk, qk, v]),
        "A_log": full["A_log"].chunk(tp)[tp_rank], "dt_bias": full["dt_bias"].chunk(tp)[tp_rank],
        "out_norm.weight": full["out_norm.weight"],
        "out_proj.weight": full["out_proj.weight"].chunk(tp, 1)[tp_rank],
    }


def _zigzag_rows(x, cp, r):
    """Megatron's per-sequence zigzag split of [s, b, ...] over CP (chunks r and 2cp-1-r)."""
    c = x.chunk(2 * cp, 0)
    return torch.cat([c[r], c[2 * cp - 1 - r]], 0)


def reduced_grads(mod):
    """Parameter gradients as the full model sees them: summed over CP (as DDP does) and, for
    weights not split over TP (the output norm, shared by the heads of every TP rank), over TP."""
    from megatron.core import parallel_state as ps
    grads = {}
    for n, p in mod.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=ps.get_context_parallel_group())
        if not getattr(p, "tensor_model_parallel", False):
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        grads[n] = g
    return grads


def _tp_cp_vs_reference(tp, heads):
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    cp = ps.get_context_parallel_world_size()
    ref = _build(KCPGatedDeltaNet, _config(1, heads=heads), _solo_pg())
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(S, B, HIDDEN, generator=gen)
    dy = torch.randn(S, B, HIDDEN, generator=gen)
    xr = x.clone().requires_grad_()
    y_ref, _ = ref(xr)
    y_ref.backward(dy)

    mod = _build(KCPGatedDeltaNet, _config(cp, tp, heads=heads), ProcessGroupCollection.use_mpu_process_groups())
    tp_rank = ps.get_tensor_model_parallel_rank()
    mod.load_state_dict(_tp_shard(ref.state_dict(), ref, tp_rank, tp))
    cp_rank = ps.get_context_parallel_rank()
    xl = _zigzag_rows(x, cp, cp_rank).clone().requires_grad_()
    y, _ = mod(xl)
    y.backward(_zigzag_rows(dy, cp, cp_rank))
    grads = reduced_grads(mod)
    ref_grads = _tp_shard({n: p.grad for n, p in ref.named_parameters()}, ref, tp_rank, tp)
    errs = {"y": rel_err(y, _zigzag_rows(y_ref, cp, cp_rank)),
            "dx": rel_err(xl.grad, _zigzag_rows(xr.grad, cp, cp_rank))}
    errs.update({"d" + n: rel_err(grads[n], ref_grads[n]) for n in grads})
    assert max(errs.values()) < 1e-5, errs


def test_tp2_cp2_matches_tp1_cp1():
    spawn(_tp_cp_vs_reference, 4, 2, (2, 4), tp=2)


def _cp_beyond_heads():
    """2 heads, CP=4: megatron-core's cp2hp cannot split 2 heads over 4 ranks; KCP needs no split."""
    import pytest
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    _tp_cp_vs_reference(1, (2, 2))
    gdn = _build(GatedDeltaNet, _config(4, heads=(2, 2)), ProcessGroupCollection.use_mpu_process_groups())
    with pytest.raises(AssertionError, match="divisible by cp_size"):
        gdn(torch.randn(S // 4, B, HIDDEN), None)


def test_cp_larger_than_head_count():
    spawn(_cp_beyond_heads, 4)


def _same_as_megatron_gdn():
    """Weights of megatron-core's GatedDeltaNet load into KCPGatedDeltaNet and give the same output.
    megatron's module runs its pure-torch path (deterministic_mode) with fla's Triton l2norm swapped
    for the reference one, so it runs on CPU."""
    import megatron.core.ssm.gated_delta_net.common as common
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    from megatron_kcp.ops.reference import l2norm
    common.l2norm = l2norm
    pg = ProcessGroupCollection.use_mpu_process_groups()
    theirs = _build(GatedDeltaNet, _config(1, deterministic_mode=True), pg)
    ours = _build(KCPGatedDeltaNet, _config(1), pg)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(2))
    y_theirs, _ = theirs(x, None)
    y_ours, _ = ours(x)
    assert rel_err(y_ours, y_theirs) < 1e-5
    assert list(theirs.sharded_state_dict().keys()) == list(ours.sharded_state_dict().keys())


def test_same_function_and_checkpoint_as_megatron_gdn():
    spawn(_same_as_megatron_gdn, 1)


def _gdn_bad_configs():
    import pytest
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    pg = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(ValueError, match="linear_num_key_heads=3 is not divisible by the tensor-parallel size 2"):
        _build(KCPGatedDeltaNet, _config(1, 2, heads=(3, 6)), pg)


def test_gdn_bad_config_fails_at_construction():
    spawn(_gdn_bad_configs, 2, tp=2)
