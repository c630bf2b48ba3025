"""CPDotProductAttention on CPU ranks: Megatron's local DotProductAttention at CP=1, and at CP = 2, 4
each rank's zigzag shard of the output and of dq, dk, dv equals the single-process causal attention."""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from megatron_kcp.testing.distributed import rel_err, spawn

pytestmark = pytest.mark.slow

HEADS, GROUPS, HEAD_DIM, BATCH = 4, 2, 8, 2


def _config(cp: int = 1):
    from megatron.core.transformer import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                             num_query_groups=GROUPS, context_parallel_size=cp, attention_dropout=0.0,
                             use_cpu_initialization=True)


def _build(cfg, cls=None, pg_collection=None):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_kcp.layers.attention import CPDotProductAttention
    return (cls or CPDotProductAttention)(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                          attention_type="self", pg_collection=pg_collection)


def _qkv(seq: int, seed: int = 0):
    """Global q [S, b, np, hn], k, v [S, b, ng, hn] and an output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(HEADS, HEAD_DIM), (GROUPS, HEAD_DIM), (GROUPS, HEAD_DIM), (HEADS * HEAD_DIM,)]
    return tuple(torch.randn(seq, BATCH, *shape, generator=g) for shape in shapes)


def _run(mod, q, k, v, dout, **kw):
    """Output and (dq, dk, dv) of ``mod`` for leaf copies of q, k, v."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = mod(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def _reference(q, k, v, dout):
    """Single-process causal attention, written out (GQA: query head h uses group h // (np / ng))."""
    def attention(q, k, v):
        k, v = (t.repeat_interleave(HEADS // GROUPS, dim=2) for t in (k, v))
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(torch.ones(len(q), len(k), dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).flatten(2)
    return _run(attention, q, k, v, dout)


def _cp1_matches_megatron():
    """(CP = 1) the same function as Megatron's local DotProductAttention, GQA included; THD packs per document."""
    import megatron_kcp.megatron_cpu
    megatron_kcp.megatron_cpu.enable()          # DotProductAttention's score buffer is on the GPU
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    cfg = _config()
    q, k, v, dout = _qkv(12)
    mask = torch.ones(12, 12, dtype=torch.bool).triu(1)[None, None]    # True = masked, as Megatron's
    out_m, grads_m = _run(_build(cfg, cls=DotProductAttention), q, k, v, dout, attention_mask=mask)
    ours = _build(cfg)
    out, grads = _run(ours, q, k, v, dout, attention_mask=None)
    assert rel_err(out, out_m) < 1e-6
    assert all(rel_err(a, b) < 1e-6 for a, b in zip(grads, grads_m))
    with pytest.raises(ValueError, match="cu_seqlens"):
        ours(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    # a THD pack (Megatron squeezes its batch dim): each document attends only to itself
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    pack = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    out = ours(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=pack)
    alone = torch.cat([ours(q[a:b, :1], k[a:b, :1], v[a:b, :1], None) for a, b in ((0, 5), (5, 12))])
    assert out.shape == alone.shape[::2]            # THD: [t, heads * d], as TE returns it
    assert rel_err(out, alone[:, 0]) < 1e-6


def zigzag_rows(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Rows of the global sequence on CP rank ``rank``: chunks r and 2W-1-r of 2W."""
    c = seq // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in (rank, 2 * cp - 1 - rank)])


def _cp_matches_single_process(group, pg_collection=None):
    """Each rank's zigzag shard of the output and of dq, dk, dv equals the single-process rows."""
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = 6 * cp                                         # chunks of 3 tokens
    rows = zigzag_rows(seq, cp, rank)
    megatron_rows = get_batch_on_this_cp_rank({"tokens": torch.arange(seq)[None]}, False, group)["tokens"][0]
    assert torch.equal(rows, megatron_rows)              # the layout Megatron feeds the model
    q, k, v, dout = _qkv(seq, seed=cp)
    out_ref, grads_ref = _reference(q, k, v, dout)
    mod = _build(_config(cp), pg_collection=pg_collection)
    out, grads = _run(mod, q[rows], k[rows], v[rows], dout[rows], attention_mask=None)
    assert rel_err(out, out_ref[rows]) < 1e-5
    # dk, dv: the reduce-scatter sums every rank's contribution to this rank's key rows
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        assert rel_err(g, g_ref[rows]) < 1e-5, name

    # the comparison can fail: contiguous shards (Megatron's layout without load balancing) are misread
    contiguous = torch.arange(rank * 6, (rank + 1) * 6)
    out, _ = _run(mod, q[contiguous], k[contiguous], v[contiguous], dout[contiguous], attention_mask=None)
    assert rel_err(out, out_ref[contiguous]) > 1e-2


def _all_cases():
    """One 4-rank run (process start-up dominates): CP=1 on rank 0, CP=4 over parallel_state's group,
    CP=2 over subgroups {0, 1}, {2, 3} passed as pg_collection.cp."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    if dist.get_rank() == 0:
        _cp1_matches_megatron()
    _cp_matches_single_process(ps.get_context_parallel_group())
    pair, _ = dist.new_subgroups(group_size=2)
    _cp_matches_single_process(pair, ProcessGroupCollection(cp=pair))


def test_cp_attention_matches_single_process():
    spawn(_all_cases, 4)


def test_bad_construction():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_kcp.layers.attention import CPDotProductAttention
    with pytest.raises(ValueError, match="causal self-attention only"):
        CPDotProductAttention(_config(), 1, AttnMaskType.no_mask, "self")
    with pytest.raises(RuntimeError, match="no CP process group"):     # parallel_state not initialised here
        CPDotProductAttention(_config(2), 1, AttnMaskType.causal, "self")


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 32, 128), (16, 2, 256)], ids=["mha", "gqa"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_varlen_flash_equals_per_piece_attention_on_gpu(heads, world_size):
    """A THD pack of 100 documents (bf16): every rank's pieces in one varlen flash call give the
    output and gradients of one ``scaled_dot_product_attention`` call a piece, to bf16 rounding;
    the control, each piece attending to its own rows only (not its document's earlier keys), misses
    by far more."""
    from benchmarks.catalogue import cu_seqlens
    from megatron_kcp.layers import attention
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    hq, hkv, d = heads
    cu = cu_seqlens("varlen100", 8192, 2 * world_size)
    for rank in range(world_size):
        pieces, _ = attention._pack_pieces(cu, "zigzag_per_doc", world_size, rank, "cuda")
        t = sum(e - s for s, e, _ in pieces)
        g = torch.Generator(device="cuda").manual_seed(rank)
        q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for h, n in ((hq, t), (hkv, cu[-1]), (hkv, cu[-1]), (hq, t)))

        def run(varlen: bool, pieces=pieces):
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            with mock.patch.object(attention, "_varlen_applies", lambda *a: varlen):
                o = attention.attend_pieces(*xs, pieces, 0.0, d ** -0.5)
            o.backward(do)
            return [o.detach()] + [x.grad for x in xs]
        want, got = run(False), run(True)
        errs = [rel_err(a.float(), b.float()) for a, b in zip(got, want)]
        assert max(errs) < 1e-2, (rank, errs)
        shifted = tuple((s, e, s) for s, e, _ in pieces)            # every piece sees its own keys only
        assert rel_err(run(True, shifted)[0].float(), want[0].float()) > 0.1
