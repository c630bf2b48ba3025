"""The problem catalogue: model shapes, document sets and the named problems the tables of BENCHMARKS.md run.

A named problem is a command of the tool with its arguments (``python -m benchmarks predict --problem
single-scale``): what the table measured, rerun by name; arguments given after it override its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

VARLEN_32K = (0, 2960, 5212, 9513, 13567, 17443, 20634, 23521, 26281, 31785, 32768)
CONV = 4                                           # conv kernel size the plans carry (halo of 3 tokens)
OP_DOCS = ("single", "varlen", "varlen100")        # the op tables' default sets; cu_seqlens takes any varlenN
DOCS = ("single", "varlen", "varlen100", "varlen300")


@dataclass(frozen=True)
class Shape:
    model: str                  # GDN | KDA
    H: int                      # q/k heads
    HV: int                     # v heads
    K: int                      # head dim (K = V)
    hidden: int = 0             # d_model (0: op level only)
    attn: tuple[int, int, int] = (0, 0, 0)    # softmax attention: q heads, kv heads, head dim


SHAPES = {"qwen3-next": Shape("GDN", 16, 32, 128, 2048, (16, 2, 256)),
          "kimi-linear": Shape("KDA", 32, 32, 128, 2304, (32, 32, 128)),
          "qwen3-next-tp2": Shape("GDN", 8, 16, 128),       # one TP = 2 rank's heads (op level)
          "h64-gdn": Shape("GDN", 64, 64, 128), "h64-kda": Shape("KDA", 64, 64, 128)}
TINY = {"qwen3-next": Shape("GDN", 2, 4, 16, 32, (2, 1, 16)), "kimi-linear": Shape("KDA", 2, 2, 16, 32, (2, 2, 16))}


def _weights(n: int) -> list[float]:
    """``n`` document lengths (log-normal, fixed seed), as fractions of the stream."""
    w = torch.exp(0.8 * torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64))
    return (w.cumsum(0) / w.sum()).tolist()


def cu_seqlens(docs: str, T: int, pad: int = 1) -> tuple[int, ...]:
    """``single``: one sequence; ``varlen``: the 10 documents of VARLEN_32K scaled to T; ``varlen100``,
    ``varlen300``: 100 or 300 log-normal lengths (100: 0.1% to 5% of the stream). Every document is a
    multiple of ``pad`` tokens, as Megatron pads THD documents to 2 x CP for the per-document layout."""
    if docs == "single":
        return (0, T)
    if T % pad:
        raise ValueError(f"T={T} is not a multiple of the padding {pad}")
    if docs == "varlen":
        cu = tuple(round(c * T / VARLEN_32K[-1] / pad) * pad for c in VARLEN_32K)
        if any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"T={T} is too short for the varlen set with padding {pad}: use more --tokens")
        return cu
    frac = _weights(int(docs.removeprefix("varlen")))
    rest = T - len(frac) * pad                     # every document gets ``pad`` tokens, then its share
    if rest < 0:
        raise ValueError(f"T={T} is too short for the {docs} set with padding {pad}: use more --tokens")
    return (0, *((i + 1) * pad + round(f * rest / pad) * pad for i, f in enumerate(frac)))


@dataclass(frozen=True)
class Problem:
    """A named problem: the tool's command and bench that run it, and their arguments."""
    command: str                # run | predict | profile
    bench: str                  # the bench of that command (benchmarks/__main__.py's BENCHES)
    args: tuple[str, ...]
    about: str


