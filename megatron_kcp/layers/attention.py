"""Causal softmax core attention with context parallelism, without TransformerEngine.

Megatron's local ``DotProductAttention`` refuses CP > 1 (only ``TEDotProductAttention`` has it), so
the hybrid specs' softmax layers could not run at CP > 1 where TE is missing. ``CPDotProductAttention``
takes the same constructor and forward arguments. Each CP rank holds Megatron's zigzag shard of the
sequence (``get_batch_on_this_cp_rank``: 2W chunks, rank r holds chunks r and 2W-1-r); it all-gathers
K and V (one collective) over the CP group, puts the chunks in global order, and runs torch's
``scaled_dot_product_attention`` for each of its two query chunks against the keys up to that chunk's
end, with a lower-right causal mask (flash / memory-efficient kernels on GPU). Backward reduce-scatters
the K and V gradients. Memory: every rank holds the full-length K and V of its TP heads. A THD pack, cut
per document (``--sft``) or as one stream (``--dataloader-inter-document-masking``;
:mod:`megatron_kcp.layers.batch` says which), attends each of the rank's pieces of each document to that
document's gathered keys, the documents' causal work: on a GPU in fp16/bf16 one call of torch's varlen
flash attention for all pieces, elsewhere one call a piece.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.utils import is_layer_window_attention
from torch.nn.attention.bias import causal_lower_right

from megatron_kcp.layers.batch import thd_cu_seqlens, thd_layout
from megatron_kcp.parallel.comm import AllGatherSeq


def gather_zigzag(x: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Every rank's zigzag shard ``[s_local, ...]`` -> the global sequence ``[W * s_local, ...]`` in order."""
    g = AllGatherSeq.apply(x, group).view(world_size, 2, x.shape[0] // 2, *x.shape[1:])
    # rank r's halves are global chunks r and 2W-1-r: first halves in rank order, then second halves reversed
    return torch.cat([g[:, 0], g[:, 1].flip(0)]).flatten(0, 1)


def causal_sdpa(q, k, v, dropout_p: float, scale: float):
    """``[b, h, sq, d]`` queries that are the last ``sq`` positions of the ``sk`` keys (lower-right causal).
    A square problem uses ``is_causal`` (any kernel); otherwise torch's ``CausalBias`` picks flash or
    memory-efficient attention when they apply and materialises the mask only when none does."""
    gqa = q.shape[1] != k.shape[1]
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    mask = causal_lower_right(q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)


class CPDotProductAttention(MegatronModule):
    """Drop-in for megatron-core 0.19's local ``DotProductAttention`` (causal self-attention) with CP.

    Inputs ``query [sq, b, np, hn]``, ``key``/``value [sq, b, ng, hn]`` (GQA: ``np`` divisible by ``ng``),
    each the CP rank's zigzag shard; output ``[sq, b, np * hn]``. ``attention_mask`` is ignored: the mask
    is causal by construction, as in TE's causal attention. ``cp_comm_type`` is accepted and ignored
    (the one scheme here is an all-gather of K and V); so are MLA's ``k_channels`` and ``v_channels`` (the
    head dims come with the tensors; MLA passes its ``softmax_scale``).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal or attention_type != "self":
            raise ValueError(f"CPDotProductAttention is causal self-attention only, got attn_mask_type="
                             f"{attn_mask_type}, attention_type={attention_type!r}; use TEDotProductAttention")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} needs TEDotProductAttention or Megatron's "
                             "DotProductAttention (CP=1); CPDotProductAttention has vanilla softmax only")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("sliding-window attention is not supported by CPDotProductAttention; "
                             "use TEDotProductAttention")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        # DotProductAttention divides the scale by layer_number under apply_query_key_layer_scaling and
        # multiplies the scores back by it in its fp32 softmax: the net scale is the unscaled one
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

        self.tp_group = getattr(pg_collection, "tp", None)     # for MegatronModule.sharded_state_dict
        if self.tp_group is None:
            self.tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        cp = getattr(pg_collection, "cp", None)
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_size = config.context_parallel_size
        if self.cp_size > 1:
            if self.cp_group is None:
                raise RuntimeError(f"context_parallel_size={self.cp_size} but no CP process group exists: "
                                   "initialise megatron.core.parallel_state (or pass pg_collection.cp) first")
            if dist.get_world_size(self.cp_group) != self.cp_size:
                raise RuntimeError(f"CP group has {dist.get_world_size(self.cp_group)} ranks, "
                                   f"config.context_parallel_size={self.cp_size}: build the config with the "
                                   "CP size that parallel_state (or pg_collection.cp) was initialised with")

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        if packed_seq_params is not None:
            raise NotImplementedError(f"packed_seq_params with qkv_format={packed_seq_params.qkv_format!r}: "
                                      "CPDotProductAttention takes THD packs or none")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by CPDotProductAttention: install "
                                      "TransformerEngine, whose attention the hybrid specs then use")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"CPDotProductAttention is causal only, got attn_mask_type={attn_mask_type}")
        sq, b = query.shape[:2]
        # [s, b, h, d] -> [b, h, s, d], the layout of scaled_dot_product_attention
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.cp_size == 1:
            pieces = [(q, key.shape[0])]                 # queries are the last sq of sk positions (KV cache)
        else:
            if sq % 2 or key.shape[0] != sq:
                raise ValueError(f"query/key lengths {sq}/{key.shape[0]}: with CP both must be the rank's zigzag "
                                 "shard, and the sequence must divide by 2 * CP")
            rank, c = dist.get_rank(self.cp_group), sq // 2
            # K and V travel in one all-gather (one reduce-scatter back)
            kv = gather_zigzag(torch.cat([key, value], -1), self.cp_group, self.cp_size).permute(1, 2, 0, 3)
            k, v = kv.split([key.shape[-1], value.shape[-1]], -1)
            # query chunk j (global) sees the keys of chunks 0..j
            pieces = [(q[:, :, :c], (rank + 1) * c), (q[:, :, c:], (2 * self.cp_size - rank) * c)]

        dropout_p = self.dropout_p if self.training else 0.0
        # as DotProductAttention: without SP, dropout draws from the model-parallel RNG
        use_tracker = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if use_tracker else contextlib.nullcontext():
            out = torch.cat([causal_sdpa(qc, k[:, :, :end], v[:, :, :end], dropout_p, self.softmax_scale)
                             for qc, end in pieces], dim=2)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _packed(self, query, key, value, packed_seq_params):
        """A THD pack (Megatron squeezes its batch dim: ``[t, heads, d]``): each rank's tokens in the CP layout
        Megatron cut them in (:func:`megatron_kcp.layers.batch.thd_layout`; all of them at CP = 1); each
        query attends to the keys of its own document up to itself. Keys and values are all-gathered and
        put in stream order; each of this rank's pieces of a document then attends, lower-right causal,
        to its document's keys up to the piece's end: the work of the documents' own causal attention,
        one call a piece. Returns ``[t, heads * d]``, as TE's THD attention (megatron-core's MLA trims its
        padded value heads from that shape)."""
        cu, layout = thd_cu_seqlens(packed_seq_params), thd_layout(packed_seq_params, self.cp_size)
        rank = dist.get_rank(self.cp_group) if self.cp_size > 1 else 0
        pieces, order = _pack_pieces(cu, layout, self.cp_size, rank, str(query.device))
        t = sum(e - s for s, e, _ in pieces)
        if query.dim() != 3 or query.shape[0] != t:
            raise ValueError(f"THD query {tuple(query.shape)}: expected [{t}, heads, head_dim] (this rank's "
                             f"tokens of the {cu[-1]}-token pack)")
        kv = torch.cat([key, value], -1)
        if self.cp_size > 1:
            kv = AllGatherSeq.apply(kv, self.cp_group).index_select(0, order)
        q = query.transpose(0, 1)[None]                                          # [1, heads, t, d]
        k, v = kv.transpose(0, 1)[None].split([key.shape[-1], value.shape[-1]], -1)
        dropout_p = self.dropout_p if self.training else 0.0
        use_tracker = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if use_tracker else contextlib.nullcontext():
            out = attend_pieces(q, k, v, pieces, dropout_p, self.softmax_scale)
        return out[0].transpose(0, 1).reshape(query.shape[0], -1)         # as TE's THD attention returns it


def attend_pieces(q, k, v, pieces, dropout_p: float, scale: float) -> torch.Tensor:
    """Each piece's queries against its document's keys up to the piece's end, lower-right causal.

    On a GPU in fp16/bf16 without dropout, one call of torch's varlen flash attention covers every
    piece (:func:`_attend_varlen`); elsewhere one ``scaled_dot_product_attention`` call a piece (the
    semantics both share; a pack of hundreds of documents makes hundreds of calls).

    Args:
        q: ``[1, heads, t, d]``, the rank's queries in local order (the pieces one after another);
        k, v: ``[1, kv_heads, T, d]``, the whole pack's keys and values in stream order;
        pieces: ``(start, end, document start)`` in the stream, in local order.
    Returns:
        ``[1, heads, t, d]``.
    """
    if _varlen_applies(q, v, dropout_p):
        return _attend_varlen(q, k, v, pieces, scale)
    outs, at = [], 0
    for s, e, start in pieces:      # queries [s, e) of the document that starts at ``start``
        outs.append(causal_sdpa(q[:, :, at:at + e - s], k[:, :, start:e], v[:, :, start:e], dropout_p, scale))
        at += e - s
    return torch.cat(outs, 2)


def _varlen_applies(q: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """torch's varlen flash attention runs this: CUDA, fp16/bf16, no dropout, one head dim (MLA's value head
    dim differs from its query's) that flash takes."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and dropout_p == 0.0):
        return False
    if v.shape[-1] != q.shape[-1]:
        return False
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch >= 2.10)
    except ImportError:
        return False
    return True


