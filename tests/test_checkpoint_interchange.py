"""Checkpoints interchange between the KCP hybrid and megatron-core's own hybrid (issue #78).

Three builds of one config (GDN 3:1 with gated attention, QK norm and GQA; MoE from layer 2 with a gated
shared expert; RoPE on half the head dims; zero-centred norms):

* ``local``: the KCP hybrid without TransformerEngine, as a CPU user gets it;
* ``te``: the KCP hybrid with TE modules (:mod:`megatron_kcp.testing.te_standin`), as a TE user gets it;
* ``mcore``: megatron-core's ``get_transformer_block_with_experimental_attention_variant_spec``, under the
  same stand-in (megatron-core's GatedDeltaNet with PyTorch references for fla's kernels, which need a GPU).

They give the same ShardedTensors (keys, local and global shapes, offsets); a checkpoint saved by one with
megatron-core's dist checkpointing loads into the others with equal logits, at the same and at other
TP / PP / CP / EP sizes (the slow tier), at megatron-core's default strictness: the local norms that TE keeps
separate write TE's empty ``_extra_state`` (:class:`megatron_kcp.layers.norm.SeparateNorm`), and the KDA mixer's
gathered low-rank factors are local linears under TE too. A key map without the input norm's fused name fails
the interchange (the negative control).
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

from megatron_kcp.testing.distributed import spawn

VOCAB, SEQ, BATCH = 64, 32, 2
TOL = 1e-6          # fp32 logits, relative (measured: 1e-7; 0 between local and TE builds)
EXPERTS = 4


def _config(variant: str | None = None, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, **changes):
    """The config; ``variant``: megatron-core's ``experimental_attention_variant``, which its hybrid needs to
    build GDN (and which then asks TP x CP to divide the key heads, for its all-to-all); ours takes the mixer
    from the spec's name."""
    from megatron_kcp.layers.kda import KDAConfig
    fields = dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=64,
        use_cpu_initialization=True, normalization="RMSNorm", layernorm_zero_centered_gamma=True,
        activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, qk_layernorm=True, attention_output_gate=True, linear_attention_freq=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, moe_layer_freq=[0, 1, 1, 1],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, sequence_parallel=tp > 1, experimental_attention_variant=variant,
        pipeline_dtype=torch.float32 if pp > 1 else None)
    fields.update(changes)
    return KDAConfig(**fields)


# ---------------------------------------------------------------------------------------------------------
# megatron-core's GatedDeltaNet on the CPU: fla's Triton kernels replaced by PyTorch references


def _causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False,
                   cu_seqlens=None, **_):
    """fla's ``causal_conv1d`` on ``[b, s, d]`` without packing."""
    if cu_seqlens is not None or initial_state is not None:
        raise NotImplementedError("the test's conv reference takes whole sequences")
    y = F.conv1d(F.pad(x.transpose(1, 2), (weight.shape[1] - 1, 0)), weight[:, None], bias, groups=x.shape[-1])
    y = y.transpose(1, 2)
    return (F.silu(y) if activation in ("silu", "swish") else y), None


def _chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
    from megatron_kcp.kernels import reference
    return reference.chunk_gated_delta_rule_fp64(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                 output_final_state=output_final_state,
                                                 use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


@contextlib.contextmanager
def megatron_gdn_on_cpu():
    import megatron.core.ssm.gated_delta_net.common as common
    import megatron.core.ssm.gated_delta_net.gdn as gdn

    from megatron_kcp.kernels import reference
    patches = [(gdn, "causal_conv1d", _causal_conv1d), (gdn, "chunk_gated_delta_rule", _chunk_gated_delta_rule),
               (common, "l2norm", reference.l2norm)]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    try:
        for m, n, v in patches:
            setattr(m, n, v)
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


# ---------------------------------------------------------------------------------------------------------
# the builds


def build(build_kind: str, mixer: str = "gdn", **parallel):
    """A GPTModel of the config: ``local``, ``te`` (our hybrid under the TE stand-in) or ``mcore``
    (megatron-core's own hybrid under the stand-in). Keep the returned context open while it runs."""
    import megatron_kcp.megatron_cpu
    megatron_kcp.megatron_cpu.enable()
    from megatron.core.models.gpt import GPTModel

    import megatron_kcp.spec as spec
    from megatron_kcp.testing.te_standin import te_standin
    config = _config("gated_delta_net" if build_kind == "mcore" else None, **parallel)
    stack = contextlib.ExitStack()
    if build_kind in ("te", "mcore"):
        stack.enter_context(te_standin())
    if build_kind == "mcore":
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec)
        stack.enter_context(megatron_gdn_on_cpu())
        layer_spec = get_transformer_block_with_experimental_attention_variant_spec(config)
    else:
        layer_spec = {"gdn": spec.gdn_hybrid_layer_spec, "kda": spec.kda_hybrid_layer_spec}[mixer]
    from megatron.core import parallel_state as ps
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope", rotary_percent=0.5,
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    return model, stack


