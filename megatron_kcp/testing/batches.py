"""Megatron's micro batches of documents for tests: made by megatron-core's ``GPTDataset`` and cut by its own
functions, as ``pretrain_gpt.py`` cuts them (run inside :func:`megatron_kcp.testing.distributed.spawn` ranks).

    samples = gpt_samples(prefix, seq=256, count=2)                  # GPTDataset(inter_document_masking=True)
    batch = megatron_cut(samples, "zigzag")                           # --dataloader-inter-document-masking
    batch = megatron_cut(padded_per_document(samples, 2 * cp), "zigzag_per_doc")     # --sft's cut

``megatron_cut`` runs ``get_batch_on_this_tp_rank``, ``flatten_batch_for_packed_sequences`` and
``get_batch_on_this_cp_rank``; its batch carries ``positions``, the global stream position of each of this
rank's tokens, cut by the same call.
"""
from __future__ import annotations

import torch

KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "cu_seqlens_padded",
        "max_seqlen")


def gpt_samples(prefix: str, seq: int, count: int, vocab_size: int = 512, seed: int = 1234) -> list[dict]:
    """``count`` samples of ``seq`` tokens from megatron-core's ``GPTDataset`` over the indexed dataset
    ``prefix`` with ``inter_document_masking`` (each sample's ``cu_seqlens``: its documents' raw lengths).

    Args:
        prefix: an indexed dataset (``PREFIX.bin``/``.idx``) whose token ids are below ``vocab_size``.
        seq: the sequence length.
        count: the number of samples.
        vocab_size: the vocabulary of Megatron's NullTokenizer that reads it.
        seed: GPTDataset's shuffle seed.

    Returns:
        The samples (dicts of tensors), as Megatron's data loader yields them one by one.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null-text"}, vocab_size=vocab_size)
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=([prefix], None), split="1,0,0",
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False, inter_document_masking=True)
    dataset = BlendedMegatronDatasetBuilder(GPTDataset, [count, 0, 0], lambda: True, config).build()[0]
    return [dataset[i] for i in range(count)]


def documents(sample: dict) -> list[int]:
    """The document lengths of a sample (its ``cu_seqlens`` without GPTDataset's trailing fill)."""
    cu = sample["cu_seqlens"].tolist()
    end = cu.index(cu[-1]) + 1
    return [b - a for a, b in zip(cu[:end - 1], cu[1:end])]


def padded_per_document(samples: list[dict], multiple: int) -> list[dict]:
    """The samples as ``--sft``'s SFTDataset lays them out: every document padded to a multiple of ``multiple``
    (2 * CP) in ``cu_seqlens`` itself, the sample cut at its length (the last document's end)."""
    out = []
    for sample in samples:
        seq = sample["tokens"].shape[0]
        cu = [0]
        for n in documents(sample):
            cu.append(min(seq, cu[-1] + -(-n // multiple) * multiple))
            if cu[-1] == seq:
                break
        if cu[-1] != seq:
            cu.append(seq)
        if (cu[-1] - cu[-2]) % multiple:
            raise ValueError(f"the last document of {cu[-1] - cu[-2]} tokens: choose a sequence length that "
                             f"divides by {multiple}")
        filled = torch.full((seq + 1,), seq, dtype=torch.int32)
        filled[:len(cu)] = torch.tensor(cu, dtype=torch.int32)
        lens = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
        out.append({**sample, "cu_seqlens": filled, "max_seqlen": lens.max().to(torch.int32)})
    return out


def thd_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int) -> torch.Tensor:
    """TransformerEngine's ``tex.thd_get_partitioned_indices``, which megatron-core's per-document cut calls,
    for the CPU: the stream rows of chunks ``rank`` and ``2W-1-rank`` of every document of ``cu_seqlens``."""
    cu = cu_seqlens.tolist()
    rows = []
    for a, b in zip(cu, cu[1:]):
        if (b - a) % (2 * world_size):
            raise ValueError(f"document [{a}, {b}) is not a multiple of 2 * CP = {2 * world_size}")
        c = (b - a) // (2 * world_size)
        rows += [torch.arange(a + i * c, a + (i + 1) * c) for i in (rank, 2 * world_size - 1 - rank)]
    return torch.cat(rows).to(cu_seqlens.device)


def megatron_cut(samples: list[dict], layout: str) -> dict:
    """One micro batch of ``samples`` cut for this rank by megatron-core 0.19, as pretrain_gpt.py does with
    ``--dataloader-inter-document-masking`` (``layout="zigzag"``: the flattened stream cut into 2 * CP
    chunks) or ``--sft`` (``"zigzag_per_doc"``: each document cut). Returns the batch dict (:data:`KEYS`,
    ``cu_seqlens`` flattened to ``[1, n]``) and ``positions``: the global stream position of each local token."""
    from megatron.core import parallel_state as ps
    from megatron.core import utils

    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()                       # the TP broadcast sizes its buffers on the current CUDA device
    if layout not in ("zigzag", "zigzag_per_doc"):
        raise ValueError(f"layout {layout!r}: zigzag (--dataloader-inter-document-masking) or zigzag_per_doc (--sft)")
    seq = samples[0]["tokens"].shape[0]
    batch = torch.utils.data.default_collate(samples)
    batch = {k: batch.get(k) for k in KEYS}
    batch = utils.get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=True, is_hybrid_cp=False, create_attention_mask_in_dataloader=False,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
        broadcast_group=ps.get_tensor_model_parallel_group(), cp_size=ps.get_context_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        micro_batch_size=len(samples), seq_length=seq, mtp_on_this_rank=False)
    batch = utils.flatten_batch_for_packed_sequences(batch)
    saved = utils.tex
    if utils.tex is None:                       # the per-document cut calls TransformerEngine's index kernel
        utils.tex = type("tex", (), {"thd_get_partitioned_indices": staticmethod(thd_partitioned_indices)})
    try:
        def cut(b):
            return utils.get_batch_on_this_cp_rank(dict(b), is_hybrid_cp=False,
                                                   cp_group=ps.get_context_parallel_group(),
                                                   use_per_sequence_balancing=layout == "zigzag")
        where = cut({**batch, "tokens": torch.arange(batch["tokens"].numel())[None]})["tokens"][0]
        batch = cut(batch)
    finally:
        utils.tex = saved
    return {**batch, "positions": where}


def packed_seq_params(batch: dict, seq: int):
    """The THD ``PackedSeqParams`` pretrain_gpt.py builds from the batch (``megatron_kcp.train``'s)."""
    from megatron_kcp.train import packed_seq_params as build
    return build(batch, seq)
