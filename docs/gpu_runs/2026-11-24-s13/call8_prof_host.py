"""Host time of one rank's cut step (one H200): cProfile of fwd+bwd, GDN H=16, 16k tokens, W=1 cut 2048."""
import cProfile
import os
import pstats
import time

import torch

os.environ.setdefault("FLA_FLASH_QLA", "0")
from benchmarks.common import fresh_leaves, problem  # noqa: E402
from megatron_kcp.ops import kcp  # noqa: E402
from megatron_kcp.parallel.plan import build_plan  # noqa: E402

for T, cut in ((16384, 2048), (16384, 0)):
    xs, do = problem("GDN", T, 16, 128, torch.bfloat16, torch.device("cuda"), seed=1)
    plan = build_plan((0, T), "contiguous", 1, 0, 4)
    leaves = fresh_leaves(xs)
    strategy = "gather" if cut else "relay"
    backend = "qla" if cut else "fla"

    def step():
        o = kcp.gated_delta_rule(*leaves, plan, None, use_qk_l2norm=True, backend=backend, strategy=strategy,
                                 max_segment=cut)
        torch.autograd.grad(o, leaves, do)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    host = (time.perf_counter() - t0) / 20
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 20
    print(f"== T={T} backend={backend} cut={cut}: host {host * 1e3:.2f} ms a step (launches done), wall {wall * 1e3:.2f} ms")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        step()
    pr.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(22)
