"""--memory-only: peak memory per rank of KCP's fwd+bwd at CP=W, beside the same on one GPU.

Per model and layout, the peak CUDA memory one fwd+bwd step of ``kcp.gated_delta_rule`` (fla
backend) allocates after --warmup steps, counted from a reset after the warm-up (so it includes the
inputs), the largest over the ranks; the one-GPU rows run KCP on a one-rank contiguous plan, in the
calling process. One case (the first --tokens, --heads and --docs), all inputs in --dtype, the gate
included. GPUs only, but fewer than ranks will do: ranks then share them over gloo (peak memory is
per process), and Triton tunes cheaply (tests/fast_autotune.py: the config does not change what is
allocated).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.catalogue import CONV, cu_seqlens
from benchmarks.common import fresh_leaves, init_rank, problem, spawn
from benchmarks.timing import Bench

NEEDS_GPU = ("--memory-only reports CUDA peak memory (torch.cuda.max_memory_allocated) of fla's kernels: it needs "
             "a GPU (its ranks may share one); it has no CPU mode (--smoke checks the timed paths on the CPU)")


def peak_mib(args, model, plan, group, device) -> float:
    """MiB allocated at the peak of one fwd+bwd step on ``plan``'s tokens, inputs included."""
    from megatron_kcp.ops import kcp
    dtype = getattr(torch, args.dtype)
    xs, do = problem(model, plan.num_local_tokens, args.heads[0], args.head_dim, dtype, device, seed=0,
                     gate_dtype=dtype)
    xs = fresh_leaves(xs)

    def step():
        o = kcp.gated_delta_rule(*xs, plan, group, use_qk_l2norm=True, backend="fla")
        torch.autograd.grad(o, xs, do)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def _rank(rank, W, port, args, queue):
    from megatron_kcp.plan import build_plan
    from megatron_kcp.testing.fast_autotune import enable
    enable()
    b = Bench(args, init_rank(rank, W, port, "cuda"), W, rank)
    cu = cu_seqlens(args.docs[0], args.tokens[0], pad=2 * W)
    rows = []
    for model in args.models:
        for layout in args.layouts:
            plan = build_plan(cu, layout, W, rank, CONV)
            rows.append((model, W, layout, b.max_over_ranks([peak_mib(args, model, plan, dist.group.WORLD,
                                                                      b.device)])[0]))
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def table(base, rows) -> str:
    """base {model: MiB on one GPU}, rows [(model, W, layout, MiB per rank)]: the report's table."""
    lines = [f"{'model':5} {'W':>2} {'layout':15} {'peak MiB/rank':>14} {'x single':>9}"]
    for m, W, layout, mem in [(m, 1, "-", mem) for m, mem in base.items()] + rows:
        lines.append(f"{m:5} {W:>2} {layout:15} {mem:14.0f} {mem / base[m]:9.3f}")
    return "\n".join(lines)


def report(args, cps):
    """Measure on one GPU here, then at every CP size in ``cps``; print the table."""
    from megatron_kcp.plan import build_plan
    from megatron_kcp.testing.fast_autotune import enable
    enable()
    cu = cu_seqlens(args.docs[0], args.tokens[0], pad=2 * max(cps))
    plan = build_plan(cu, "contiguous", 1, 0, CONV)
    base = {model: peak_mib(args, model, plan, None, torch.device("cuda")) for model in args.models}
    rows = []
    for W in cps:
        queue = mp.get_context("spawn").SimpleQueue()
        spawn(_rank, W, args, queue)
        rows += queue.get()
    print(f"\n{torch.cuda.get_device_name()} x {torch.cuda.device_count()}, torch {torch.__version__}, "
          f"T={args.tokens[0]} tokens in {len(cu) - 1} doc(s), H={args.heads[0]}, K=V={args.head_dim}, "
          f"{args.dtype}, peak memory of one fwd+bwd step")
    print(table(base, rows))
