"""Distributed checkpoint of the KCP mixers: save at TP=2 x CP=2, load at TP=1 x CP=1 and TP=1 x CP=4."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.layers.attention import gather_zigzag
from megatron_kcp.testing.distributed import rel_err, spawn
from megatron_kcp.testing.layers import CPU, build, config, zigzag_rows

pytestmark = pytest.mark.slow


def _full_output(mod, cp, cp_rank, group):
    x = torch.randn(CPU.seq, CPU.batch, CPU.hidden, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y, _ = mod(zigzag_rows(x, cp, cp_rank))
        return gather_zigzag(y, group, cp)


def _save_or_load(kind, ckpt_dir, out_file, tp, save):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    cp = ps.get_context_parallel_world_size()
    mod = build(kind, config(kind, CPU, cp, tp), ProcessGroupCollection.use_mpu_process_groups())
    if save:
        dist_checkpointing.save(mod.sharded_state_dict(prefix="mixer."), ckpt_dir)
    else:
        for p in mod.parameters():            # nothing of the fresh init may survive the load
            torch.nn.init.normal_(p)
        state = dist_checkpointing.load(mod.sharded_state_dict(prefix="mixer."), ckpt_dir)
        mod.load_state_dict({k.removeprefix("mixer."): v for k, v in state.items()})
    y = _full_output(mod, cp, ps.get_context_parallel_rank(), ps.get_context_parallel_group())
    if dist.get_rank() == 0:
        torch.save(y, out_file)


@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_checkpoint_reshards_over_tp_and_cp(kind, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    ckpt = str(ckpt)
    spawn(_save_or_load, 4, kind, ckpt, str(tmp_path / "y_tp2cp2.pt"), 2, True, tp=2)
    spawn(_save_or_load, 1, kind, ckpt, str(tmp_path / "y_tp1cp1.pt"), 1, False)
    spawn(_save_or_load, 4, kind, ckpt, str(tmp_path / "y_tp1cp4.pt"), 1, False)
    y = {n: torch.load(tmp_path / f"y_{n}.pt") for n in ("tp2cp2", "tp1cp1", "tp1cp4")}
    assert rel_err(y["tp1cp1"], y["tp2cp2"]) < 1e-5
    assert rel_err(y["tp1cp4"], y["tp2cp2"]) < 1e-5