def checkpoint_entries(model) -> dict:
    """{key: (local shape, global shape, global offset)} of the ShardedTensors, {key: None} of the objects."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
    out = {}

    def visit(x):
        if isinstance(x, ShardedTensorFactory):
            for y in _leaves(x.build()):
                visit(y)
        elif isinstance(x, ShardedTensor):
            out[x.key] = (tuple(x.local_shape), tuple(x.global_shape), tuple(x.global_offset))
        elif isinstance(x, ShardedObject):
            out[x.key] = ("object", tuple(x.global_shape), tuple(x.global_offset))
    for v in _leaves(model.sharded_state_dict()):
        visit(v)
    return out


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def _scramble(model):
    """Nothing of a fresh initialisation may survive a load."""
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def save(model, ckpt):
    from megatron.core import dist_checkpointing
    os.makedirs(ckpt, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt)


def load(model, ckpt, absent_ok=False) -> set:
    """megatron-core's dist checkpointing load into ``model``, then its state dict, strictly but for the TE
    ``_extra_state`` entries no sharded state dict holds (megatron-core's TEDotProductAttention and GPTModel's
    output layer drop theirs). Default strictness, megatron-core's and Megatron-LM's
    (``--dist-ckpt-strictness assume_ok_unexpected``): an entry the model asks for and the checkpoint lacks
    fails the load. ``absent_ok``: such entries are returned (``StrictHandling.RETURN_ALL``) and left as built."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    _scramble(model)
    absent = set()
    if absent_ok:
        state, _, absent = dist_checkpointing.load(model.sharded_state_dict(), ckpt, strict=StrictHandling.RETURN_ALL)
    else:
        state = dist_checkpointing.load(model.sharded_state_dict(), ckpt)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    dropped = ("core_attention._extra_state", "output_layer._extra_state")
    assert all(k.endswith(dropped) or k in absent for k in missing), missing
    return set(absent)


def tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def logits(model) -> torch.Tensor | None:
    """The full logits ``[b, s, vocab]`` of :func:`tokens` on the rank of the last stage that is rank 0 of its
    TP, CP and DP groups (None elsewhere): Megatron's zigzag CP cut, the pipeline run stage by stage, the
    vocab-parallel logits gathered over TP, the sequence over CP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_kcp.layers.attention import gather_zigzag
    cp_group, cp = ps.get_context_parallel_group(), ps.get_context_parallel_world_size()
    batch = get_batch_on_this_cp_rank({"tokens": tokens(), "position_ids": torch.arange(SEQ).expand(BATCH, SEQ)},
                                      False, cp_group)
    model.eval()
    with torch.no_grad():
        pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        if stage > 0:
            hidden = torch.empty(*_hidden_shape(model), dtype=torch.float32)
            dist.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        out = model(batch["tokens"], batch["position_ids"], attention_mask=None)
        if stage < pp - 1:
            dist.send(out.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            return None
        out = gather_from_tensor_model_parallel_region(out)                       # [b, s / CP, vocab]
        if cp > 1:
            out = gather_zigzag(out.transpose(0, 1).contiguous(), cp_group, cp).transpose(0, 1)
    keep = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0)
    return out.contiguous() if keep else None


def _hidden_shape(model):
    from megatron.core import parallel_state as ps
    s = SEQ // ps.get_context_parallel_world_size()
    if model.config.sequence_parallel:
        s //= ps.get_tensor_model_parallel_world_size()
    return s, BATCH, model.config.hidden_size


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# the _extra_state of TE's norms that stay separate modules, which the local build writes too (SeparateNorm; the
# fused ones live in their linears' _extra_state)
TE_NORM_EXTRA_STATES = {"decoder.final_layernorm._extra_state"} | {
    f"decoder.layers.{i}.self_attention.out_norm._extra_state" for i in (0, 1, 2)} | {
    f"decoder.layers.{i}.pre_mlp_layernorm._extra_state" for i in (1, 2, 3)} | {
    f"decoder.layers.3.self_attention.{n}_layernorm._extra_state" for n in ("q", "k")}


def _check_te_modules(model, ours: bool):
    """What a TE user's model is made of: TE's fused norm + linear, IdentityOp input norms, TE's core attention."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_kcp.testing import te_standin as te
    layers = model.decoder.layers
    mixers = [type(layer.self_attention).__name__ for layer in layers]
    assert mixers == ["KCPGatedDeltaNet"] * 3 + ["KCPSelfAttention"] if ours else ["GatedDeltaNet"] * 3 + [
        "SelfAttention"], mixers
    for i, layer in enumerate(layers):
        assert isinstance(layer.input_layernorm, IdentityOp)
        fused = layer.self_attention.in_proj if i < 3 else layer.self_attention.linear_qkv
        assert type(fused) is te.TELayerNormColumnParallelLinear
        assert isinstance(layer.mlp, MoELayer) == (i > 0)
        if i == 0:
            assert isinstance(layer.pre_mlp_layernorm, IdentityOp)
            assert type(layer.mlp.linear_fc1) is te.TELayerNormColumnParallelLinear
        else:
            assert type(layer.pre_mlp_layernorm) is te.TERMSNorm and layer.pre_mlp_layernorm.zero_centered_gamma
            assert type(layer.mlp.experts.local_experts[0].linear_fc1) is te.TEColumnParallelLinear
            assert type(layer.mlp.shared_experts.linear_fc2) is te.TERowParallelLinear
    attention = layers[3].self_attention
    assert type(attention.core_attention) is te.TEDotProductAttention
    assert type(attention.q_layernorm) is te.TERMSNorm and type(layers[0].self_attention.out_norm) is te.TERMSNorm
    assert type(model.decoder.final_layernorm) is te.TERMSNorm


