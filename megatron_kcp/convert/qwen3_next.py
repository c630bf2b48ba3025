"""Qwen3-Next (``Qwen3NextForCausalLM``): GDN + gated softmax attention, MoE with a gated shared expert.

Mapping (after Megatron-Bridge's Qwen3-Next bridge, checked against transformers' modeling_qwen3_next):

* norms are zero-centred in HF (``x * (1 + w)``) and in Megatron (``--apply-layernorm-1p``): copied; the GDN
  gated out_norm is a plain ``x * w`` in HF, so Megatron's zero-centred out_norm holds ``w - 1`` (float64);
* GDN ``in_proj`` = HF ``in_proj_qkvz`` + ``in_proj_ba`` (grouped per key head) re-ordered into the sections
  query, key, value, z, beta, alpha (:func:`~megatron_kcp.convert.rules.gdn_in_proj_perm`); conv1d channels are
  [q; k; v] over all heads on both sides (copied), A_log and dt_bias copied;
* attention: HF q_proj holds per head [query; gate]; megatron-core's ``linear_qkv`` with
  ``attention_output_gate`` holds per query group [its queries, their gates, key, value];
* MoE: router, SequentialMLP experts ([gate; up] in ``linear_fc1``), shared expert and its sigmoid gate;
  softmax routing, top-k renormalised (``norm_topk_prob``) = megatron-core's softmax after top-k.
"""
from __future__ import annotations

from megatron_kcp.convert import layers
from megatron_kcp.convert.base import Family, ModelSpec, register
from megatron_kcp.convert.rules import Rule, copy, gdn_in_proj_perm


