"""Random CP problems shared by the CPU and GPU equivalence tests (same seed -> same case on every rank)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_kcp.plan import build_plan, local_token_index


def random_cu_seqlens(gen: torch.Generator, layout: str, W: int, kind: str) -> tuple[int, ...]:
    """kind: 'random' cuts, 'single' sequence over all ranks, 'edges' cuts on rank edges, 'tiny' pieces
    shorter than the conv halo."""
    def rint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    if layout == "zigzag_per_doc":
        unit = 2 * W
        lens = [unit * rint(1, 3 if kind == "tiny" else 40) for _ in range(1 if kind == "single" else rint(1, 4))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        return tuple(cu)
    parts = W if layout == "contiguous" else 2 * W
    piece = 1 if kind == "tiny" else rint(20, 90)
    total = parts * piece
    if kind == "single":
        cuts = set()
    elif kind == "edges":
        cuts = {piece * i for i in range(1, parts)} | {rint(1, total - 1)}
    else:
        cuts = {rint(1, total - 1) for _ in range(rint(1, 6))}
    return (0, *sorted(cuts), total)


def random_inputs(gen, T, N, H, HV, K, V, kda: bool, dtype=torch.float32, device="cpu"):
    def rn(*s):
        return torch.randn(*s, generator=gen).to(dtype=dtype, device=device)
    q, k, v = rn(1, T, H, K), rn(1, T, H, K), rn(1, T, HV, V)
    g = F.logsigmoid(rn(1, T, HV, K) if kda else rn(1, T, HV)) * 0.5
    beta = torch.rand(1, T, HV, generator=gen).to(dtype=dtype, device=device)
    h0 = rn(N, HV, K, V)
    return [q, k, v, g, beta, h0]


def shard(plan, *xs):
    idx = local_token_index(plan)
    return [x[:, idx.to(x.device)] for x in xs]


def plan_for(cu, layout, W, rank, ks=4):
    return build_plan(cu, layout, W, rank, ks)


def long_memory_cu(gen: torch.Generator, W: int, piece: int = 140) -> tuple[int, ...]:
    """A packed batch of many documents that every layout can split (lengths multiples of 2W): a long
    document across each of the 2W - 1 zigzag edges (so across every contiguous edge too), and between
    them documents of 1 to 3 times 2W tokens: shorter than a 64-token chunk, and cut by the
    per-document layout into pieces of 1 to 3 tokens, shorter than the conv halo. With ``piece`` =
    140: about 35 documents per zigzag chunk, over 50 per rank in every layout."""
    unit = 2 * W
    P = piece * unit                                    # tokens per zigzag chunk
    reach = (3 * P // 10) // unit * unit                # a long document's part on each side of an edge

    def fill(a, b):                                     # short documents over [a, b)
        out = []
        while a < b:
            n = min(b - a, unit * int(torch.randint(1, 4, (1,), generator=gen)))
            out.append(n)
            a += n
        return out

    lens, pos = [], 0
    for e in range(P, 2 * W * P, P):
        lens += fill(pos, e - reach) + [2 * reach]
        pos = e + reach
    lens += fill(pos, 2 * W * P)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return tuple(cu)


def long_memory_inputs(gen, cu, H, HV, K, V, kda: bool, dtype=torch.float32, device="cpu", block: int = 96,
                       rank: int = 2):
    """Inputs whose state outlives a piece: log-decay about 1e-4 per token, and keys that do not span
    K (each block of ``block`` tokens writes keys from its own ``rank``-dim subspace, so the delta rule
    leaves the rest of the state as earlier blocks wrote it), with full-rank queries reading all of it.
    The state a piece receives is then a large part of its output."""
    T = cu[-1]

    def rn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)
    nb = -(-T // block)
    basis = torch.linalg.qr(rn(nb, H, K, K))[0][..., :rank]                # [nb, H, K, rank] orthonormal
    coef = rn(T, H, rank)
    k = torch.einsum("thkr,thr->thk", basis[torch.arange(T) // block], coef)
    q, v = rn(T, H, K), rn(T, HV, V)
    g = -1e-4 * (0.5 + torch.rand(T, HV, K, generator=gen, dtype=torch.float64))
    g = g if kda else g[..., 0]
    beta = 0.2 + 0.6 * torch.rand(T, HV, generator=gen, dtype=torch.float64)
    return [x[None].to(dtype=dtype, device=device) for x in (q, k, v, g, beta)]


def docs_cu(n: int, W: int, seed: int = 0) -> tuple[int, ...]:
    """``n`` documents of 1 to 12 times 2W tokens (one document: 60 times), as Megatron pads them."""
    gen = torch.Generator().manual_seed(seed)
    lens = [2 * W * 60] if n == 1 else (2 * W * torch.randint(1, 13, (n,), generator=gen)).tolist()
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    return tuple(cu)


def raw_docs_cu(n: int, W: int, seed: int = 0) -> tuple[int, ...]:
    """``n`` documents of odd lengths (1 to 24W - 1 tokens; one document: 120W), the last one stretched to
    a multiple of 2W tokens in all: GPTDataset's raw documents, as --dataloader-inter-document-masking
    packs them (the whole stream cut into 2W chunks)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [2 * W * 60] if n == 1 else (2 * torch.randint(0, 12 * W, (n,), generator=gen) + 1).tolist()
    lens[-1] += -sum(lens) % (2 * W)
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    return tuple(cu)
