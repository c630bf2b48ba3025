"""The mixers on Megatron's own batches of documents (CPU ranks, fp32): GPTDataset with inter-document masking,
cut by megatron-core's get_batch_on_this_tp_rank, flatten_batch_for_packed_sequences and
get_batch_on_this_cp_rank, whole-stream (--dataloader-inter-document-masking) and per document (--sft), equal
to the CP = 1 mixer on the whole stream, forward and every gradient."""
from __future__ import annotations

import pytest
import torch

from megatron_kcp.testing.distributed import spawn
from megatron_kcp.testing.layers import CPU, compare_on_batch

SEQ = 256


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Indexed datasets of documents of odd lengths: short ones (tens to hundreds a sample) and long ones
    (a sample inside one document)."""
    from megatron_kcp.testing.data import build_indexed_dataset, build_tokenizer_dir
    root = tmp_path_factory.mktemp("corpus")
    tok = build_tokenizer_dir(root / "tok")
    g = torch.Generator().manual_seed(0)
    short = (2 * torch.randint(0, 7, (400,), generator=g) + 1).tolist()           # 1 to 13 tokens
    mixed = (2 * torch.randint(2, 60, (60,), generator=g) + 1).tolist()           # 5 to 119 tokens
    return {"short": build_indexed_dataset(root / "short", tok, len(short), short),
            "mixed": build_indexed_dataset(root / "mixed", tok, len(mixed), mixed),
            "long": build_indexed_dataset(root / "long", tok, 3, [3 * SEQ + 1, 2 * SEQ + 3, 5 * SEQ + 7])}


def _on_megatron_batch(model, prefix, seq, mbs, layout, control, want_docs):
    from megatron_kcp.testing.batches import documents, gpt_samples, megatron_cut, padded_per_document
    from megatron.core import parallel_state as ps
    samples = gpt_samples(prefix, seq, mbs)
    if layout == "zigzag_per_doc":
        samples = padded_per_document(samples, 2 * ps.get_context_parallel_world_size())
    docs = sum(len(documents(s)) for s in samples)
    assert want_docs[0] <= docs <= want_docs[1], docs
    compare_on_batch(model, CPU, megatron_cut(samples, layout), seq, control=control)


@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("cp,data,mbs,layout,convert,docs", [
    (2, "mixed", 1, "zigzag", "0", (2, 40)),
    (4, "mixed", 2, "zigzag", "1", (4, 40)),            # two rows flattened, moved to contiguous (whose edges cut)
    (2, "mixed", 1, "zigzag_per_doc", "1", (2, 40)),     # --sft's cut, moved to contiguous
    pytest.param(2, "short", 2, "zigzag", "0", (60, 300), marks=pytest.mark.slow),     # up to 300 documents
    pytest.param(2, "long", 1, "zigzag", "0", (1, 2), marks=pytest.mark.slow),         # inside one document
])
def test_mixer_on_megatron_batches_equals_cp1(model, cp, data, mbs, layout, convert, docs, corpus, monkeypatch):
    """Long-memory gates; with the state exchange or the conv halo off the mixer misses by >= 10x the bound."""
    monkeypatch.setenv("KCP_THD_LAYOUT", layout)
    monkeypatch.setenv("KCP_CONVERT", convert)
    spawn(_on_megatron_batch, cp, model, corpus[data], SEQ, mbs, layout, True, docs)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("cp,data,mbs,layout,convert,docs", [
    (4, "short", 2, "zigzag", "1", (60, 300)),
    (2, "short", 2, "zigzag", "1", (60, 300)),          # contiguous at CP = 2 cuts at the rows' edge: no exchange
    (4, "long", 2, "zigzag", "1", (2, 4)),
    (4, "mixed", 1, "zigzag_per_doc", "0", (2, 40)),
    (2, "short", 1, "zigzag_per_doc", "0", (20, 150)),        # padded to 4 tokens: fewer a row
])
def test_mixer_on_megatron_batches_equals_cp1_more(model, cp, data, mbs, layout, convert, docs, corpus, monkeypatch):
    monkeypatch.setenv("KCP_THD_LAYOUT", layout)
    monkeypatch.setenv("KCP_CONVERT", convert)
    spawn(_on_megatron_batch, cp, model, corpus[data], SEQ, mbs, layout, False, docs)


def _handed(lens):
    """GPTDataset's sample of documents ``lens`` (inter_document_masking: cu_seqlens filled to seq + 1)."""
    seq = sum(lens)
    cu = torch.full((seq + 1,), seq, dtype=torch.int32)
    cu[:len(lens) + 1] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"tokens": torch.zeros(seq, dtype=torch.long), "labels": torch.zeros(seq, dtype=torch.long),
            "loss_mask": torch.ones(seq), "position_ids": torch.arange(seq), "cu_seqlens": cu,
            "max_seqlen": torch.tensor(max(lens), dtype=torch.int32)}


def _silent_case(model, declared):
    """Documents of 8, 36 and 20 tokens, multiples of 2 * CP, cut as one stream: read as the per-document
    zigzag they gave every rank the wrong tokens' states and no error."""
    from megatron_kcp.testing.batches import megatron_cut
    batch = megatron_cut([_handed([8, 36, 20])], "zigzag")
    if declared == "zigzag":
        compare_on_batch(model, CPU, batch, 64, control=True)
        return
    errs = compare_on_batch(model, CPU, batch, 64, check=False)
    assert errs["y"] > 10 * CPU.tol, errs


@pytest.mark.parametrize("model", ["gdn", "kda"])
@pytest.mark.parametrize("declared", ["zigzag", "zigzag_per_doc"])
def test_whole_stream_of_documents_that_divide_by_2cp(model, declared, monkeypatch):
    """The case that ran without error and wrong (relative error ~1) when every THD pack was taken as the
    per-document zigzag: right with the route known; the old assumption (the negative control) misses."""
    monkeypatch.setenv("KCP_THD_LAYOUT", declared)
    spawn(_silent_case, 2, model, declared)


