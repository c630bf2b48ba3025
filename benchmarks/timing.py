"""Measuring on every rank: CUDA-event times (median over iterations of the slowest rank), peak
memory beyond the inputs, and the collectives a call issues (bytes received, replayed alone)."""
from __future__ import annotations

import math
import statistics
import time
import traceback

import torch
import torch.distributed as dist


def kernel_time(prof) -> tuple[float, int]:
    """(summed seconds, count) of the GPU kernels a finished ``torch.profiler.profile`` recorded."""
    ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_async]
    return sum(e.device_time for e in ks) / 1e6, len(ks)


class CommLog:
    """The collectives one call issues: bytes this rank receives, and a replay of them alone."""
    NAMES = ("all_gather_into_tensor", "all_to_all_single", "all_reduce", "reduce_scatter_tensor", "isend", "irecv")

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.orig = {n: getattr(dist, n) for n in self.NAMES}
        for n, fn in self.orig.items():
            setattr(dist, n, self._spy(n, fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self.orig.items():
            setattr(dist, n, fn)

    def _spy(self, name, fn):
        def call(*args, **kw):
            group = kw.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if dist.get_world_size(group) > 1:
                # the replay needs the data's shape, not the data: keep a copy of what a send sends
                saved = tuple(a.clone() if name == "isend" and isinstance(a, torch.Tensor) else a for a in args)
                self.calls.append((name, fn, saved, kw, dist.get_world_size(group), dist.get_rank(group)))
            return fn(*args, **kw)
        return call

    @property
    def received_bytes(self) -> int:
        total = 0
        for name, _, args, kw, W, rank in self.calls:
            t = [a for a in list(args) + list(kw.values()) if isinstance(a, torch.Tensor)]
            splits = args[2] if name == "all_to_all_single" and len(args) > 2 else kw.get("output_split_sizes")
            if name == "all_gather_into_tensor":
                total += t[0].nbytes - t[1].nbytes
            elif splits:                               # uneven all-to-all: all but what this rank sends itself
                total += t[0].nbytes * (sum(splits) - splits[rank]) // max(sum(splits), 1)
            elif name in ("all_to_all_single", "reduce_scatter_tensor"):
                total += t[-1].nbytes * (W - 1) // W
            elif name == "irecv":
                total += t[0].nbytes
            elif name == "all_reduce":                 # ring all-reduce: reduce-scatter + all-gather
                total += 2 * t[0].nbytes * (W - 1) // W
        return total

    def replay(self):
        """A step issuing the same collectives on fresh buffers of the same shapes."""
        def fresh(a):
            return torch.zeros_like(a) if isinstance(a, torch.Tensor) else a
        calls = [(fn, [fresh(a) for a in args], {k: fresh(v) for k, v in kw.items() if k != "async_op"})
                 for _, fn, args, kw, _, _ in self.calls]

        def step():
            works = [fn(*args, **kw) for fn, args, kw in calls]
            for w in works:                            # point-to-point ops return their work
                if w is not None:
                    w.wait()
        return step


class Bench:
    """One rank's measuring kit: device, clock, reductions over ranks, the time budget."""

    def __init__(self, args, device, W, rank):
        self.args, self.device, self.W, self.rank = args, device, W, rank
        self.cuda = device.type == "cuda"
        self.dtype = getattr(torch, args.dtype)
        self.deadline = args.deadline
        self.profiled = False           # a profiler session has run in this process (profile)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def max_over_ranks(self, values):
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def out_of_time(self) -> bool:
        """Rank 0's clock decides, so every rank skips the same cases."""
        flag = torch.tensor([float(time.time() > self.deadline)], device=self.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def _once(self, step) -> float:
        self.sync()
        dist.barrier()
        self.sync()
        if not self.cuda:
            t0 = time.perf_counter()
            step()
            return (time.perf_counter() - t0) * 1e3
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    def measure(self, step, input_bytes=0):
        """(median ms of the slowest rank, peak MiB); warm-up first keeps autotuning out."""
        for _ in range(self.args.warmup):
            step()
        self.sync()
        if self.cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times = [self._once(step) for _ in range(self.args.iters)]
        peak = (torch.cuda.max_memory_allocated() - base + input_bytes) / 2**20 if self.cuda else 0.0
        t = self.max_over_ranks(times + [peak])
        return statistics.median(t[:-1]), (t[-1] if self.cuda else math.nan)

    def profile(self, step, what: str, rows: int):
        """Every rank's torch.profiler table of one ``step``, printed in rank order: the wall time, the
        kernels' summed time and count (their difference: the host and waits no kernel covers; a collective's
        kernel counts its wait), and the ``rows`` costliest operators by device time."""
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # a process's first profiler session sets up its buffers for milliseconds, at a different moment on
        # each rank: the other ranks' collectives would count that wait. It runs once, untold.
        if not self.profiled:
            with profile(activities=activities):
                step()
                self.sync()
            self.profiled = True
        step()
        self.sync()
        dist.barrier()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            step()
            self.sync()
            wall = (time.perf_counter() - t0) * 1e3
        seconds, launches = kernel_time(prof)
        head = (f"== profile {what} W={self.W} rank {self.rank}: wall {wall:.2f} ms, kernels "
                f"{seconds * 1e3:.2f} ms in {launches} launches")
        table = prof.key_averages().table(sort_by="cuda_time_total" if self.cuda else "cpu_time_total",
                                          row_limit=rows)
        for r in range(self.W):
            dist.barrier()
            if r == self.rank:
                print(f"{head}\n{table}", flush=True)
        dist.barrier()                  # the last rank's table printed before rank 0 prints its next row

    def exchange(self, step):
        """(received bytes, calls, ms of the collectives alone) of one call of ``step``."""
        with CommLog() as log:
            step()
        self.sync()
        if not log.calls:
            return 0, 0, math.nan
        return log.received_bytes, len(log.calls), self.measure(log.replay())[0]

    def rows(self, meta, make_step, input_bytes, err, passes):
        """One row per pass; make_step(pass) -> a callable doing one forward (+ backward)."""
        out = []
        for pas in passes:
            step = make_step(pas)
            ms, peak = self.measure(step, input_bytes[pas])
            xb, xc, xms = self.exchange(step) if meta["W"] > 1 else (0, 0, math.nan)
            out.append(dict(meta, **{"pass": pas}, ms=ms, peak_mib=peak, xchg_bytes=xb, xchg_calls=xc,
                            exchange_ms=xms, err=err))
        return out

    def failed(self, meta, passes, e):
        traceback.print_exc()
        note = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
        return [dict(meta, **{"pass": p}, note=note) for p in passes]
