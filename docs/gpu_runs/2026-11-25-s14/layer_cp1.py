"""One GPU, CP = 1: megatron-core's GatedDeltaNet beside KCPGatedDeltaNet (same config and weights, fwd+bwd,
Megatron's local layers, bf16), timed, and torch.profiler's kernel table of each: where the layers differ
outside the core. ``KCP_CORE=fla`` pins our mixer's core to fla's kernels (default: ``auto``); fla hands
megatron-core's GDN call to flash-qla unless FLA_FLASH_QLA=0 (read once per process).

    python docs/gpu_runs/2026-11-25-s14/layer_cp1.py --tokens 32768 --heads 16 64 --profile
"""
import argparse
import functools
import os
import socket
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=32768)
p.add_argument("--heads", type=int, nargs="+", default=[16])
p.add_argument("--hidden", type=int, default=2048)
p.add_argument("--iters", type=int, default=10)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--profile", action="store_true")
p.add_argument("--mixers", nargs="+", default=["megatron", "kcp"])
args = p.parse_args()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.cuda.set_device(0)
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.ssm.gated_delta_net import GatedDeltaNet  # noqa: E402

from megatron_kcp.layers.gdn import KCPGatedDeltaNet  # noqa: E402
from megatron_kcp.ops import kcp  # noqa: E402
from tests.layers.harness import Shape, build, config, solo_pg  # noqa: E402

ps.initialize_model_parallel()
core = os.environ.get("KCP_CORE", "auto")
kcp.gated_delta_rule = functools.partial(kcp.gated_delta_rule, backend=core)
tag = f"FLA_FLASH_QLA={os.environ.get('FLA_FLASH_QLA', '1')} KCP_CORE={core}"
for H in args.heads:
    T = args.tokens
    shape = Shape(hidden=args.hidden, heads=(H, H), head_dim=128, seq=T, batch=1, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(T + H)
    x, dy = (torch.randn(T, 1, args.hidden, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    state = ref = None
    for name in args.mixers:
        cls = GatedDeltaNet if name == "megatron" else KCPGatedDeltaNet
        mod = build("gdn", config("gdn", shape, 1, bf16=True, params_dtype=torch.bfloat16), solo_pg(), "cuda", cls=cls)
        mod = mod.to(torch.bfloat16)
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
        err = ((y - ref).norm() / ref.norm()).item()
        times = []
        for _ in range(args.iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        print(f"== {tag} H={H} T={T} hidden={args.hidden} {name}: fwd+bwd {statistics.median(times):.2f} ms "
              f"(min {min(times):.2f}), err against the first {err:.1e}", flush=True)
        if args.profile:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=28,
                                            max_name_column_width=70), flush=True)
        mod = step = None
        torch.cuda.empty_cache()
dist.destroy_process_group()