def _attend_varlen(q, k, v, pieces, scale: float) -> torch.Tensor:
    """:func:`attend_pieces` in one varlen flash-attention call: the pieces' queries are already one
    after another; each piece's keys (its document's, up to the piece's end) are gathered into a
    packed key stream, so a document's pieces each get their own copy of the keys they share
    (about (2W + 1) / 2W of the keys at CP = W). Flash aligns a causal mask of ``sq < sk`` at the
    lower right, with ``window_size=(-1, 0)``. GQA heads are repeated to the query heads."""
    from torch.nn.attention.varlen import varlen_attn
    rows, cu_q, cu_k, max_q, max_k = _varlen_index(pieces, str(q.device))
    k, v = (x[0].transpose(0, 1).index_select(0, rows) for x in (k, v))            # [sum keys, kv_heads, d]
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    out = varlen_attn(q[0].transpose(0, 1).contiguous(), k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                      window_size=(-1, 0))
    return out.transpose(0, 1)[None]


@functools.lru_cache(maxsize=64)
def _varlen_index(pieces, device: str):
    """(the stream rows of every piece's keys, in piece order; the queries' and keys' cumulative lengths
    (int32); the longest query and key run), on ``device``."""
    rows = torch.cat([torch.arange(start, e) for _, e, start in pieces]).to(device)
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    lq, lk = [e - s for s, e, _ in pieces], [e - start for _, e, start in pieces]
    cum = (lambda xs: [0, *torch.tensor(xs).cumsum(0).tolist()])
    return rows, i32(cum(lq)), i32(cum(lk)), max(lq), max(lk)


