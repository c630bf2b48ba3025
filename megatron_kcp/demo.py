"""CPU demonstration: a tiny GDN or KDA language model trained with KCP over gloo ranks.

Every step prints the loss of the CP run next to the same model trained on one process; the
two agree to fp32 rounding because KCP computes exactly the single-device function.

    python -m megatron_kcp.demo --cp 2 --model kda --steps 5
"""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from megatron_kcp.ops import kcp
from megatron_kcp.plan import build_plan, check_cu_seqlens, local_token_index

CONV = 4        # the short conv's kernel size


class TinyDeltaLM(torch.nn.Module):
    """embed -> short conv on q/k/v -> gated delta rule -> out proj -> head, one layer."""

    def __init__(self, vocab=64, hidden=32, heads=2, head_dim=16, conv=CONV, kda=False):
        super().__init__()
        self.heads, self.dk, self.kda = heads, head_dim, kda
        d = heads * head_dim
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * d, bias=False)
        self.conv = torch.nn.Parameter(torch.randn(3 * d, conv) * 0.3)
        self.gate = torch.nn.Linear(hidden, heads * (head_dim if kda else 1) + heads)
        self.out = torch.nn.Linear(d, hidden, bias=False)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens, plan, group):
        x = self.embed(tokens)                                          # [1, T, hidden]
        T, H, K = x.shape[1], self.heads, self.dk
        qkv = kcp.causal_conv1d(self.qkv(x), self.conv, plan=plan, group=group)
        q, k, v = (t.view(1, T, H, K) for t in qkv.chunk(3, -1))
        gb = self.gate(x)
        g = F.logsigmoid(gb[..., :-H]).view(1, T, H, *((K,) if self.kda else ()))
        beta = gb[..., -H:].sigmoid()
        o = kcp.gated_delta_rule(q, k, v, g, beta, plan, group, use_qk_l2norm=True)
        return self.head(x + self.out(o.reshape(1, T, H * K)))


def train(args, plan, group, tokens, labels):
    torch.manual_seed(0)
    model = TinyDeltaLM(kda=args.model == "kda")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    total = plan.num_local_tokens * plan.world_size
    losses = []
    for _ in range(args.steps):
        logits = model(tokens, plan, group)
        loss = F.cross_entropy(logits[0], labels[0], reduction="sum") / total
        opt.zero_grad()
        loss.backward()
        loss = loss.detach()
        if plan.world_size > 1:                 # what Megatron's DDP does over the CP group
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(loss, group=group)
        opt.step()
        losses.append(loss.item())
    return losses


def _data(args):
    gen = torch.Generator().manual_seed(1)
    cu = tuple(args.cu_seqlens)
    tokens = torch.randint(0, 64, (1, cu[-1] + 1), generator=gen)
    return cu, tokens[:, :-1], tokens[:, 1:]


def _rank(rank, args, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.cp)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(context_parallel_size=args.cp)
    cu, tokens, labels = _data(args)
    plan = build_plan(cu, args.layout, args.cp, ps.get_context_parallel_rank(), CONV)
    idx = local_token_index(plan)
    losses = train(args, plan, ps.get_context_parallel_group(), tokens[:, idx], labels[:, idx])
    if rank == 0:
        single = train(args, build_plan(cu, "contiguous", 1, 0, CONV), None, tokens, labels)
        print(f"{args.model.upper()} tiny LM, cu_seqlens={list(cu)}, layout={args.layout}")
        print(f"{'step':>4}  {'loss CP=' + str(args.cp):>12}  {'loss CP=1':>12}  {'rel diff':>9}")
        for i, (a, b) in enumerate(zip(losses, single)):
            print(f"{i + 1:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b) / abs(b):>9.1e}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def check_args(p: argparse.ArgumentParser, args) -> None:
    """Everything the ranks would trip over, checked before they are spawned: ``p.error`` (one line,
    exit 2) naming the fix."""
    if args.cp < 2:
        p.error("--cp must be >= 2 (the CP=1 run is printed beside it)")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1 (the number of training steps)")
    if not 0 < args.lr < float("inf"):
        p.error(f"--lr {args.lr}: must be a positive number (the SGD learning rate)")
    cu = args.cu_seqlens
    if len(cu) < 2:
        p.error(f"--cu-seqlens {' '.join(map(str, cu))}: holds no sequence; give the document boundaries "
                "0 len_0 len_0+len_1 ... (at least two numbers, e.g. --cu-seqlens 0 40 200 256)")
    given = f"--cu-seqlens {' '.join(map(str, cu))}"
    try:
        cu = check_cu_seqlens(cu)
    except ValueError as e:
        p.error(f"{given}: {e}")
    try:
        for rank in range(args.cp):     # every rank's plan (its layout pieces): what each spawned rank builds
            build_plan(cu, args.layout, args.cp, rank, CONV)
    except ValueError as e:
        p.error(f"{given} with --cp {args.cp} --layout {args.layout}: {e}; or change --cu-seqlens, --cp or --layout")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m megatron_kcp.demo", description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2, help="CP ranks (gloo processes), >= 2")
    p.add_argument("--model", choices=("gdn", "kda"), default="gdn")
    p.add_argument("--layout", default="zigzag", choices=("contiguous", "zigzag", "zigzag_per_doc"))
    p.add_argument("--steps", type=int, default=5, help="training steps, >= 1")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate, > 0")
    p.add_argument("--cu-seqlens", type=int, nargs="+", default=[0, 40, 200, 256],
                   help="document boundaries of the packed sequence: 0, then the running total of the document "
                        "lengths; the total a multiple of 2*CP (zigzag) or CP (contiguous), every document "
                        "a multiple of 2*CP (zigzag_per_doc)")
    args = p.parse_args(argv)
    check_args(p, args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.cp)


if __name__ == "__main__":
    main()
