"""Layer level: KCPGatedDeltaNet and megatron-core's GatedDeltaNet (CP=1 and CP=W, cp2hp), and the
KDA mixer, with the same config and weights; one sequence, fwd+bwd, Megatron's local layers."""
from __future__ import annotations

import torch

from benchmarks.common import rel_err
from benchmarks.table import Table
from benchmarks.timing import Bench


def layers_case(b: Bench, model, T, H, table, solo):
    """The mixers at CP=1 and CP=W with the same weights, fwd+bwd."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    from tests.layers.harness import Shape, build, config, zigzag_rows
    args, W, rank, dev = b.args, b.W, b.rank, b.device
    shape = Shape(hidden=args.hidden, heads=(H, H), head_dim=args.head_dim, seq=T, batch=1, device=dev.type)
    kw = dict(bf16=True, params_dtype=torch.bfloat16) if b.dtype == torch.bfloat16 else {}
    if not b.cuda:
        kw["deterministic_mode"] = True          # megatron's pure-torch GDN path (fla's kernels need CUDA)
    mpu = ProcessGroupCollection.use_mpu_process_groups()
    gen = torch.Generator(device=dev).manual_seed(T + H)
    x, dy = (torch.randn(T, 1, args.hidden, generator=gen, device=dev, dtype=b.dtype) for _ in range(2))
    m = model.lower()
    variants = [("noCP", 1, None), ("kcp", W, None)]
    if model == "GDN":
        variants = [("megatron", 1, GatedDeltaNet), ("noCP", 1, KCPGatedDeltaNet),
                    ("cp2hp", W, GatedDeltaNet), ("kcp", W, KCPGatedDeltaNet)]
    state, y_ref, dx_ref = None, None, None
    for method, cp, cls in variants:
        meta = dict(level="layers", model=model, tokens=T, docs="single", heads=H, method=method,
                    layout="zigzag" if cp > 1 else "-", W=cp)
        try:
            mod = build(m, config(m, shape, cp, **kw), solo if cp == 1 else mpu, dev.type, cls=cls).to(b.dtype)
            if state is None:
                state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mod.state_dict().items()}
            mod.load_state_dict(state)
            local = (lambda t: t) if cp == 1 else (lambda t: zigzag_rows(t, W, rank))
            leaf, dyl = local(x).clone().requires_grad_(), local(dy).contiguous()

            def step():
                for p in [leaf, *mod.parameters()]:
                    p.grad = None
                y, _ = mod(leaf, None)
                y.backward(dyl)
                return y
            y = step().detach()                  # first call: output and input gradient against CP=1's
            if y_ref is None:
                y_ref, dx_ref = y, leaf.grad.clone()
            err = b.max_over_ranks([max(rel_err(y, local(y_ref)), rel_err(leaf.grad, local(dx_ref)))])[0]
            rows = b.rows(meta, lambda pas: step, {"fwd+bwd": leaf.nbytes + dyl.nbytes}, err, ["fwd+bwd"])
        except Exception as e:  # noqa: BLE001 - e.g. megatron's module refusing a config: say why
            rows = b.failed(meta, ["fwd+bwd"], e)
        for r in rows:
            table.add(r)
        mod = step = None                        # free this variant before building the next
        if b.cuda:
            torch.cuda.empty_cache()


def run_layers(b: Bench, table: Table):
    """Every layer-level case of the command line (at the first --heads); --budget skips those left."""
    from megatron.core import parallel_state as ps

    from tests.layers.harness import solo_pg
    args, W = b.args, b.W
    if not b.cuda:
        import megatron.core.ssm.gated_delta_net.common as common

        from megatron_kcp.ops.reference import l2norm
        common.l2norm = l2norm           # fla's l2norm is a Triton kernel; megatron's CPU path needs this one
    ps.initialize_model_parallel(context_parallel_size=W)
    solo = solo_pg()
    for T in args.tokens:
        for model in args.models:
            if b.out_of_time():
                table.skipped(level="layers", model=model, tokens=T, docs="single", heads=args.heads[0], W=W)
                continue
            layers_case(b, model, T, args.heads[0], table, solo)
