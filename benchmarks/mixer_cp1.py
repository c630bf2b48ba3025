"""Mixer level without CP, one GPU: megatron-core's ``GatedDeltaNet`` beside ``KCPGatedDeltaNet``
(same config and weights, Megatron's local layers, bf16, fwd+bwd), or with ``--model kda``
``KCPKimiDeltaAttention`` alone (megatron-core has no KDA mixer), medians after warm-up, and with
``--profile`` torch.profiler's kernel table of each. ``host_ms``: the host's time to issue the step,
from a synchronised start until the backward returns (as ``host_time.py`` times it); ``launches``: the
GPU kernels of one step.

Needs one CUDA GPU, fla-core 0.6.0 and megatron-core 0.19.x (flash-qla 0.1.3 optional: fla then
hands megatron-core's GDN call to it, unless ``FLA_FLASH_QLA=0``). ``--core fla`` pins our mixer's
core to fla's kernels (default ``auto``, what a user gets).

    python -m benchmarks run mixer-cp1 --tokens 32768 --heads 16 --csv mixer_cp1.csv
    python -m benchmarks run mixer-cp1 --model kda --tokens 32768 --heads 32 --hidden 2304 --csv mixer_cp1.csv

``--layer`` times a whole Qwen3-Next-shaped hybrid layer instead (input norm, the mixer, MoE with
``--experts`` routed experts of ``--moe-ffn``, top ``--topk``, and a gated shared expert): the layer of
``gdn_hybrid_layer_spec`` beside the same layer with megatron-core's own ``GatedDeltaNet``
(``cp2hp_gdn_hybrid_layer_spec``), everything else built by megatron-core's builders for the same config.

    python -m benchmarks run mixer-cp1 --layer --tokens 8192 --heads 32 --experts 512 --topk 10 --csv layer_cp1.csv
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import append_csv, free_port
from benchmarks.timing import kernel_time

COLUMNS = ("gpu", "model", "tokens", "heads", "hidden", "mixer", "core", "flash_qla", "median_ms", "min_ms", "host_ms",
           "launches", "err")


def launches(step) -> int:
    """The GPU kernels of one ``step()`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return kernel_time(prof)[1]


def layer(name: str, shape, args):
    """One Qwen3-Next-shaped hybrid layer (GDN, MoE with a gated shared expert), bf16, seeded alike for both."""
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_kcp import spec
    cfg = TransformerConfig(
        num_layers=4, hidden_size=shape.hidden, num_attention_heads=16, num_query_groups=2, kv_channels=256,
        linear_attention_freq=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=shape.heads[0] // 2, linear_num_value_heads=shape.heads[1], normalization="RMSNorm",
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.moe_ffn,
        moe_shared_expert_intermediate_size=args.moe_ffn, moe_shared_expert_gate=True, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-3, transformer_impl="local",
        hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    layer_spec = spec.gdn_hybrid_layer_spec if name == "kcp" else spec.cp2hp_gdn_hybrid_layer_spec
    return _Layer(build_module(layer_spec, config=cfg, layer_number=1).cuda())


class _Layer(torch.nn.Module):
    """A TransformerLayer called as the mixers are: ``(y, bias)`` from ``(x, mask)``."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, mask):
        y, _ = self.layer(x, attention_mask=mask)
        return y, None


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gdn", choices=("gdn", "kda"))
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, nargs="+", default=[16])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--core", default="auto", choices=("auto", "fla", "qla"))
    p.add_argument("--mixers", nargs="+", choices=("megatron", "kcp"), help="default: both (GDN), kcp (KDA)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--layer", action="store_true", help="a whole GDN hybrid layer with MoE, not the mixer alone")
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--topk", type=int, default=10)
    p.add_argument("--moe-ffn", type=int, default=512)
    p.add_argument("--csv", help="append the rows to this CSV")
    args = p.parse_args(argv)
    args.mixers = args.mixers or (["megatron", "kcp"] if args.model == "gdn" else ["kcp"])
    if args.model == "kda" and "megatron" in args.mixers:
        p.error("megatron-core has no KDA mixer: use --mixers kcp")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from megatron.core import parallel_state as ps
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    from megatron_kcp.ops import kcp
    from megatron_kcp.testing.layers import Shape, build, config, solo_pg
    ps.initialize_model_parallel()
    kcp.gated_delta_rule = functools.partial(kcp.gated_delta_rule, backend=args.core)
    qla = os.environ.get("FLA_FLASH_QLA", "1") != "0"
    rows = []
    for H in args.heads:
        T = args.tokens
        shape = Shape(hidden=args.hidden, heads=(H, H), head_dim=128, seq=T, batch=1, device="cuda")
        gen = torch.Generator(device="cuda").manual_seed(T + H)
        x, dy = (torch.randn(T, 1, args.hidden, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        state = ref = None
        for name in args.mixers:
            cls = GatedDeltaNet if name == "megatron" else KCPGatedDeltaNet
            if args.layer:
                mod = layer(name, shape, args)
            else:
                mod = build(args.model, config(args.model, shape, 1, bf16=True, params_dtype=torch.bfloat16),
                            solo_pg(), "cuda", **(dict(cls=cls) if args.model == "gdn" else {})).to(torch.bfloat16)
            state = state or {k: v.clone() for k, v in mod.state_dict().items() if isinstance(v, torch.Tensor)}
            mod.load_state_dict(state, strict=False)
            leaf = x.clone().requires_grad_()

            def step():
                for t in [leaf, *mod.parameters()]:
                    t.grad = None
                y, _ = mod(leaf, None)
                y.backward(dy)
                return y
            for _ in range(args.warmup):
                y = step()
            y = y.detach().float()
            ref = ref if ref is not None else y
            times, host = [], []
            for _ in range(args.iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                a.record()
                step()
                b.record()
                host.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            row = dict(gpu=torch.cuda.get_device_name(), model=args.model, tokens=T, heads=H, hidden=args.hidden,
                       mixer=f"{name}-layer-moe{args.experts}" if args.layer else name,
                       core=args.core if name == "kcp" else "-", flash_qla=int(qla),
                       median_ms=round(statistics.median(times), 3), min_ms=round(min(times), 3),
                       host_ms=round(statistics.median(host), 3), launches=launches(step),
                       err=f"{((y - ref).norm() / ref.norm()).item():.1e}")
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=28,
                                                max_name_column_width=70), flush=True)
            mod = step = None
            torch.cuda.empty_cache()
    if args.csv:
        append_csv(args.csv, COLUMNS, rows)
    dist.destroy_process_group()
