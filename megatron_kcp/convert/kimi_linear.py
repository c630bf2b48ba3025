"""Kimi Linear (``KimiLinearForCausalLM``): KDA + MLA without RoPE, dense first layers, sigmoid-routed MoE.

Mapping (checked against transformers' modeling_kimi_linear; names as Moonshot's checkpoints store them,
which transformers' ``save_pretrained`` writes back):

* KDA (``megatron_kcp.layers.kda.KCPKimiDeltaAttention``): q/k/v_proj, q/k/v_conv1d, f_a/f_b_proj ->
  ``f_proj.0/1``, g_a/g_b_proj -> ``g_proj.0/1`` (HF has no bias on g_b_proj: ``g_proj.1.bias`` is set to 0 and
  must still be 0 on export), b_proj, A_log ([1, 1, H, 1] -> [H]), dt_bias, o_norm (plain RMSNorm, sigmoid
  gate, eps = rms_norm_eps), o_proj;
* MLA (megatron-core ``MLASelfAttention``, local names): q_proj -> ``linear_q_proj`` (or q_a_proj, q_a_layernorm,
  q_b_proj -> ``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``), kv_a_proj_with_mqa ->
  ``linear_kv_down_proj``, kv_a_layernorm -> ``kv_layernorm``, kv_b_proj -> ``linear_kv_up_proj``, o_proj ->
  ``linear_proj`` (megatron-core builds MLA's latent norms with ``qk_layernorm``; their eps is
  ``rms_norm_eps``, where Kimi's kv_a_layernorm uses 1e-6: a difference of ~1e-6 in the outputs). Kimi's MLA
  applies no RoPE: megatron-core 0.19's MLA rotates its ``qk_pos_emb_head_dim`` part in every layer;
  megatron_kcp's MLA (``KCPMLASelfAttention``) honours ``--no-rope-freq`` as megatron-core's SelfAttention does,
  and the converted model marks every layer NoPE (``--no-rope-freq 1 --rope-type rope``, as the presets do);
* MoE: sigmoid scores + ``e_score_correction_bias`` (megatron-core's expert bias) for the choice, top-k
  renormalised, times ``routed_scaling_factor``; experts w1 (gate), w3 (up), w2 (down); shared experts without
  a gate; the first ``first_k_dense_replace`` layers (``mlp_layer_types``) are dense MLPs.
"""
from __future__ import annotations

from megatron_kcp.convert import layers
from megatron_kcp.convert.base import Family, ModelSpec, register
from megatron_kcp.convert.rules import Rule, copy, fill

KDA_NORM_EPS = 1e-5         # KCPKimiDeltaAttention's default o_norm eps