def _one_format(tmp):
    """The three builds: one checkpoint format; each loads the others' checkpoints with equal logits."""
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_kcp.layers.norm import ZeroCenteredRMSNorm
    from megatron_kcp.testing.te_standin import is_standin
    entries, refs = {}, {}
    for kind in ("local", "te", "mcore"):
        model, stack = build(kind)
        with stack:
            if kind == "local":
                assert not any(is_standin(m) for m in model.modules())
                layer = model.decoder.layers[0]
                assert type(layer.input_layernorm) is ZeroCenteredRMSNorm and not isinstance(layer.pre_mlp_layernorm,
                                                                                             IdentityOp)
            else:
                _check_te_modules(model, ours=kind == "te")
            entries[kind] = checkpoint_entries(model)
            save(model, f"{tmp}/{kind}")
            refs[kind] = logits(model)
    # every ShardedTensor: the same key, local and global shape, offset; the TE builds: the same objects too
    tensors = {k: {key: v for key, v in e.items() if v[0] != "object"} for k, e in entries.items()}
    assert tensors["local"] == tensors["te"] == tensors["mcore"]
    assert len(tensors["local"]) > 50
    assert entries["local"] == entries["te"] == entries["mcore"]
    assert TE_NORM_EXTRA_STATES <= set(entries["local"])
    assert rel(refs["te"], refs["local"]) == 0        # one init: the TE build is the local one with TE modules
    for src, dst in (("mcore", "local"), ("mcore", "te"), ("te", "mcore"), ("local", "mcore"), ("local", "te")):
        model, stack = build(dst)
        with stack:
            load(model, f"{tmp}/{src}")
            err = rel(logits(model), refs[src])
            assert err < TOL, (src, dst, err)


def test_local_te_and_megatron_core_hybrids_share_one_checkpoint(tmp_path):
    """(a) ours without TE, (b) ours with TE, (c) megatron-core's hybrid: the same checkpoint entries, and every
    checkpoint loads into the other builds with equal logits."""
    spawn(_one_format, 1, str(tmp_path))


def _local_into_te_strict(tmp, dst):
    model, stack = build("local")
    with stack:
        save(model, f"{tmp}/local")
        ref = logits(model)
    model, stack = build(dst)
    with stack:
        load(model, f"{tmp}/local")
        assert rel(logits(model), ref) < TOL


def test_local_checkpoint_loads_into_megatron_core_hybrid_at_default_strictness(tmp_path):
    spawn(_local_into_te_strict, 1, str(tmp_path), "mcore")


def _wrong_key_map(tmp):
    """A key map without the input norm's fused name: megatron-core's missing-key error, both ways."""
    from torch.distributed.checkpoint.api import CheckpointException

    import megatron_kcp.layers.hybrid as hybrid
    model, stack = build("mcore")
    with stack:
        save(model, f"{tmp}/mcore")
    right = hybrid._fused_norm_keys

    def without_input_norm(spec):
        return {k: v for k, v in right(spec).items() if k != "input_layernorm."}
    hybrid._fused_norm_keys = without_input_norm
    try:
        model, stack = build("local")
        with stack:
            assert checkpoint_entries(model)["decoder.layers.0.input_layernorm.weight"]
            with pytest.raises(CheckpointException, match=r"decoder\.layers\.0\.input_layernorm\.weight from model "
                               "not in state dict"):
                load(model, f"{tmp}/mcore")
            save(model, f"{tmp}/wrong")
    finally:
        hybrid._fused_norm_keys = right
    model, stack = build("mcore")
    with stack, pytest.raises(CheckpointException, match=r"decoder\.layers\.0\.self_attention\.in_proj\."
                              "layer_norm_weight from model not in state dict"):
        load(model, f"{tmp}/wrong", absent_ok=False)


