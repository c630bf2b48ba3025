"""Megatron's THD batches (packed documents, PackedSeqParams) through both KCP mixers on CPU ranks."""
from __future__ import annotations

import pytest
import torch

from megatron_kcp.testing.distributed import rel_err, spawn
from megatron_kcp.testing.layers import CPU, build, config, solo_pg


def _thd(model):
    """Megatron's THD batch (packed documents, per-document zigzag over CP, PackedSeqParams): the
    CP=2 mixer equals the CP=1 mixer on the packed stream, which equals each document run alone."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kcp.plan import build_plan, local_token_index
    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    lens = [8, 36, 20]                                      # multiples of 2*CP, as Megatron pads them
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def params(cu):
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    ref = build(model, config(model, CPU), solo_pg())
    x = torch.randn(int(cu[-1]), 1, CPU.hidden, generator=torch.Generator().manual_seed(3))
    y_ref, _ = ref(x, packed_seq_params=params(cu))
    alone = torch.cat([ref(d)[0] for d in x.split(lens, 0)], 0)
    assert rel_err(y_ref, alone) < 1e-5                     # documents do not see each other
    mod = build(model, config(model, CPU, cp), ProcessGroupCollection.use_mpu_process_groups())
    mod.load_state_dict(ref.state_dict())
    idx = local_token_index(build_plan(tuple(cu.tolist()), "zigzag_per_doc", cp, r))
    y, _ = mod(x[idx], packed_seq_params=params(cu))
    assert rel_err(y, y_ref[idx]) < 1e-5


@pytest.mark.parametrize("model", ["gdn", "kda"])
def test_thd_packed_documents(model):
    spawn(_thd, 2, model)


def test_thd_pack_refused_under_cuda_graph_capture():
    """Inside a CUDA graph a THD pack would keep the captured batch's plan for every later batch: the
    layers refuse it with the fix; an [s, b] batch (no pack) plans from its shape and is let through."""
    from unittest import mock

    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_kcp.layers import batch as layout
    cu = torch.tensor([0, 8, 64], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=56, max_seqlen_kv=56)
    assert layout.thd_cu_seqlens(thd) == (0, 8, 64)
    with mock.patch.object(layout, "capturing", return_value=True):
        with pytest.raises(ValueError, match="THD pack inside a CUDA graph.*cuda_graph_modules without 'attn'"):
            layout.thd_cu_seqlens(thd)
        assert layout.thd_cu_seqlens(None) is None
