"""What the mixer tests share: configs, builders, Megatron's CP / TP / SP splits of the input, and the
TP x CP vs TP=1 x CP=1 comparison itself (run inside ``megatron_kcp.testing.distributed.spawn`` ranks)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_kcp.testing.distributed import rel_err


@dataclass(frozen=True)
class Shape:
    hidden: int = 32
    heads: tuple[int, int] = (2, 4)          # (q/k heads, v heads)
    head_dim: int = 8
    seq: int = 64                            # global sequence length
    batch: int = 2
    device: str = "cpu"
    tol: float = 1e-5
    dtype: torch.dtype = torch.float32


CPU = Shape()
# fla's kernels: head dim 128 as in the op tests; fp32 with 3xTF32 products, except GDN's dq/dk/dg
# backward on Hopper, which is TF32 (TILELANG_FP32_TOL in tests/ops/test_kcp_cuda.py)
GPU = Shape(hidden=256, heads=(4, 4), head_dim=128, seq=1024, batch=1, device="cuda", tol=3e-3)
GPU_BF16 = Shape(hidden=256, heads=(4, 4), head_dim=128, seq=1024, batch=1, device="cuda", tol=1e-2,
                 dtype=torch.bfloat16)
# the controls' gates: decay exp(-1e-3 softplus(.)) a token, so the state carried into a rank's piece
# is a large part of its output (Megatron's initialisation, A in [1, 16], forgets within a few to tens of tokens)
LONG_MEMORY_A_LOG = math.log(1e-3)


def config(model: str, shape: Shape, cp: int = 1, tp: int = 1, **kw):
    from megatron.core.transformer import TransformerConfig

    from megatron_kcp.layers.kda import KDAConfig
    args = dict(num_layers=1, hidden_size=shape.hidden, num_attention_heads=2, use_cpu_initialization=True,
                linear_conv_kernel_dim=4, linear_key_head_dim=shape.head_dim, linear_value_head_dim=shape.head_dim,
                linear_num_key_heads=shape.heads[0], linear_num_value_heads=shape.heads[1],
                normalization="RMSNorm", activation_func=F.silu, context_parallel_size=cp,
                tensor_model_parallel_size=tp)
    if model == "kda":
        return KDAConfig(**{"kda_gate_rank": shape.head_dim, **args, **kw})
    return TransformerConfig(**{**args, **kw})


def build(model: str, cfg, pg, device: str = "cpu", cls=None, **options):
    """The KCP mixer (or ``cls`` with the GDN submodules) with Megatron's local layers, seeded; ``options``
    go to the KDA mixer's constructor."""
    import megatron_kcp.megatron_cpu
    megatron_kcp.megatron_cpu.enable()
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, model_parallel_cuda_manual_seed
    torch.manual_seed(0)
    if device == "cuda":
        model_parallel_cuda_manual_seed(0)
    if model == "kda":
        from megatron_kcp.layers.kda import KCPKimiDeltaAttention, KDASubmodules
        mod = KCPKimiDeltaAttention(cfg, KDASubmodules(ColumnParallelLinear, RowParallelLinear), pg_collection=pg,
                                    **options)
    else:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        from megatron_kcp.layers.gdn import KCPGatedDeltaNet
        norm = SPRMSNorm if cfg.sequence_parallel else WrappedTorchNorm
        sub = GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear)
        mod = (cls or KCPGatedDeltaNet)(cfg, sub, layer_number=1, pg_collection=pg)
    return mod.to(device)


class SPRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as a Megatron norm that, like TENorm and unlike WrappedTorchNorm, allows
    sequence parallelism (Megatron's local norms need apex for it, which the tests do without)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = True


def solo_pg():
    """TP = CP = 1 process groups for a reference module inside a multi-rank test."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    solo, _ = dist.new_subgroups(group_size=1)
    return ProcessGroupCollection(tp=solo, cp=solo)


def tp_shard(model: str, module, full: dict, tp_rank: int, tp: int) -> dict:
    """A TP=1 tensor dict sliced into this TP rank's shard, as megatron-core splits each tensor."""
    params = dict(module.named_parameters())
    if model == "kda":
        return {n: t.chunk(tp, params[n].partition_dim)[tp_rank]
                if n in params and getattr(params[n], "tensor_model_parallel", False) else t for n, t in full.items()}

    def split(t, sections, dim=0):          # GDN's fused projections split section by section
        return torch.cat([p.chunk(tp, dim)[tp_rank] for p in torch.split(t, sections, dim)], dim)
    qk, v, nv = module.qk_dim, module.v_dim, module.num_value_heads        # global sizes
    return {
        "in_proj.weight": split(full["in_proj.weight"], [qk, qk, v, v, nv, nv]),
        "conv1d.weight": split(full["conv1d.weight"], [qk, qk, v]),
        "A_log": full["A_log"].chunk(tp)[tp_rank], "dt_bias": full["dt_bias"].chunk(tp)[tp_rank],
        "out_norm.weight": full["out_norm.weight"],
        "out_proj.weight": full["out_proj.weight"].chunk(tp, 1)[tp_rank],
    }


def zigzag_rows(x, cp: int, r: int):
    """Megatron's per-sequence zigzag split of [s, b, ...] over CP (chunks r and 2cp-1-r)."""
    c = x.chunk(2 * cp, 0)
    return torch.cat([c[r], c[2 * cp - 1 - r]], 0)


def local_input(x, sequence_parallel: bool):
    """This rank's part of a [s, b, h] activation: zigzag over CP, then (SP) split along s over TP."""
    from megatron.core import parallel_state as ps
    x = zigzag_rows(x, ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
    if sequence_parallel:
        x = x.chunk(ps.get_tensor_model_parallel_world_size(), 0)[ps.get_tensor_model_parallel_rank()]
    return x


def reduced_grads(mod) -> dict:
    """Parameter gradients as the full model sees them: summed over CP (as DDP does) and, for
    weights not split over TP (norms shared by the heads of every TP rank), over TP."""
    from megatron.core import parallel_state as ps
    grads = {}
    for n, p in mod.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=ps.get_context_parallel_group())
        if not getattr(p, "tensor_model_parallel", False):
            dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        grads[n] = g
    return grads


def compare_tp_cp(model: str, shape: Shape, tp: int, sequence_parallel: bool = False, control: bool = False,
                  **options) -> dict:
    """The mixer at this spawn's TP x CP (built with ``options``) against TP=1 x CP=1 with the same
    weights: output, input gradient and every parameter gradient; asserts ``shape.tol`` and returns the errors.

    ``control``: long-memory gates (:data:`LONG_MEMORY_A_LOG`), and, at CP > 1, the negative controls:
    the CP mixer run again with its state exchange off, then with its conv halo off, must each miss
    the output by at least 10x the bound (their errors are returned as ``y state off``, ``y halo off``).
    The shape should then have documents that cross a rank edge in the layout the mixer runs. At
    CP = 1 (TP alone) nothing crosses a rank, so there is no exchange to switch off."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    cp = ps.get_context_parallel_world_size()
    dev = shape.device
    ref = build(model, config(model, shape), solo_pg(), dev)
    if control:
        with torch.no_grad():
            ref.A_log.fill_(LONG_MEMORY_A_LOG)
    for t in (*ref.parameters(), *ref.buffers()):   # one reference for all ranks: on GPU, Megatron initialises
        dist.broadcast(t.data, src=0)               # some weights from a CUDA RNG seeded by the TP rank
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(shape.seq, shape.batch, shape.hidden, generator=gen).to(dev) for _ in range(2))
    xr = x.clone().requires_grad_()
    y_ref, _ = ref(xr)
    y_ref.backward(dy)

    cfg = config(model, shape, cp, tp, sequence_parallel=sequence_parallel)
    mod = build(model, cfg, ProcessGroupCollection.use_mpu_process_groups(), dev, **options)
    tp_rank = ps.get_tensor_model_parallel_rank()
    mod.load_state_dict(tp_shard(model, mod, ref.state_dict(), tp_rank, tp))
    xl = local_input(x, sequence_parallel).clone().requires_grad_()
    y, _ = mod(xl)
    y.backward(local_input(dy, sequence_parallel))
    grads = reduced_grads(mod)
    ref_grads = tp_shard(model, mod, {n: p.grad for n, p in ref.named_parameters()}, tp_rank, tp)
    y_want = local_input(y_ref, sequence_parallel)
    errs = {"y": rel_err(y, y_want), "dx": rel_err(xl.grad, local_input(xr.grad, sequence_parallel))}
    errs.update({"d" + n: rel_err(grads[n], ref_grads[n]) for n in grads})
    assert max(errs.values()) < shape.tol, errs
    if control and cp > 1:
        errs.update(exchange_controls(lambda: mod(xl)[0], y_want, shape.tol))
    return errs


def exchange_controls(run, want, tol: float) -> dict:
    """The negative controls of a CP mixer: ``run()`` (its forward on this rank) again with its state exchange
    off, then with its conv halo off, must each miss ``want`` by at least 10x ``tol`` on the worst rank.
    Returns those errors (``y state off``, ``y halo off``)."""
    from megatron.core import parallel_state as ps

    from megatron_kcp.testing.checks import TESTED_STRATEGIES, exchange_off, halo_off
    errs = {}
    for what, switch in (("state", lambda: exchange_off(*TESTED_STRATEGIES, conv_halo=False)),
                         ("halo", halo_off)):
        restore = switch()
        try:
            with torch.no_grad():
                miss = torch.tensor(rel_err(run(), want), dtype=torch.float64, device=want.device)
        finally:
            restore()
        # a rank whose pieces all start sequences misses nothing: the worst rank's
        dist.all_reduce(miss, op=dist.ReduceOp.MAX, group=ps.get_context_parallel_group())
        errs[f"y {what} off"] = miss.item()
        assert miss.item() >= 10 * tol, (f"with the {what} exchange off the mixer misses by {miss.item():.1e}, "
                                         f"under 10x the bound {tol}: the test cannot see that exchange")
    return errs


def compare_on_batch(model: str, shape: Shape, batch: dict, seq: int, control: bool = False,
                     check: bool = True) -> dict:
    """The mixer at this spawn's CP on ``batch`` (:func:`megatron_kcp.testing.batches.megatron_cut`: Megatron's
    cut of a micro batch of documents, with each local token's stream position) against the CP = 1 mixer
    on the whole stream with the same weights: output, input gradient and every parameter gradient
    (fp32, ``shape.tol``). ``control``: long-memory gates and the exchange-off controls
    (:func:`exchange_controls`). Returns the errors (``check=False``: without asserting the bound)."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kcp.testing.batches import packed_seq_params
    cp = ps.get_context_parallel_world_size()
    cu = batch["cu_seqlens"][0]
    whole = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    ref = build(model, config(model, shape), solo_pg(), shape.device)
    if control:
        with torch.no_grad():
            ref.A_log.fill_(LONG_MEMORY_A_LOG)
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(int(cu[-1]), 1, shape.hidden, generator=gen) for _ in range(2))
    xr = x.clone().requires_grad_()
    y_ref, _ = ref(xr, packed_seq_params=whole)
    y_ref.backward(dy)
    mod = build(model, config(model, shape, cp), ProcessGroupCollection.use_mpu_process_groups(), shape.device)
    mod.load_state_dict(ref.state_dict())
    where, params = batch["positions"], packed_seq_params(batch, seq)
    xl = x[where].clone().requires_grad_()
    y, _ = mod(xl, packed_seq_params=params)
    y.backward(dy[where])
    grads = reduced_grads(mod)
    errs = {"y": rel_err(y, y_ref[where]), "dx": rel_err(xl.grad, xr.grad[where])}
    errs.update({"d" + n: rel_err(grads[n], p.grad) for n, p in ref.named_parameters()})
    assert max(errs.values()) < shape.tol or not check, errs
    if control and cp > 1:
        errs.update(exchange_controls(lambda: mod(xl, packed_seq_params=params)[0], y_ref[where], shape.tol))
    return errs