@register
class Qwen3Next(Family):
    model_types = ("qwen3_next",)
    architectures = ("Qwen3NextForCausalLM",)
    droppable = {"mtp.": "--drop-mtp"}
    fused_in_proj = True          # in_proj_qkvz + in_proj_ba (Qwen3.5: in_proj_qkv, _z, _b, _a)
    prefix = "model."

    # ---- config ----

    def text(self) -> dict:
        """The language model's config (a composite config's ``text_config``)."""
        return self.cfg

    def layer_types(self) -> list[str]:
        c = self.text()
        n = c["num_hidden_layers"]
        types = c.get("layer_types")
        if types is None:
            every = c.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
        if len(types) != n or set(types) - {"linear_attention", "full_attention"}:
            self.refuse("layer_types", types, f"need {n} entries of linear_attention/full_attention")
        return list(types)

    def moe_layers(self) -> list[bool]:
        c = self.text()
        if not c.get("num_experts"):
            return [False] * c["num_hidden_layers"]
        only, step = c.get("mlp_only_layers") or [], c.get("decoder_sparse_step", 1)
        return [i not in only and (i + 1) % step == 0 for i in range(c["num_hidden_layers"])]

    def rope(self) -> tuple[float, float]:
        """(rotary_percent, rotary_base)."""
        c = self.text()
        rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            self.refuse("rope_parameters.rope_type", kind, "megatron_kcp's specs use plain RoPE (rope_type default)")
        # Qwen3.5's mrope sections all see the same position for text: plain RoPE
        percent = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
        base = rope.get("rope_theta", c.get("rope_theta", 10000.0))
        if float(base) != int(base):
            self.refuse("rope_theta", base, "Megatron-LM's --rotary-base takes an integer")
        return float(percent), int(base)

    def check(self) -> None:
        c = self.text()
        if c.get("hidden_act", "silu") != "silu":
            self.refuse("hidden_act", c["hidden_act"], "the specs' MLPs and GDN use SiLU")
        if c.get("attention_bias"):
            self.refuse("attention_bias", True, "the converter maps bias-free attention only")
        if c["linear_num_value_heads"] % c["linear_num_key_heads"]:
            self.refuse("linear_num_value_heads", c["linear_num_value_heads"],
                        "must be a multiple of linear_num_key_heads")

    def model_spec(self, options: dict) -> ModelSpec:
        self.check()
        c = self.text()
        linear = [t == "linear_attention" for t in self.layer_types()]
        moe = self.moe_layers()
        percent, base = self.rope()
        tied = bool(c.get("tie_word_embeddings", False))
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        config = dict(
            num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
            ffn_hidden_size=c.get("intermediate_size") or c["moe_intermediate_size"],
            num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
            kv_channels=head_dim, normalization="RMSNorm", layernorm_epsilon=c["rms_norm_eps"],
            layernorm_zero_centered_gamma=True, gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=False,
            qk_layernorm=True, attention_output_gate=True, hidden_dropout=0.0, attention_dropout=0.0,
            linear_attention_freq=[int(x) for x in linear], linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
            linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
            linear_num_key_heads=c["linear_num_key_heads"], linear_num_value_heads=c["linear_num_value_heads"])
        flags = [
            "--spec", "megatron_kcp", "gdn_hybrid_layer_spec",
            "--num-layers", c["num_hidden_layers"], "--hidden-size", c["hidden_size"],
            "--ffn-hidden-size", config["ffn_hidden_size"], "--num-attention-heads", c["num_attention_heads"],
            "--group-query-attention", "--num-query-groups", c["num_key_value_heads"], "--kv-channels", head_dim,
            "--normalization", "RMSNorm", "--norm-epsilon", c["rms_norm_eps"], "--apply-layernorm-1p",
            "--swiglu", "--disable-bias-linear", "--qk-layernorm", "--attention-output-gate",
            "--hidden-dropout", 0.0, "--attention-dropout", 0.0,
            "--position-embedding-type", "rope", "--rotary-percent", percent, "--rotary-base", base,
            "--linear-attention-freq", layers.layer_pattern(linear),
            "--linear-conv-kernel-dim", c["linear_conv_kernel_dim"],
            "--linear-key-head-dim", c["linear_key_head_dim"], "--linear-value-head-dim", c["linear_value_head_dim"],
            "--linear-num-key-heads", c["linear_num_key_heads"],
            "--linear-num-value-heads", c["linear_num_value_heads"],
            "--vocab-size", c["vocab_size"], "--make-vocab-size-divisible-by", 1,
            "--max-position-embeddings", c.get("max_position_embeddings", 4096)]
        if not tied:
            flags.append("--untie-embeddings-and-output-weights")
        if any(moe):
            config.update(self.moe_config(moe))
            flags += self.moe_flags(moe)
        gpt = dict(vocab_size=c["vocab_size"], max_sequence_length=c.get("max_position_embeddings", 4096),
                   position_embedding_type="rope", rotary_percent=percent, rotary_base=base,
                   share_embeddings_and_output_weights=tied)
        return ModelSpec("gdn_hybrid_layer_spec", config, gpt, [str(f) for f in flags])

    def moe_config(self, moe: list[bool]) -> dict:
        c = self.text()
        return dict(num_moe_experts=c["num_experts"], moe_router_topk=c["num_experts_per_tok"],
                    moe_ffn_hidden_size=c["moe_intermediate_size"],
                    moe_shared_expert_intermediate_size=c.get("shared_expert_intermediate_size") or None,
                    moe_shared_expert_gate=bool(c.get("shared_expert_intermediate_size")),
                    moe_router_score_function="softmax", moe_router_pre_softmax=not c.get("norm_topk_prob", True),
                    moe_layer_freq=[int(x) for x in moe], moe_router_dtype="fp32",
                    moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
                    moe_token_dispatcher_type="allgather")      # the CPU build (alltoall needs CUDA streams)

    def moe_flags(self, moe: list[bool]) -> list:
        c = self.text()
        flags = ["--num-experts", c["num_experts"], "--moe-router-topk", c["num_experts_per_tok"],
                 "--moe-ffn-hidden-size", c["moe_intermediate_size"], "--moe-layer-freq", layers.layer_pattern(moe),
                 "--moe-router-score-function", "softmax", "--moe-router-dtype", "fp32",
                 "--moe-router-load-balancing-type", "global_aux_loss",
                 "--moe-aux-loss-coeff", c.get("router_aux_loss_coef", 1e-3),
                 "--moe-token-dispatcher-type", "alltoall"]
        if c.get("shared_expert_intermediate_size"):
            flags += ["--moe-shared-expert-intermediate-size", c["shared_expert_intermediate_size"],
                      "--moe-shared-expert-gate"]
        if not c.get("norm_topk_prob", True):
            flags.append("--moe-router-pre-softmax")
        return flags

    # ---- tensors ----

    def rules(self, options: dict) -> list[Rule]:
        c = self.text()
        hid, p = c["hidden_size"], self.prefix
        rules = layers.embeddings(c["vocab_size"], hid, bool(c.get("tie_word_embeddings", False)), p)
        moe = self.moe_layers()
        for i, kind in enumerate(self.layer_types()):
            m, h = f"decoder.layers.{i}", f"{p}layers.{i}"
            rules += layers.layer_norms(m, h, hid)
            if kind == "linear_attention":
                rules += self.gdn_rules(f"{m}.self_attention", f"{h}.linear_attn")
            else:
                head_dim = c.get("head_dim") or hid // c["num_attention_heads"]
                rules += layers.softmax_attention(f"{m}.self_attention", f"{h}.self_attn", hid,
                                                  c["num_attention_heads"], c["num_key_value_heads"], head_dim,
                                                  gated=True, qk_norm=True)
            rules += self.mlp_rules(f"{m}.mlp", f"{h}.mlp", moe[i], options)
        return rules

    def gdn_rules(self, m: str, h: str) -> list[Rule]:
        c = self.text()
        hid = c["hidden_size"]
        nk, nv, dk, dv = (c[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                         "linear_key_head_dim", "linear_value_head_dim"))
        qk, v = nk * dk, nv * dv
        if self.fused_in_proj:
            hf = ((f"{h}.in_proj_qkvz.weight", (2 * qk + 2 * v, hid)), (f"{h}.in_proj_ba.weight", (2 * nv, hid)))
        else:
            hf = ((f"{h}.in_proj_qkv.weight", (2 * qk + v, hid)), (f"{h}.in_proj_z.weight", (v, hid)),
                  (f"{h}.in_proj_b.weight", (nv, hid)), (f"{h}.in_proj_a.weight", (nv, hid)))
        conv = c["linear_conv_kernel_dim"]
        return [Rule((f"{m}.in_proj.weight",), hf, perm=gdn_in_proj_perm(nk, nv, dk, dv, self.fused_in_proj)),
                copy(f"{m}.conv1d.weight", f"{h}.conv1d.weight", (2 * qk + v, 1, conv)),
                copy(f"{m}.A_log", f"{h}.A_log", (nv,)), copy(f"{m}.dt_bias", f"{h}.dt_bias", (nv,)),
                # HF's gated norm scales by w, Megatron's zero-centred one by 1 + w
                copy(f"{m}.out_norm.weight", f"{h}.norm.weight", (dv,), offset=-1.0),
                copy(f"{m}.out_proj.weight", f"{h}.out_proj.weight", (hid, v))]

    def mlp_rules(self, m: str, h: str, is_moe: bool, options: dict) -> list[Rule]:
        c = self.text()
        hid = c["hidden_size"]
        if not is_moe:
            return layers.gated_mlp(m, h, hid, c["intermediate_size"])
        names = options.get("names", ())
        packed = f"{h}.experts.gate_up_proj" in names
        rules = [copy(f"{m}.router.weight", f"{h}.gate.weight", (c["num_experts"], hid))]
        rules += layers.experts(m, h, c["num_experts"], hid, c["moe_intermediate_size"], packed)
        if c.get("shared_expert_intermediate_size"):
            rules += layers.gated_mlp(f"{m}.shared_experts", f"{h}.shared_expert", hid,
                                      c["shared_expert_intermediate_size"])
            rules.append(copy(f"{m}.shared_experts.gate_weight", f"{h}.shared_expert_gate.weight", (1, hid)))
        return rules
