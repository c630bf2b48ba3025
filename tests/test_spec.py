"""`--spec megatron_kcp.spec {gdn,kda}_hybrid_layer_spec` builds a GPTModel with the hybrid pattern."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from megatron_kcp.testing.distributed import rel_err, spawn


def _gpt(freq, name="gdn_hybrid_layer_spec", config_class=None, module="megatron_kcp.spec", **config):
    import megatron_kcp.megatron_cpu
    megatron_kcp.megatron_cpu.enable()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import import_module
    from megatron_kcp.layers.kda import KDAConfig
    spec = import_module((module, name))   # what --spec resolves to
    cfg = (config_class or KDAConfig)(
        num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
        normalization="RMSNorm", linear_attention_freq=freq, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, activation_func=F.silu,
        add_bias_linear=False, **config)
    torch.manual_seed(0)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=64)


def _build_and_run(freq, expected, name="gdn_hybrid_layer_spec"):
    from megatron.core.transformer.attention import SelfAttention
    model = _gpt(freq, name)
    kinds = ["attn" if isinstance(layer.self_attention, SelfAttention) else name[:3]
             for layer in model.decoder.layers]
    assert kinds == expected
    tokens = torch.randint(0, 64, (2, 32))
    pos = torch.arange(32).expand(2, 32)
    mask = torch.ones(32, 32, dtype=torch.bool).triu(1)[None, None]     # megatron's default mask is CUDA-only
    loss = model(tokens, pos, attention_mask=mask, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("freq,expected", [
    (4, ["gdn", "gdn", "gdn", "attn"]),
    ([1, 0, 1, 0], ["gdn", "attn", "gdn", "attn"]),
])
def test_hybrid_gpt_model(freq, expected):
    spawn(_build_and_run, 1, freq, expected)


@pytest.mark.slow
def test_kda_hybrid_gpt_model():
    spawn(_build_and_run, 1, 2, ["kda", "attn", "kda", "attn"], "kda_hybrid_layer_spec")


def _cp_loss(path):
    """Loss summed over the tokens (and CP ranks) and the gradient of the first attention layer's QKV
    weight (summed over CP ranks, as Megatron's gradient all-reduce over DP x CP does), saved by rank 0."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank
    group = ps.get_context_parallel_group()
    model = _gpt(2, context_parallel_size=dist.get_world_size(group), hidden_dropout=0.0, attention_dropout=0.0)
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(32).expand(2, 32)}
    batch = get_batch_on_this_cp_rank(batch, False, group)       # Megatron's zigzag split (none at CP=1)
    loss = model(batch["tokens"], batch["position_ids"], attention_mask=None, labels=batch["labels"]).sum()
    loss.backward()
    attention = model.decoder.layers[1].self_attention
    assert type(attention.core_attention).__name__ == "CPDotProductAttention"
    loss, grad = loss.detach(), attention.linear_qkv.weight.grad
    for t in (loss, grad):
        dist.all_reduce(t, group=group)
    if dist.get_rank() == 0:
        torch.save({"loss": loss, "grad": grad}, path)


@pytest.mark.slow
def test_hybrid_gpt_model_cp2_matches_cp1(tmp_path):
    """Without TE the hybrid's softmax layers run at CP > 1 (CPDotProductAttention): same loss and gradient."""
    spawn(_cp_loss, 1, tmp_path / "cp1.pt")
    spawn(_cp_loss, 2, tmp_path / "cp2.pt")
    cp1, cp2 = torch.load(tmp_path / "cp1.pt"), torch.load(tmp_path / "cp2.pt")
    assert rel_err(cp2["loss"], cp1["loss"]) < 1e-5
    assert rel_err(cp2["grad"], cp1["grad"]) < 1e-5


def test_bad_pattern():
    from megatron_kcp.layers.pattern import is_linear_layer

    class C:
        num_layers, linear_attention_freq = 4, [1, 1, 0]
    with pytest.raises(ValueError, match="num_layers=4"):
        is_linear_layer(C, 1)


