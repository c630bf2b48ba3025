"""Random CP problems shared by the CPU and GPU equivalence tests (same seed -> same case on every rank)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_kcp.parallel.plan import build_plan, local_token_index


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
