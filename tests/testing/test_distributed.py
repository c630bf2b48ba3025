"""The multi-process test harness (``megatron_kcp.testing.distributed``)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_kcp.testing.distributed import on_rank0_for_all, spawn


def _rank0_result_reaches_every_rank():
    calls = []

    def fn():
        calls.append(dist.get_rank())
        return {"rank": dist.get_rank(), "x": torch.arange(3.0)}
    threads = torch.get_num_threads()
    out = on_rank0_for_all(fn)
    assert calls == ([0] if dist.get_rank() == 0 else []), calls
    assert out["rank"] == 0 and torch.equal(out["x"], torch.arange(3.0)), out
    assert torch.get_num_threads() == threads


def test_on_rank0_for_all_runs_once_and_every_rank_gets_its_result():
    spawn(_rank0_result_reaches_every_rank, 2)