@functools.lru_cache(maxsize=64)
def _pack_pieces(cu: tuple[int, ...], layout: str, world_size: int, rank: int, device: str):
    """This rank's pieces of a THD pack in CP layout ``layout``, in local order: its plan's segments (cut
    at document edges), as ``(start, end, document start)`` in the stream; and (``world_size`` > 1) the gathered rows'
    order: for each stream position, its row among the ranks' rows all-gathered in rank order (on
    ``device``, copied once; None at one rank)."""
    from megatron_kcp.plan import all_plans, local_token_index
    plans = all_plans(cu, layout, world_size)
    p = plans[rank]
    pieces = tuple((s, s + b - a, cu[d]) for s, a, b, d in zip(p.seg_start, p.cu_seqlens, p.cu_seqlens[1:], p.seg_seq))
    order = torch.argsort(torch.cat([local_token_index(p) for p in plans])).to(device) if world_size > 1 else None
    return pieces, order


class KCPSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` that rotates a THD pack cut as one stream right.

    megatron-core's THD RoPE under CP reads a rank's tokens as every document cut into 2 * CP chunks
    (``--sft``); on the whole stream cut into 2 * CP chunks (``--dataloader-inter-document-masking``) it
    splits the tokens at the wrong places (an error where a document is not a multiple of CP, wrong
    positions where it is). There this module rotates q and k itself, each token at its position in its
    document (:func:`stream_rope`), and hands the parent no rotary embedding; everything else is the parent's.
    """

    _rope = None            # (q, k) frequencies of this rank's tokens, for the forward in flight

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None, **kwargs):
        rope = stream_rope(rotary_pos_emb, packed_seq_params, self.pg_collection.cp)
        if rope is None:
            return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)
        self._rope = rope
        try:
            return super().forward(hidden_states, *args, rotary_pos_emb=None, packed_seq_params=packed_seq_params,
                                   **kwargs)
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._rope is None:
            return out
        (q, k, *rest), (fq, fk) = out, self._rope        # [s, b, heads, d], after any q/k norm
        rotate = functools.partial(apply_rotary_pos_emb, config=self.config, mscale=self._yarn_concentration_factor,
                                   cp_group=self.pg_collection.cp)
        return (rotate(q, fq) if fq is not None else q, rotate(k, fk) if fk is not None else k, *rest)


def stream_rope(rotary_pos_emb, packed_seq_params, cp_group):
    """(q, k) rotary frequencies ``[t, 1, 1, d]`` of this rank's tokens of a THD pack cut as one stream at
    CP > 1, each token's row at its position in its document; None for every other batch (the parent's
    RoPE is right there)."""
    if rotary_pos_emb is None or packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None
    if cp_group.size() == 1 or thd_layout(packed_seq_params, cp_group.size()) != "zigzag":
        return None
    freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
    device = next(f for f in freqs if f is not None).device
    rows = _in_document_positions(thd_cu_seqlens(packed_seq_params), cp_group.size(), cp_group.rank(), str(device))
    return tuple(None if f is None else f.index_select(0, rows) for f in freqs)


@functools.lru_cache(maxsize=64)
def _in_document_positions(cu: tuple[int, ...], world_size: int, rank: int, device: str) -> torch.Tensor:
    """Each of this rank's tokens' position in its document, the stream cut zigzag (on ``device``, built once)."""
    from megatron_kcp.plan import all_plans
    p = all_plans(cu, "zigzag", world_size)[rank]
    return torch.cat([torch.arange(s - cu[d], s - cu[d] + b - a) for s, a, b, d in
                      zip(p.seg_start, p.cu_seqlens, p.cu_seqlens[1:], p.seg_seq)]).to(device)


class KCPMLASelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with two of its configs read as Hugging Face's MLA models mean them.

    * ``config.no_rope_freq`` (``--no-rope-freq``) is honoured as megatron-core's ``SelfAttention`` honours it
      (its MLA rotates every layer). A layer the pattern marks is NoPE (Kimi Linear's MLA layers): its rotary
      frequencies are zero, so q and k keep their values (both take the same reordering of their rotary
      dims, which leaves every score as it is).
    * ``qk_layernorm`` without ``q_lora_rank`` (Kimi Linear, DeepSeek-V2-Lite) normalises the compressed KV
      only, and q is projected from the layer's input as it is; megatron-core 0.19 would put a second norm
      on that input, fused into ``linear_q_proj``.
    """

    def _resolve_qk_norm_config(self, submodules):
        if not (self.config.qk_layernorm and self.config.q_lora_rank is None):
            return super()._resolve_qk_norm_config(submodules)
        return {"linear_q_proj": submodules.linear_q_proj, "linear_q_up_proj": IdentityOp,
                "linear_kv_up_proj": submodules.linear_kv_up_proj, "q_layernorm": IdentityOp,
                "kv_layernorm": submodules.kv_layernorm or IdentityOp}

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if config.no_rope_freq and config.no_rope_freq[self.layer_number - 1]:
            if config.rope_type != "rope":
                raise ValueError(f"layer {self.layer_number}: a NoPE MLA layer (--no-rope-freq) with --rope-type "
                                 f"{config.rope_type}, whose mscale changes the softmax scale; use --rope-type rope")
            self.rotary_pos_emb.inv_freq = torch.zeros_like(self.rotary_pos_emb.inv_freq)
