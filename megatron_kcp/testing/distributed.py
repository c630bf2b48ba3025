"""Multi-process test harness in the spirit of Megatron's ``tests/unit_tests/test_utilities.Utils``.

``spawn(fn, world_size, *args, tp=1, pp=1)`` starts ``world_size`` processes, initialises
``megatron.core.parallel_state`` with the given TP and PP sizes and CP = world_size / (tp * pp), runs ``fn(*args)``
on every rank and re-raises the first failure. Backends: NCCL with one GPU per rank when there are
enough GPUs; otherwise gloo, with ranks sharing the GPUs round-robin when there are any (so the
CP=4 GPU tests run on one or two GPUs: gloo moves CUDA tensors through host memory, which changes
the transport, not the numbers), or on the CPU.
On the CPU the ranks fork from one server process that has imported torch, megatron-core and fla once
(multiprocessing's forkserver): each rank is still a fresh process with the caller's environment, without
seconds of imports per rank. With CUDA they start by ``spawn`` (CUDA does not survive a fork).
``KCP_RANK_TIMEOUT=S`` makes a rank that is still running after S seconds print its stacks and exit.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now on 127.0.0.1, for a rendezvous (processes started side by side each get their own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process(rank: int, world_size: int, port: int, device_type: str | None = None) -> torch.device:
    """One rank's rendezvous on localhost and process group: gloo on the CPU; on GPUs NCCL with a GPU
    per rank, or gloo with ranks sharing the GPUs round-robin when there are fewer. Its device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        return torch.device("cpu")
    ngpu = torch.cuda.device_count()
    device = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(device)
    if world_size <= ngpu:
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        gloo_accepts_stacked_all_gather()
    return device


# third-party imports a rank would repeat (megatron_kcp itself is not: each rank imports it in the caller's
# environment); a module that is not installed is skipped (transformers is a test extra: the data path's tokenizer)
_PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "fla", "megatron.core.ssm.gated_delta_net",
            "megatron.core.models.gpt.gpt_model", "megatron.training", "transformers"]


def _start_method() -> str:
    if torch.cuda.is_available():
        return "spawn"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return "forkserver"


def _worker(rank, world_size, port, tp, pp, fn, args, errors, env=None):
    if env is not None:             # a forked rank has the server's environment and output: take the caller's
        os.environ.clear()
        os.environ.update({k: v for k, v in env.items() if k != "_KCP_CALLER_PID"})
        for fd in (1, 2):           # the caller's stdout and stderr (pytest's capture files among them), appended to
            out = os.open(f"/proc/{env['_KCP_CALLER_PID']}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
            os.dup2(out, fd)
            os.close(out)
    if os.environ.get("KCP_RANK_TIMEOUT"):      # dump every thread's stack if a rank stalls
        faulthandler.dump_traceback_later(float(os.environ["KCP_RANK_TIMEOUT"]), exit=True)
    if os.environ.get("KCP_FAST_AUTOTUNE"):
        from megatron_kcp.testing.fast_autotune import enable
        enable()
    # ranks share the cores: torch's default intra-op threads per rank oversubscribe them, and the
    # small fp64 reference ops then spend their time switching threads
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_process(rank, world_size, port)
    from megatron.core import parallel_state as ps
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=world_size // (tp * pp))
        fn(*args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def gloo_accepts_stacked_all_gather():
    """fla gathers into an output of shape [W, *input.shape]; NCCL takes any output of W times the
    input's elements, gloo only [W * input.shape[0], ...]. Same bytes, so give gloo that view."""
    gather = dist.all_gather_into_tensor

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        if input.dim() and output.dim() == input.dim() + 1:
            output = output.view(-1, *input.shape[1:])
        return gather(output, input, group=group, async_op=async_op)

    dist.all_gather_into_tensor = all_gather_into_tensor


def spawn(fn, world_size: int, *args, tp: int = 1, pp: int = 1):
    method = _start_method()
    errors = mp.get_context(method).SimpleQueue()
    try:
        env = {**os.environ, "_KCP_CALLER_PID": str(os.getpid())} if method == "forkserver" else None
        mp.start_processes(_worker, args=(world_size, free_port(), tp, pp, fn, args, errors, env),
                           nprocs=world_size, join=True, start_method=method)
    except mp.ProcessRaisedException:
        raise AssertionError(errors.get() if not errors.empty() else "a rank failed") from None


def on_rank0_for_all(fn):
    """``fn()`` computed once, on rank 0 with every core of the host, and sent to the other ranks (inside
    ``spawn``). For work that is the same on every rank, such as the GPU tests' fp64 reference on the
    CPU: a copy a rank would take W times the host's cores and memory, and a block of hundreds of
    documents in fp64 needs gigabytes."""
    out = [None]
    if dist.get_rank() == 0:
        threads = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count() or 1)
        try:
            out[0] = fn()
        finally:
            torch.set_num_threads(threads)
    dist.broadcast_object_list(out, src=0)
    return out[0]


def rel_err(a: torch.Tensor, b: torch.Tensor, rms_floor: float = 0.0) -> float:
    """||a - b|| / ||b||, in fp64. With ``rms_floor``, ||b|| counts as at least that RMS: a gradient
    that is zero in exact arithmetic (a 1-token sequence's gate) is then compared in absolute terms,
    where its low-precision value is rounding noise and a relative error means nothing."""
    a, b = a.double(), b.double()
    scale = max(b.norm().item(), rms_floor * b.numel() ** 0.5, 1e-30)
    return (a - b).norm().item() / scale