def _kda_options_reach_the_mixer():
    """pretrain_gpt.py's config is a plain TransformerConfig: the options come with the spec's name."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    model = _gpt(2, "kda_hybrid_layer_spec:kda_gate_rank=16,kda_norm_eps=1e-6", config_class=TransformerConfig,
                 module="megatron_kcp")
    mixer = model.decoder.layers[0].self_attention
    assert type(mixer).__name__ == "KCPKimiDeltaAttention"
    assert mixer.f_proj[0].weight.shape[0] == mixer.g_proj[0].weight.shape[0] == 16 and mixer.o_norm.eps == 1e-6
    plain = _gpt(2, "kda_hybrid_layer_spec", config_class=TransformerConfig, module="megatron_kcp")
    assert plain.decoder.layers[0].self_attention.options == {"kda_gate_rank": None, "kda_norm_eps": 1e-5}


@pytest.mark.slow
def test_kda_options_through_the_spec_name():
    spawn(_kda_options_reach_the_mixer, 1)


def _bad_kda_value_fails_at_construction(spec_name, config, match):
    with pytest.raises(ValueError, match=match):
        _gpt(2, spec_name, module="megatron_kcp", **config)


@pytest.mark.parametrize("spec_name,config,match", [
    ("kda_hybrid_layer_spec", {"kda_gate_rank": 0}, "kda_gate_rank=0: must be a positive int"),
    ("kda_hybrid_layer_spec", {"kda_gate_rank": 2.5}, "kda_gate_rank=2.5: must be a positive int"),
    ("kda_hybrid_layer_spec", {"kda_norm_eps": -1e-5}, "kda_norm_eps=-1e-05: must be a positive float"),
    ("kda_hybrid_layer_spec:kda_gate_rank=16", {"kda_gate_rank": 8}, "the layer spec says 16, the config 8"),
])
@pytest.mark.slow
def test_invalid_kda_values_fail_at_construction(spec_name, config, match):
    """Never a silent default: KDAConfig's kda_gate_rank=0 used to fall back to the value head dim."""
    spawn(_bad_kda_value_fails_at_construction, 1, spec_name, config, match)


@pytest.mark.parametrize("name,match", [
    ("kda_hybrd_layer_spec", "unknown spec 'kda_hybrd_layer_spec'; use one of gdn_hybrid_layer_spec, kda_"),
    ("kda_hybrid_layer_spec:kda_gate_rank=0", "kda_gate_rank=0: must be a positive int"),
    ("kda_hybrid_layer_spec:kda_gate_rank=six", "kda_gate_rank='six' is not a int"),
    ("kda_hybrid_layer_spec:kda_norm_eps=nan", "kda_norm_eps=nan: must be a positive float"),
    ("kda_hybrid_layer_spec:gate_rank=64", "'gate_rank=64' is not OPTION=VALUE with OPTION one of kda_gate_rank"),
    ("gdn_hybrid_layer_spec:kda_gate_rank=64", "gdn_hybrid_layer_spec takes no options"),
])
@pytest.mark.parametrize("module", ["megatron_kcp", "megatron_kcp.spec"])
def test_bad_spec_names_stop_unpatched_megatron(module, name, match):
    """Megatron's unpatched import_module passes over ImportError only: a ValueError stops the run, and
    it names the module path the user gave."""
    from megatron.core.transformer.spec_utils import import_module
    with pytest.raises(ValueError, match=f"^--spec {module} {re.escape(name)}: .*{match}"):
        import_module([module, name])


