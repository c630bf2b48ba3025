"""The diagnostic behind gdn_tp2_diagnosis.txt (third session, call 3), kept as it ran then:
    source .devbundle/setup.sh && PYTHONPATH=$PWD python docs/gpu_runs/2026-11-22-s3-h200x2/diag_gdn_tp2.py
GDN mixer at TP=2 (SP on and off) against the TP=1 reference: each rank's out_proj input against its
reference's heads, and the TP-summed output against the reference output. Since then the harness
broadcasts the reference from rank 0 (compare_tp_cp); this script builds its references without that,
as the test did when the mismatch was seen."""
import os, sys, torch
sys.path.insert(0, os.getcwd())
from tests.distributed import spawn, rel_err


def run(sp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from tests.layers import harness as h
    shape = h.GPU if torch.cuda.is_available() else h.CPU
    r = dist.get_rank()
    print(r, "prec", torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, flush=True)
    ref = h.build("gdn", h.config("gdn", shape), h.solo_pg(), shape.device)
    gen = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(shape.seq, shape.batch, shape.hidden, generator=gen).to(shape.device) for _ in range(2))
    cap = {}
    ref.out_proj.register_forward_pre_hook(lambda m, a: cap.__setitem__("ref_in", a[0].detach().clone()))
    ref.out_norm.register_forward_hook(lambda m, a, o: cap.__setitem__("ref_norm", o.detach().clone()))
    y_ref, _ = ref(x)
    cfg = h.config("gdn", shape, 1, 2, sequence_parallel=sp)
    mod = h.build("gdn", cfg, ProcessGroupCollection.use_mpu_process_groups(), shape.device)
    mod.load_state_dict(h.tp_shard("gdn", mod, ref.state_dict(), ps.get_tensor_model_parallel_rank(), 2))
    mod.out_proj.register_forward_pre_hook(lambda m, a: cap.__setitem__("in", a[0].detach().clone()))
    mod.out_norm.register_forward_hook(lambda m, a, o: cap.__setitem__("norm", o.detach().clone()))
    y, _ = mod(h.local_input(x, sp))
    tp = ps.get_tensor_model_parallel_rank()
    V = ref.value_head_dim
    ref_in = cap["ref_in"].view(shape.seq, shape.batch, -1, V)[:, :, 2 * tp:2 * tp + 2].reshape(shape.seq, shape.batch, -1)
    print(r, "sp", sp, "out_proj input vs ref heads", rel_err(cap["in"], ref_in), flush=True)
    rn = cap["ref_norm"].view(shape.seq, shape.batch, -1, V)[:, :, 2 * tp:2 * tp + 2].reshape(-1, V)
    print(r, "norm out vs ref", rel_err(cap["norm"].reshape(-1, V), rn), cap["norm"].shape, cap["ref_norm"].shape, flush=True)
    part = cap["in"] @ mod.out_proj.weight.t()
    dist.all_reduce(part, group=ps.get_tensor_model_parallel_group())
    print(r, "manual allreduce y vs ref", rel_err(part, y_ref), flush=True)
    yl = h.local_input(y_ref, sp)
    print(r, "module y vs ref", rel_err(y, yl), flush=True)
    err = (y - yl).norm(dim=-1).flatten()
    print(r, "row err: worst rows", err.topk(8).indices.tolist(), "frac rows > 1e-3*mean:", (err > 1e-3 * yl.norm(dim=-1).mean()).float().mean().item(), flush=True)
    print(r, "weight shard equal", torch.equal(mod.out_proj.weight, ref.out_proj.weight.chunk(2, 1)[tp]), flush=True)


if __name__ == "__main__":
    for sp in (True, False):
        spawn(run, 2, sp, tp=2)