def test_the_kcp_active_line_names_the_cut(monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_kcp.layers.batch import batch_of
    cu = torch.tensor([0, 7, 64], dtype=torch.int32)
    pack = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    monkeypatch.setenv("KCP_THD_LAYOUT", "zigzag")
    whole = batch_of(pack, 32, 1, 2)
    assert whole.describe() == "THD packed documents, zigzag (--dataloader-inter-document-masking)"
    assert whole.moved("contiguous").describe() == whole.describe()           # what Megatron handed over
    monkeypatch.setenv("KCP_THD_LAYOUT", "zigzag_per_doc")
    assert batch_of(pack, 32, 1, 2).describe() == "THD packed documents, zigzag_per_doc (--sft)"
    assert batch_of(None, 32, 2, 2).describe() == "[s, b] rows, zigzag_per_doc"


def _route_from_megatron_args(argv_extra, want):
    import argparse

    from megatron.training import global_vars

    from megatron_kcp.layers.batch import thd_layout
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = torch.tensor([0, 7, 64], dtype=torch.int32)
    pack = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    flags = {"sft": False, "dataloader_inter_document_masking": False, **argv_extra}
    global_vars._GLOBAL_ARGS = argparse.Namespace(**flags)
    try:
        if want is None:
            with pytest.raises(ValueError, match="--dataloader-inter-document-masking.*KCP_THD_LAYOUT=zigzag"):
                thd_layout(pack, 2)
        else:
            assert thd_layout(pack, 2) == want
    finally:
        global_vars._GLOBAL_ARGS = None


@pytest.mark.parametrize("flags,want", [
    ({"dataloader_inter_document_masking": True}, "zigzag"),
    ({"sft": True}, "zigzag_per_doc"),
    ({"sft": True, "dataloader_inter_document_masking": True}, "zigzag_per_doc"),    # pretrain_gpt.py: --sft wins
    ({}, None),
])
def test_the_route_comes_from_megatrons_arguments(flags, want, monkeypatch):
    monkeypatch.delenv("KCP_THD_LAYOUT", raising=False)
    _route_from_megatron_args(flags, want)


def test_thd_layout_unknown_or_conflicting_is_an_error(monkeypatch):
    import argparse

    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.training import global_vars

    from megatron_kcp.layers.batch import batch_of, thd_layout
    cu = torch.tensor([0, 7, 64], dtype=torch.int32)
    pack = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    monkeypatch.delenv("KCP_THD_LAYOUT", raising=False)
    with pytest.raises(ValueError, match="its CP layout is not known.*--sft.*--dataloader-inter-document-masking"):
        thd_layout(pack, 2)
    assert thd_layout(pack, 1) == "contiguous"
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu)
    assert thd_layout(padded, 2) == "zigzag_per_doc"         # TE's convention
    monkeypatch.setenv("KCP_THD_LAYOUT", "stream")
    with pytest.raises(ValueError, match="KCP_THD_LAYOUT='stream': use one of zigzag_per_doc, zigzag"):
        thd_layout(pack, 2)
    monkeypatch.setenv("KCP_THD_LAYOUT", "zigzag_per_doc")
    global_vars._GLOBAL_ARGS = argparse.Namespace(sft=False, dataloader_inter_document_masking=True)
    try:
        with pytest.raises(ValueError, match="--dataloader-inter-document-masking cuts the batch zigzag"):
            thd_layout(pack, 2)
        global_vars._GLOBAL_ARGS.hybrid_context_parallel = True
        with pytest.raises(ValueError, match="--hybrid-context-parallel"):
            thd_layout(pack, 2)
    finally:
        global_vars._GLOBAL_ARGS = None
    monkeypatch.setenv("KCP_THD_LAYOUT", "zigzag")
    with pytest.raises(ValueError, match="multiple of 2 \\* CP = 8 tokens"):
        batch_of(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu[:2], cu_seqlens_kv=cu[:2]), 7, 1, 4)
    with pytest.raises(ValueError, match="flatten_batch_for_packed_sequences"):
        batch_of(pack, 32, 2, 2)


@pytest.mark.parametrize("module,match", [
    ("megatron.core.extensions.transformer_engine", "TransformerEngine's THD attention under CP.*--sft"),
    ("megatron.core.ssm.gated_delta_net.gdn", "megatron-core's GatedDeltaNet.*--sft.*--spec megatron_kcp"),
])
def test_modules_that_take_only_the_per_document_cut_stop_on_the_whole_stream(module, match):
    """TransformerEngine's THD attention (it attends across the wrong tokens on the whole-stream cut, without an
    error) and megatron-core's GatedDeltaNet stop, naming --sft; the specs' own attention and mixers pass."""
    from types import SimpleNamespace

    from megatron_kcp.layers.attention import CPDotProductAttention
    from megatron_kcp.layers.gdn import KCPGatedDeltaNet
    from megatron_kcp.layers.layout import check_whole_stream
    name = "TEDotProductAttention" if "transformer_engine" in module else "GatedDeltaNet"
    foreign = type(name, (), {"__module__": module})()
    mixer = SimpleNamespace(core_attention=foreign) if "transformer_engine" in module else foreign
    with pytest.raises(ValueError, match=match):
        check_whole_stream(mixer, 4)
    check_whole_stream(SimpleNamespace(core_attention=CPDotProductAttention.__new__(CPDotProductAttention)), 4)
    check_whole_stream(KCPGatedDeltaNet.__new__(KCPGatedDeltaNet), 1)