@pytest.mark.parametrize("module", ["megatron_kcp", "megatron_kcp.spec"])
def test_spec_names_resolve_unpatched(module):
    """Both module paths take every name, options included, through Megatron's unpatched import_module
    (``__import__(module, fromlist=[name])``, then ``vars(module)[name]``) and through ``getattr`` (the
    patched one): the same objects either way."""
    import importlib

    from megatron.core.transformer.spec_utils import import_module

    import megatron_kcp.spec as spec
    for name in spec.SPEC_NAMES:
        assert import_module([module, name]) is getattr(spec, name)
    name = "kda_hybrid_layer_spec:kda_gate_rank=64,kda_norm_eps=1e-6"
    kda = import_module([module, name])
    assert kda is import_module([module, name]) is getattr(importlib.import_module(module), name)   # built once
    assert kda is import_module(["megatron_kcp", name]) is import_module(["megatron_kcp.spec", name])
    assert kda.submodules.linear_mixer.keywords == {"kda_gate_rank": 64, "kda_norm_eps": 1e-6}


def test_spec_module_attributes_stay_ordinary():
    """The spec lookup covers spec names only: other missing attributes are AttributeErrors, as usual."""
    import megatron_kcp
    import megatron_kcp.spec as spec
    for module in (megatron_kcp, spec):
        assert not hasattr(module, "no_such_thing") and not hasattr(module, "__wrapped__")


def _two_forwards(name, module):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank
    model = _gpt(2, name, module=module, context_parallel_size=dist.get_world_size())
    tokens = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(1))
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": torch.arange(32)[None]}, False,
                                      ps.get_context_parallel_group())
    for _ in range(2):
        model(batch["tokens"], batch["position_ids"], attention_mask=None).sum().backward()


@pytest.mark.parametrize("module,name,expected", [
    ("megatron_kcp.spec", "gdn_hybrid_layer_spec", "KCPGatedDeltaNet (layer 1), CP size 2, TP size 1, layout "
     "zigzag_per_doc ([s, b] rows, zigzag_per_doc), strategy gather, core reference (PyTorch), conv reference, "
     "layers local"),
    ("megatron_kcp", "kda_hybrid_layer_spec:kda_gate_rank=16", "KCPKimiDeltaAttention (layer 1, kda_gate_rank=16, "
     "kda_norm_eps=1e-05), CP size 2, TP size 1, layout zigzag_per_doc"),
])
def test_kcp_active_line_once_on_rank_0(module, name, expected, capfd):
    """Unpatched Megatron trains its default GPT when a --spec fails to import: the line says KCP is on."""
    spawn(_two_forwards, 2, name, module)
    lines = [line for line in capfd.readouterr().out.splitlines() if "KCP active" in line]
    assert len(lines) == 1 and lines[0].startswith("[megatron_kcp] KCP active: " + expected), lines