_ONE = ("qwen3-next", "qwen3-next-tp2", "h64-gdn", "kimi-linear")
PROBLEMS = {
    "single": Problem("predict", "matrix", (
        "--docs", "single", "--levels", "ops", "--cp", "2", "--shapes", "qwen3-next", "kimi-linear", "--tokens",
        "32768", "131072", "1048576", "--methods", "noCP", "noCP-qla", "cp2hp", "cp2hp-qla", "fla-cp",
        "kcp-unpipelined", "kcp"), "one sequence, op level, W = 2, predicted"),
    "single-scale": Problem("predict", "matrix", (
        "--docs", "single", "--levels", "ops", "--cp", "4", "8", "16", "64", "--shapes", "qwen3-next", "kimi-linear",
        "h64-gdn", "--tokens", "131072", "--methods", "noCP", "noCP-qla", "fla-cp", "kcp-unpipelined", "kcp"),
        "one sequence, op level, W = 4 to 64, predicted"),
    "perdoc128k": Problem("predict", "matrix", (
        "--shapes", "qwen3-next", "kimi-linear", "--tokens", "131072", "--cp", "2", "--methods", "noCP", "noCP-qla",
        "cp2hp", "cp2hp-qla", "mlm-chunkwise", "kcp-noconvert", "kcp"),
        "1 to 300 documents at 128k tokens, W = 2, op, mixer and block level, predicted"),
    "scale": Problem("predict", "matrix", (
        "--shapes", "qwen3-next", "kimi-linear", "--tokens", "131072", "--cp", "4", "8", "16", "64", "--levels", "ops",
        "--methods", "noCP", "noCP-qla", "cp2hp", "mlm-chunkwise", "kcp-noconvert", "kcp"),
        "documents at 128k tokens, W = 4 to 64, op level, predicted"),
    "kda32k": Problem("predict", "matrix", ("--shapes", "kimi-linear", "--tokens", "32768", "--cp", "2"),
                      "Kimi-Linear KDA at 32k tokens, W = 2, predicted"),
    "layouts": Problem("predict", "matrix", (
        "--shapes", "qwen3-next", "kimi-linear", "--tokens", "32768", "131072", "--docs", "varlen100", "--cp", "2",
        "--levels", "ops", "mixer", "--methods", "noCP", "kcp", "--layouts", "zigzag", "zigzag_per_doc",
        "contiguous", "--no-qla"), "the three layouts Megatron hands the layers, predicted"),
    "x2-gdn": Problem("run", "matrix", ("--shapes", "qwen3-next", "--tokens", "32768"),
                      "Qwen3-Next GDN, 1 to 300 documents at 32k tokens, measured on W GPUs"),
    "x2-kda": Problem("run", "matrix", ("--shapes", "kimi-linear", "--tokens", "32768"),
                      "Kimi-Linear KDA, 1 to 300 documents at 32k tokens, measured on W GPUs"),
    "x2-single": Problem("run", "matrix", (
        "--docs", "single", "--levels", "ops", "--shapes", *_ONE, "--tokens", "32768", "131072", "--methods",
        "noCP", "noCP-qla", "cp2hp", "cp2hp-qla", "fla-cp", "kcp-unpipelined", "kcp", "kcp-graph"),
        "one sequence, op level, measured on W GPUs"),
    "layers": Problem("run", "ops", (
        "--what", "layers", "--tokens", "32768", "--heads", "16", "--models", "GDN", "--docs", "single", "--iters",
        "10", "--warmup", "2", "--graph", "megatron", "megatron-qla", "noCP", "cp2hp", "cp2hp-qla", "kcp"),
        "the mixers at CP = 1 and CP = W, eager and captured, measured"),
    "conv": Problem("run", "conv", ("--tokens", "32768", "131072", "--docs", "single", "varlen100"),
                    "the short conv alone, fla's Triton against its Gluon kernels, one GPU"),
    "mixer-cp1": Problem("run", "mixer-cp1", ("--tokens", "32768"),
                         "the GDN mixers at CP = 1 (megatron-core's and ours), one GPU"),
    "layer-cp1": Problem("run", "mixer-cp1", (
        "--layer", "--tokens", "32768", "--heads", "32", "--experts", "512", "--topk", "10", "--moe-ffn", "512",
        "--iters", "10", "--warmup", "3"), "a Qwen3-Next-shaped hybrid layer with MoE at CP = 1, one GPU"),
    "memory": Problem("run", "memory", (
        "--cp", "4", "--tokens", "32768", "--heads", "16", "--layouts", "contiguous", "zigzag", "--warmup", "1"),
        "peak memory per rank of KCP fwd+bwd at CP = 4 beside one GPU"),
    "split": Problem("predict", "host-time", ("--shapes", "qwen3-next", "h64-gdn", "--tokens", "32768", "131072"),
                     "host time against kernel time of one rank's step (add --max-segment 0 or 4096)"),
}