@register
class KimiLinear(Family):
    model_types = ("kimi_linear",)
    architectures = ("KimiLinearForCausalLM",)

    # ---- config (transformers' saved names first, then Moonshot's) ----

    def alias(self, *keys, default=None):
        for k in keys:
            if self.cfg.get(k) is not None:
                return self.cfg[k]
        return default

    def linear(self) -> dict:
        la = self.cfg.get("linear_attn_config") or {}
        return {"heads": self.alias("linear_num_heads", default=la.get("num_heads", 32)),
                "head_dim": self.alias("linear_head_dim", default=la.get("head_dim", 128)),
                "conv": self.alias("linear_conv_kernel_dim", default=la.get("short_conv_kernel_size", 4))}

    def layer_types(self) -> list[str]:
        n = self.cfg["num_hidden_layers"]
        types = self.cfg.get("layer_types")
        la = self.cfg.get("linear_attn_config") or {}
        if types is None and "full_attn_layers" in la:
            types = ["full_attention" if i + 1 in la["full_attn_layers"] else "linear_attention" for i in range(n)]
        if types is None:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        return list(types)

    def moe_layers(self) -> list[bool]:
        n = self.cfg["num_hidden_layers"]
        kinds = self.cfg.get("mlp_layer_types")
        if kinds is None:
            first = self.cfg.get("first_k_dense_replace", 1)
            kinds = ["dense" if i < first else "sparse" for i in range(n)]
        return [k == "sparse" for k in kinds]

    def check(self) -> None:
        c = self.cfg
        if c.get("hidden_act", "silu") != "silu":
            self.refuse("hidden_act", c["hidden_act"], "the specs' MLPs and KDA use SiLU")
        if c.get("attention_bias"):
            self.refuse("attention_bias", True, "the converter maps bias-free MLA only")
        heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        if kv != heads:
            self.refuse("num_key_value_heads", kv, f"Kimi's MLA expands kv_b_proj to {heads} heads")
        if c.get("mla_use_nope") is False:
            self.refuse("mla_use_nope", False, "transformers' Kimi Linear (the reference) runs MLA without RoPE")
        topk, renorm = self.alias("num_experts_per_token", "num_experts_per_tok", default=8), \
            self.alias("moe_renormalize", "norm_topk_prob", default=True)
        if topk > 1 and not renorm:
            self.refuse("moe_renormalize", False, "megatron-core renormalises sigmoid top-k scores when top-k > 1")
        groups, group_topk = self.alias("num_expert_group", "n_group", default=1), self.alias("topk_group", default=1)
        if groups > 1 and topk // group_topk != 2:
            self.refuse("num_expert_group", groups, "megatron-core scores a group by its top (top-k / topk_group) "
                        "experts, Kimi by its top 2: they agree only when top-k / topk_group = 2")

    def model_spec(self, options: dict) -> ModelSpec:
        self.check()
        c, la = self.cfg, self.linear()
        linear = [t == "linear_attention" for t in self.layer_types()]
        moe = self.moe_layers()
        tied = bool(c.get("tie_word_embeddings", False))
        eps = c.get("rms_norm_eps", 1e-5)
        rope_dim = c["qk_rope_head_dim"]
        experts = self.alias("num_experts", "num_local_experts")
        shared = self.alias("num_shared_experts", "n_shared_experts", default=0) * c["moe_intermediate_size"]
        max_len = self.alias("model_max_length", "max_position_embeddings", default=4096)
        config = dict(
            num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
            num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_attention_heads"],
            normalization="RMSNorm", layernorm_epsilon=eps, gated_linear_unit=True, add_bias_linear=False,
            add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
            linear_attention_freq=[int(x) for x in linear], linear_conv_kernel_dim=la["conv"],
            linear_key_head_dim=la["head_dim"], linear_value_head_dim=la["head_dim"],
            linear_num_key_heads=la["heads"], linear_num_value_heads=la["heads"],
            kda_gate_rank=la["head_dim"], kda_norm_eps=eps,
            multi_latent_attention=True, qk_layernorm=True, q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"],
            qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=rope_dim, v_head_dim=c["v_head_dim"],
            rope_type="rope", no_rope_freq=1,
            num_moe_experts=experts, moe_router_topk=self.alias("num_experts_per_token", "num_experts_per_tok"),
            moe_ffn_hidden_size=c["moe_intermediate_size"], moe_shared_expert_intermediate_size=shared or None,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=c.get("routed_scaling_factor", 1.0), moe_layer_freq=[int(x) for x in moe],
            moe_router_dtype="fp32", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather")      # the CPU build (alltoall needs CUDA streams)
        groups = self.alias("num_expert_group", "n_group", default=1)
        if groups > 1:
            config.update(moe_router_num_groups=groups, moe_router_group_topk=self.alias("topk_group"))
        spec = "kda_hybrid_layer_spec" + ("" if eps == KDA_NORM_EPS else f":kda_norm_eps={eps!r}")
        flags = [
            "--spec", "megatron_kcp", spec,
            "--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"],
            "--ffn-hidden-size", c["intermediate_size"], "--num-attention-heads", c["num_attention_heads"],
            "--normalization", "RMSNorm", "--norm-epsilon", eps, "--swiglu", "--disable-bias-linear",
            "--hidden-dropout", 0.0, "--attention-dropout", 0.0,
            "--multi-latent-attention", "--qk-layernorm", "--kv-lora-rank", c["kv_lora_rank"],
            "--qk-head-dim", c["qk_nope_head_dim"],
            "--qk-pos-emb-head-dim", rope_dim, "--v-head-dim", c["v_head_dim"],
            "--position-embedding-type", "none", "--rope-type", "rope", "--no-rope-freq", 1,
            "--linear-attention-freq", layers.layer_pattern(linear), "--linear-conv-kernel-dim", la["conv"],
            "--linear-key-head-dim", la["head_dim"], "--linear-value-head-dim", la["head_dim"],
            "--linear-num-key-heads", la["heads"], "--linear-num-value-heads", la["heads"],
            "--num-experts", experts, "--moe-router-topk", config["moe_router_topk"],
            "--moe-ffn-hidden-size", c["moe_intermediate_size"], "--moe-layer-freq", layers.layer_pattern(moe),
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-router-topk-scaling-factor", config["moe_router_topk_scaling_factor"],
            "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall",
            "--vocab-size", c["vocab_size"], "--make-vocab-size-divisible-by", 1, "--max-position-embeddings", max_len]
        if c.get("q_lora_rank"):
            flags += ["--q-lora-rank", c["q_lora_rank"]]
        if shared:
            flags += ["--moe-shared-expert-intermediate-size", shared]
        if groups > 1:
            flags += ["--moe-router-num-groups", groups, "--moe-router-group-topk", self.alias("topk_group")]
        if not tied:
            flags.append("--untie-embeddings-and-output-weights")
        gpt = dict(vocab_size=c["vocab_size"], max_sequence_length=max_len, position_embedding_type="none",
                   share_embeddings_and_output_weights=tied)
        return ModelSpec(spec, config, gpt, [str(f) for f in flags], config_class="kda_mla")

    # ---- tensors ----

    def rules(self, options: dict) -> list[Rule]:
        c = self.cfg
        hid = c["hidden_size"]
        names = options.get("names", ())
        rules = layers.embeddings(c["vocab_size"], hid, bool(c.get("tie_word_embeddings", False)))
        moe = self.moe_layers()
        for i, kind in enumerate(self.layer_types()):
            m, h = f"decoder.layers.{i}", f"model.layers.{i}"
            rules += layers.layer_norms(m, h, hid)
            if kind == "linear_attention":
                rules += self.kda_rules(f"{m}.self_attention", f"{h}.self_attn")
            else:
                rules += self.mla_rules(f"{m}.self_attention", f"{h}.self_attn")
            mlp = f"{h}.block_sparse_moe" if any(n.startswith(f"{h}.block_sparse_moe.") for n in names) else f"{h}.mlp"
            rules += self.mlp_rules(f"{m}.mlp", mlp, moe[i], names)
        return rules

    def kda_rules(self, m: str, h: str) -> list[Rule]:
        hid, la = self.cfg["hidden_size"], self.linear()
        heads, dim, conv = la["heads"], la["head_dim"], la["conv"]
        d = heads * dim
        rules = [copy(f"{m}.{x}_proj.weight", f"{h}.{x}_proj.weight", (d, hid)) for x in "qkv"]
        rules += [copy(f"{m}.{x}_conv1d.weight", f"{h}.{x}_conv1d.weight", (d, 1, conv)) for x in "qkv"]
        rules += [copy(f"{m}.f_proj.0.weight", f"{h}.f_a_proj.weight", (dim, hid)),
                  copy(f"{m}.f_proj.1.weight", f"{h}.f_b_proj.weight", (d, dim)),
                  copy(f"{m}.g_proj.0.weight", f"{h}.g_a_proj.weight", (dim, hid)),
                  copy(f"{m}.g_proj.1.weight", f"{h}.g_b_proj.weight", (d, dim)),
                  fill(f"{m}.g_proj.1.bias", 0.0, "Kimi Linear's g_b_proj has no bias"),
                  copy(f"{m}.b_proj.weight", f"{h}.b_proj.weight", (heads, hid)),
                  copy(f"{m}.A_log", f"{h}.A_log", (1, 1, heads, 1)),
                  copy(f"{m}.dt_bias", f"{h}.dt_bias", (d,)),
                  copy(f"{m}.o_norm.weight", f"{h}.o_norm.weight", (dim,)),
                  copy(f"{m}.o_proj.weight", f"{h}.o_proj.weight", (hid, d))]
        return rules

    def mla_rules(self, m: str, h: str) -> list[Rule]:
        c = self.cfg
        hid, heads = c["hidden_size"], c["num_attention_heads"]
        nope, rope, v, kv = (c[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
        q = c.get("q_lora_rank")
        qd = heads * (nope + rope)
        if q:
            rules = [copy(f"{m}.linear_q_down_proj.weight", f"{h}.q_a_proj.weight", (q, hid)),
                     copy(f"{m}.q_layernorm.weight", f"{h}.q_a_layernorm.weight", (q,)),
                     copy(f"{m}.linear_q_up_proj.weight", f"{h}.q_b_proj.weight", (qd, q))]
        else:
            rules = [copy(f"{m}.linear_q_proj.weight", f"{h}.q_proj.weight", (qd, hid))]
        return rules + [copy(f"{m}.linear_kv_down_proj.weight", f"{h}.kv_a_proj_with_mqa.weight", (kv + rope, hid)),
                        copy(f"{m}.kv_layernorm.weight", f"{h}.kv_a_layernorm.weight", (kv,)),
                        copy(f"{m}.linear_kv_up_proj.weight", f"{h}.kv_b_proj.weight", (heads * (nope + v), kv)),
                        copy(f"{m}.linear_proj.weight", f"{h}.o_proj.weight", (hid, heads * v))]

    def mlp_rules(self, m: str, h: str, is_moe: bool, names) -> list[Rule]:
        c = self.cfg
        hid = c["hidden_size"]
        if not is_moe:
            return layers.gated_mlp(m, h, hid, c["intermediate_size"])
        experts = self.alias("num_experts", "num_local_experts")
        packed = f"{h}.experts.gate_up_proj" in names
        rules = [copy(f"{m}.router.weight", f"{h}.gate.weight", (experts, hid)),
                 copy(f"{m}.router.expert_bias", f"{h}.gate.e_score_correction_bias", (experts,))]
        rules += layers.experts(m, h, experts, hid, c["moe_intermediate_size"], packed, names=("w1", "w3", "w2"))
        shared = self.alias("num_shared_experts", "n_shared_experts", default=0) * c["moe_intermediate_size"]
        if shared:
            rules += layers.gated_mlp(f"{m}.shared_experts", f"{h}.shared_experts", hid, shared)
        return rules