def test_a_wrong_key_map_fails_the_interchange(tmp_path):
    """Negative control: the interchange test sees a key map that drops the input norm's fused name."""
    spawn(_wrong_key_map, 1, str(tmp_path))


# ---------------------------------------------------------------------------------------------------------
# KDA: megatron-core has no KDA, so only our two builds

def _kda_one_format(tmp):
    entries, refs = {}, {}
    for kind in ("local", "te"):
        model, stack = build(kind, "kda")
        with stack:
            entries[kind] = checkpoint_entries(model)
            save(model, f"{tmp}/{kind}")
            refs[kind] = logits(model)
    assert entries["local"] == entries["te"]
    for src, dst in (("local", "te"), ("te", "local")):
        model, stack = build(dst, "kda")
        with stack:
            load(model, f"{tmp}/{src}")
            err = rel(logits(model), refs[src])
            assert err < TOL, (src, dst, err)


def test_kda_hybrid_local_and_te_share_one_checkpoint(tmp_path):
    spawn(_kda_one_format, 1, str(tmp_path))


# ---------------------------------------------------------------------------------------------------------
# other sizes: a checkpoint saved at one TP / PP / CP / EP loads at another with equal logits


def _run(tmp, kind, name, src, parallel):
    """Build ``kind`` at ``parallel`` (tp, pp, cp, ep); save it as ``name`` (``src`` None) or load ``src``; its
    logits (and what the checkpoint lacked) to ``name.pt``."""
    from megatron.core import parallel_state as ps
    ep = parallel.get("ep", 1)
    if ep > 1:          # the harness sets TP, PP and CP; EP is carved out of DP x CP
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=parallel.get("tp", 1),
                                     pipeline_model_parallel_size=parallel.get("pp", 1),
                                     context_parallel_size=parallel.get("cp", 1), expert_model_parallel_size=ep)
    model, stack = build(kind, **parallel)
    with stack:
        absent = set()
        if src is None:
            save(model, f"{tmp}/{name}")
        else:
            absent = load(model, f"{tmp}/{src}", absent_ok=True)
        out = logits(model)
    if out is not None:
        torch.save({"logits": out, "absent": absent}, f"{tmp}/{name}.pt")


def _sizes(tp=1, pp=1, cp=1, ep=1):
    return {"tp": tp, "pp": pp, "cp": cp, "ep": ep}


def _result(tmp, name):
    return torch.load(f"{tmp}/{name}.pt")


@pytest.mark.slow
def test_tp2_checkpoints_of_ours_load_into_megatron_core_hybrid_at_tp1(tmp_path):
    """Ours (local and TE) saved at TP = 2 (sequence parallel), megatron-core's hybrid loads them at TP = 1."""
    tmp = str(tmp_path)
    spawn(_run, 2, tmp, "local", "local_tp2", None, _sizes(tp=2), tp=2)
    spawn(_run, 2, tmp, "te", "te_tp2", None, _sizes(tp=2), tp=2)
    spawn(_run, 1, tmp, "mcore", "mcore_from_local", "local_tp2", _sizes())
    spawn(_run, 1, tmp, "mcore", "mcore_from_te", "te_tp2", _sizes())
    for src, dst in (("local_tp2", "mcore_from_local"), ("te_tp2", "mcore_from_te")):
        a, b = _result(tmp, src), _result(tmp, dst)
        assert b["absent"] == set()             # the local norms write TE's empty extra state too
        assert rel(b["logits"], a["logits"]) < TOL, (src, dst, rel(b["logits"], a["logits"]))


@pytest.mark.slow
@pytest.mark.parametrize("kind,sizes,world", [
    ("local", _sizes(tp=2, cp=2), 4),
    ("local", _sizes(pp=2), 2),
    ("local", _sizes(cp=2, ep=2), 2),
    ("te", _sizes(tp=2), 2),
])
def test_megatron_core_hybrid_checkpoint_at_tp1_loads_into_ours_at_other_sizes(tmp_path, kind, sizes, world):
    """megatron-core's hybrid saved at TP = PP = CP = EP = 1; ours loads it at TP = 2 x CP = 2, PP = 2, CP = 2 x
    EP = 2 (the MoE's experts split over two ranks) and, with TE modules, at TP = 2."""
    tmp = str(tmp_path)
    spawn(_run, 1, tmp, "mcore", "mcore", None, _sizes())
    spawn(_run, world, tmp, kind, "ours", "mcore", sizes, tp=sizes["tp"], pp=sizes["pp"])
    a, b = _result(tmp, "mcore"), _result(tmp, "ours")
    assert b["absent"] == set()
    assert rel(b["logits"], a["logits"]) < TOL, rel(b["logits"], a["logits"])
