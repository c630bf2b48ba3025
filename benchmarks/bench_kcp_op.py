"""Op-level KCP on GPUs: time and peak memory of GDN/KDA fwd+bwd per CP layout, beside one GPU.

    python benchmarks/bench_kcp_op.py --cp 4 --tokens 32768 --heads 16

Prints one table: per (model, CP size, layout) the median fwd+bwd time over --iters timed
iterations after warm-up (CUDA events), parallel efficiency t_1 / (W * t_W), and peak memory
per rank. Documents: --docs equal documents (each a multiple of 2W tokens, as Megatron pads them).

``--memory-only`` reports peak memory alone; it runs with fewer GPUs than ranks (gloo, ranks
sharing GPUs) and with the tests' cheap autotuning, neither of which changes what is allocated.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _problem(T, H, K, kda, device):
    gen = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    q, k = (torch.randn(1, T, H, K, generator=gen, **bf) for _ in range(2))
    v = torch.randn(1, T, H, K, generator=gen, **bf)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, H, *((K,) if kda else ()), generator=gen, **bf))
    beta = torch.rand(1, T, H, generator=gen, **bf)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _measure(plan, group, args, kda, T_local):
    from megatron_kcp.ops import kcp
    xs = _problem(T_local, args.heads, args.head_dim, kda, "cuda")
    do = torch.randn(1, T_local, args.heads, args.head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        o = kcp.gated_delta_rule(*xs, plan, group, use_qk_l2norm=True, backend="fla")
        torch.autograd.grad(o, xs, do)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    if args.memory_only:                 # peak of one step beyond what the inputs hold
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return float("nan"), torch.cuda.max_memory_allocated() / 2**20
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.iters):
        if group is not None:
            dist.barrier(group)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**20


def _cu(args, W):
    T, n = args.tokens, args.docs
    unit = 2 * W
    L = (T // n) // unit * unit
    cu = [i * L for i in range(n)] + [T]
    if (T - cu[-2]) % unit:
        raise SystemExit(f"--tokens {T} with --docs {n} leaves a last document not a multiple of {unit}")
    return tuple(cu)


def _rank(rank, W, port, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _setup(args)
    ngpu = torch.cuda.device_count()
    torch.cuda.set_device(rank % ngpu)
    if W <= ngpu:
        dist.init_process_group("nccl", rank=rank, world_size=W, device_id=torch.device("cuda", rank))
    elif args.memory_only:
        from tests.distributed import gloo_accepts_stacked_all_gather
        dist.init_process_group("gloo", rank=rank, world_size=W)
        gloo_accepts_stacked_all_gather()
    else:
        raise SystemExit(f"CP={W} needs {W} GPUs for timings, found {ngpu} (--memory-only runs on fewer)")
    from megatron_kcp.parallel.plan import build_plan
    rows = []
    for kda in (False, True):
        for layout in args.layouts:
            plan = build_plan(_cu(args, W), layout, W, rank, 4)
            t, mem = _measure(plan, dist.group.WORLD, args, kda, plan.num_local_tokens)
            stats = torch.tensor([t, mem], device="cuda")
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            rows.append(("KDA" if kda else "GDN", W, layout, *stats.tolist()))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def _setup(args):
    if args.memory_only:
        from tests.fast_autotune import enable
        enable()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag", "zigzag_per_doc"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--memory-only", action="store_true", help="peak memory only (see the module docstring)")
    args = p.parse_args()
    _setup(args)
    from megatron_kcp.parallel.plan import build_plan
    base = {}
    for kda in (False, True):
        plan = build_plan(_cu(args, 1), "contiguous", 1, 0, 4)
        base["KDA" if kda else "GDN"] = _measure(plan, None, args, kda, args.tokens)
    ctx = mp.get_context("spawn")
    rows = []
    for W in args.cp:
        q = ctx.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_rank, args=(W, port, args, q), nprocs=W, start_method="spawn")
        rows += q.get()
    gpu = torch.cuda.get_device_name()
    what = ("peak memory of one fwd+bwd step" if args.memory_only
            else f"fwd+bwd, median of {args.iters} after {args.warmup} warm-up")
    print(f"\n{gpu} x {torch.cuda.device_count()}, torch {torch.__version__}, T={args.tokens} tokens in "
          f"{args.docs} doc(s), H={args.heads}, K=V={args.head_dim}, bf16, {what}")
    if args.memory_only:
        print(f"{'model':5} {'W':>2} {'layout':15} {'peak MiB/rank':>14} {'x single':>9}")
        for m, W, layout, _, mem in [(m, 1, "-", t, mem) for m, (t, mem) in base.items()] + rows:
            print(f"{m:5} {W:>2} {layout:15} {mem:14.0f} {mem / base[m][1]:9.3f}")
        return
    print(f"{'model':5} {'W':>2} {'layout':15} {'ms':>8} {'eff':>6} {'peak MiB/rank':>14}")
    for m, (t, mem) in base.items():
        print(f"{m:5} {1:>2} {'-':15} {t:8.2f} {1:6.2f} {mem:14.0f}")
    for m, W, layout, t, mem in rows:
        print(f"{m:5} {W:>2} {layout:15} {t:8.2f} {base[m][0] / (W * t):6.2f} {mem:14.0f}")


if __name__ == "__main__":
    main()