@pytest.mark.slow
def test_missing_dependency_stops_unpatched_megatron():
    """An ImportError inside megatron_kcp.spec would make Megatron train its default GPT: it is a RuntimeError."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['megatron_kcp.ops.kcp'] = None\n"        # as if a dependency were missing
            "from megatron.core.transformer.spec_utils import import_module\n"
            "import_module(['megatron_kcp.spec', 'gdn_hybrid_layer_spec'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "RuntimeError: megatron_kcp.spec: import of megatron_kcp.ops.kcp halted" in done.stderr, done.stderr[-2000:]


def _model_from_config(kind):
    """The released hybrids' features, from the config alone (what Megatron's flags set)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_kcp.layers.attention import KCPMLASelfAttention, KCPSelfAttention
    from megatron_kcp.layers.norm import ZeroCenteredRMSNorm
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
               gated_linear_unit=True)
    if kind == "qwen3-next":        # gated attention with QK norm, (1 + w) norms, MoE from layer 2
        model = _gpt(2, qk_layernorm=True, attention_output_gate=True, num_query_groups=2, kv_channels=8,
                     layernorm_zero_centered_gamma=True, moe_layer_freq=[0, 1, 1, 1], moe_shared_expert_gate=True,
                     **moe)
        attention = KCPSelfAttention
    else:                           # KDA with NoPE MLA attention, a dense first layer
        model = _gpt(2, "kda_hybrid_layer_spec", config_class=MLATransformerConfig, qk_layernorm=True, q_lora_rank=None,
                     kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="rope",
                     no_rope_freq=1, moe_layer_freq=[0, 1, 1, 1], **moe)
        attention = KCPMLASelfAttention
    layers = model.decoder.layers
    linear = [type(layer.self_attention).__name__ for layer in layers]
    assert [isinstance(layer.self_attention, attention) for layer in layers] == [False, True, False, True], linear
    assert [isinstance(layer.mlp, MoELayer) for layer in layers] == [False, True, True, True]
    assert all(layer.mlp.shared_experts is not None for layer in layers[1:])
    sharded = {k: v.key for k, v in model.sharded_state_dict().items() if hasattr(v, "key")}
    if kind == "qwen3-next":
        assert all(isinstance(m, ZeroCenteredRMSNorm) for m in (layers[1].input_layernorm, layers[1].self_attention.
                   q_layernorm, layers[0].self_attention.out_norm, model.decoder.final_layernorm))
        assert layers[1].self_attention.linear_qkv.weight.shape[0] == 2 * 4 * 8 + 2 * 2 * 8      # q and gate, k, v
        assert model.decoder.layers[1].mlp.shared_experts.use_shared_expert_gate
        # the checkpoint keys of megatron-core's TE hybrid, which fuses these norms into the next linear
        for local, fused in (("0.input_layernorm.", "0.self_attention.in_proj.layer_norm_"),
                             ("1.input_layernorm.", "1.self_attention.linear_qkv.layer_norm_"),
                             ("0.pre_mlp_layernorm.", "0.mlp.linear_fc1.layer_norm_"),
                             ("1.pre_mlp_layernorm.", "1.pre_mlp_layernorm.")):        # MoE: no fused norm
            assert sharded[f"decoder.layers.{local}weight"] == f"decoder.layers.{fused}weight"
    else:
        assert layers[1].self_attention.rotary_pos_emb.inv_freq.abs().sum() == 0           # NoPE
        assert sharded["decoder.layers.1.input_layernorm.weight"] == "decoder.layers.1.input_layernorm.weight"
        assert (sharded["decoder.layers.1.self_attention.kv_layernorm.weight"]
                == "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight")
    tokens = torch.randint(0, 64, (1, 16))
    with torch.no_grad():     # a THD pack of two documents: each as on its own (MLA's padded value heads trimmed)
        from megatron.core.packed_seq_params import PackedSeqParams
        model.eval()
        cu = torch.tensor([0, 6, 16], dtype=torch.int32)
        pack = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=10, max_seqlen_kv=10)
        position = torch.cat([torch.arange(6), torch.arange(10)])[None]
        packed = model(tokens, position, attention_mask=None, packed_seq_params=pack)
        alone = torch.cat([model(tokens[:, a:b], torch.arange(b - a)[None], attention_mask=None)
                           for a, b in ((0, 6), (6, 16))], 1)
        assert rel_err(packed, alone) < 1e-5, rel_err(packed, alone)
        model.train()
    loss = model(tokens, torch.arange(16)[None], attention_mask=None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", ["qwen3-next", "kimi-linear"])
def test_spec_builds_the_released_models_features_from_the_config(kind):
    spawn(_model_from_config, 1, kind)


def _refused(config, match):
    with pytest.raises(ValueError, match=match):
        _gpt(4, **config)


@pytest.mark.parametrize("config,match", [
    ({"experimental_attention_variant": "dsa"}, "--experimental-attention-variant dsa: the megatron_kcp specs"),
    ({"num_moe_experts": 4, "moe_grouped_gemm": True}, "--moe-grouped-gemm needs TransformerEngine"),
])
def test_options_the_specs_cannot_honour_stop_at_construction(config, match):
    spawn(_refused, 1, config, match)
