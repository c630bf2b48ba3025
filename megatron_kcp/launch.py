"""Build, check and run the torchrun command that trains a preset.

    python -m megatron_kcp.launch configs/tiny-gdn.json --nproc-per-node 4 --cp 4 -- --train-iters 100
    python -m megatron_kcp.launch configs/qwen3-next-80b-a3b.json --nnodes 4 --nproc-per-node 8 --tp 2 --cp 4 \\
        --ep 16 --etp 1 --master-addr node0 --node-rank 0 --megatron-lm ~/Megatron-LM -- --train-iters 100

The trainer is ``megatron_kcp.train`` (pip-installed megatron-core only), or Megatron-LM's
``pretrain_gpt.py`` with ``--megatron-lm DIR``. Inconsistent sizes (world size, heads, experts,
layers per pipeline stage, sequence length) fail here, before any process starts, each with a
one-line error naming the size and the fix; ``--dry-run`` prints the command (and, on stderr, the
layout it checked). Arguments after ``--`` go to the trainer unchanged (a ``--seq-length`` there is
the one the checks use); the command trains on mock data unless they name data (``-- --data-path
PREFIX --split 98,1,1 --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``, a Megatron
indexed dataset).

A preset (configs/*.json) is a JSON object of Megatron's model arguments under their own names
(the flag is ``--`` and the name with dashes), checked by :func:`load_preset` (type, range and
consistency):

- sizes, positive integers (:data:`INT_KEYS`): the layers, widths and heads, the linear mixers'
  heads, the experts (``num_experts``, ``moe_router_topk``, ``moe_ffn_hidden_size``,
  ``moe_shared_expert_intermediate_size``), MLA's ranks and head dims, ``mtp_num_layers``,
  ``rotary_base``, and ``kda_gate_rank`` (the KDA mixer's gate rank, which travels in the spec's name);
- numbers (:data:`FLOAT_KEYS`): ``rotary_percent``, ``norm_epsilon``, the router's scaling and
  aux-loss coefficients, ``mtp_loss_scaling_factor``;
- switches, true or false (:data:`FLAG_KEYS`), Megatron's store-true flags, emitted only when true
  (``untie_embeddings_and_output_weights`` is true unless the preset says false);
- choices (:data:`CHOICE_KEYS`): the router's score function, load balancing and dtype, the position
  embedding (``rope`` unless set) and MLA's ``rope_type``;
- layer patterns (:data:`PATTERN_KEYS`): ``linear_attention_freq`` (N: every Nth layer is softmax
  attention; or a 0/1 list of ``num_layers`` entries, 1 = linear), ``moe_layer_freq`` (N: every
  Nth layer from the first is MoE; or a 0/1 list, 1 = MoE) and ``no_rope_freq`` (N dividing the layers:
  every Nth layer's attention takes no RoPE, 1 = none does; or a 0/1 list, 1 = NoPE; Kimi-Linear's MLA);
- ``spec`` (a name of :mod:`megatron_kcp.spec`, default ``gdn_hybrid_layer_spec``; options allowed for
  the KDA spec: ``kda_hybrid_layer_spec:kda_gate_rank=64``) and ``_doc`` (a description: where the
  numbers come from).

Every preset trains RMSNorm, SwiGLU, no biases; ``--bf16`` unless ``--fp32``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
from pathlib import Path

from megatron_kcp.spec_names import split_spec_name
from megatron_kcp.data import default_data_args
from megatron_kcp.environment import no_te_args
from megatron_kcp.sizes import check_head_dims, check_moe_split, check_split, divisors

# sizes: positive integers, in the order the command carries them
INT_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "seq_length", "vocab_size",
            "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
            "mtp_num_layers", "rotary_base", "kda_gate_rank")
# numbers: (lowest, highest, whether the lowest is allowed, an example)
FLOAT_KEYS = {"rotary_percent": (0.0, 1.0, False, 0.25), "norm_epsilon": (0.0, 1.0, False, 1e-6),
              "moe_router_topk_scaling_factor": (0.0, math.inf, False, 2.446),
              "moe_aux_loss_coeff": (0.0, math.inf, True, 1e-3), "mtp_loss_scaling_factor": (0.0, math.inf, True, 0.1)}
# Megatron's store-true flags (--apply-layernorm-1p sets its layernorm_zero_centered_gamma)
FLAG_KEYS = ("untie_embeddings_and_output_weights", "apply_layernorm_1p", "qk_layernorm", "attention_output_gate",
             "multi_latent_attention", "moe_shared_expert_gate", "moe_router_pre_softmax",
             "moe_router_enable_expert_bias")
CHOICE_KEYS = {"position_embedding_type": ("rope", "none"), "rope_type": ("rope", "yarn"),
               "moe_router_score_function": ("softmax", "sigmoid", "sqrtsoftplus"),
               "moe_router_load_balancing_type": ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
               "moe_router_dtype": ("fp32", "fp64")}
PATTERN_KEYS = ("linear_attention_freq", "moe_layer_freq", "no_rope_freq")
# every model key, in the command's order (the dense hybrid's first, as before the MoE and MLA keys)
MODEL_KEYS = (INT_KEYS[:6] + ("linear_attention_freq",) + INT_KEYS[6:] + tuple(FLOAT_KEYS) + FLAG_KEYS
              + tuple(CHOICE_KEYS) + ("moe_layer_freq", "no_rope_freq"))
OTHER_KEYS = ("spec", "_doc")        # the layer spec (--spec megatron_kcp NAME), and a free-text description
ALLOWED_KEYS = MODEL_KEYS + OTHER_KEYS
DEFAULT_SPEC = "gdn_hybrid_layer_spec"
DEFAULTS = {"untie_embeddings_and_output_weights": True, "position_embedding_type": "rope"}

# the keys that only mean something on a MoE model, an MLA model, with RoPE
MOE_KEYS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
            "moe_router_pre_softmax", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
            "moe_aux_loss_coeff", "moe_router_score_function", "moe_router_load_balancing_type", "moe_router_dtype",
            "moe_layer_freq")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type")

# what the size checks and the command need; the rest falls back to Megatron's defaults
REQUIRED_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "seq_length", "vocab_size")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# the trainer's parallel sizes are the launcher's options (they are checked here)
PARALLEL_FLAGS = {"--tensor-model-parallel-size": "--tp", "--context-parallel-size": "--cp",
                  "--pipeline-model-parallel-size": "--pp", "--expert-model-parallel-size": "--ep",
                  "--expert-tensor-parallel-size": "--etp"}


def load_preset(path: str | Path) -> dict:
    """The preset's model sizes; ValueError naming the file and the fix if it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        shipped = sorted(p.name for p in CONFIGS.glob("*.json"))
        raise ValueError(f"preset {path}: no such file; give the path of a JSON preset"
                         + (f", e.g. one of configs/{{{','.join(shipped)}}}" if shipped else ""))
    try:
        preset = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"preset {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): "
                         "fix the file (configs/tiny-gdn.json shows the format)") from None
    if not isinstance(preset, dict):
        raise ValueError(f"preset {path}: must be a JSON object of model sizes, e.g. {{\"num_layers\": 4, ...}}")
    unknown = [k for k in preset if k not in ALLOWED_KEYS]
    if unknown:
        raise ValueError(f"preset {path}: unknown keys {unknown}; the allowed keys are {', '.join(ALLOWED_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in preset]
    if missing:
        raise ValueError(f"preset {path}: missing keys {missing}; add them (configs/tiny-gdn.json has every key)")
    check_preset_values(preset, f"preset {path}")
    return preset


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pattern_ok(value, layers: int) -> bool:
    """N >= 1, or a 0/1 list of ``layers`` entries."""
    return (_is_int(value) and value >= 1
            or isinstance(value, list) and len(value) == layers and all(_is_int(x) and x in (0, 1) for x in value))


def check_preset_values(preset: dict, where: str) -> None:
    """Every key of the right type and range (:data:`INT_KEYS` positive integers, :data:`FLOAT_KEYS` in
    their ranges, :data:`FLAG_KEYS` true or false, :data:`CHOICE_KEYS` one of their choices, the
    patterns N >= 1 or a 0/1 list of ``num_layers`` entries, ``spec`` a spec name of
    :mod:`megatron_kcp.spec`), and the keys consistent with each other as Megatron's validation and
    configs require; ValueError starting with ``where`` and naming the key and the fix otherwise."""
    for key in INT_KEYS:
        value = preset.get(key)
        if key in preset and (not _is_int(value) or value < 1):
            raise ValueError(f"{where}: \"{key}\": {json.dumps(value)} is not a positive integer; "
                             f"write a whole number >= 1, e.g. \"{key}\": 4")
    for key, (low, high, low_ok, example) in FLOAT_KEYS.items():
        value = preset.get(key)
        if key in preset and not (_is_number(value) and (low <= value if low_ok else low < value) and value <= high):
            span = f"{'[' if low_ok else '('}{low:g}, {high:g}]"
            raise ValueError(f"{where}: \"{key}\": {json.dumps(value)} is not a number in {span}; "
                             f"e.g. \"{key}\": {example}")
    for key in FLAG_KEYS:
        if key in preset and not isinstance(preset[key], bool):
            raise ValueError(f"{where}: \"{key}\": {json.dumps(preset[key])} is not true or false; "
                             f"write \"{key}\": true (Megatron's --{key.replace('_', '-')}) or drop it")
    for key, choices in CHOICE_KEYS.items():
        if key in preset and preset[key] not in choices:
            raise ValueError(f"{where}: \"{key}\": {json.dumps(preset[key])} is not one of "
                             f"{', '.join(map(json.dumps, choices))}")
    layers = preset["num_layers"]
    if "linear_attention_freq" in preset and not _pattern_ok(preset["linear_attention_freq"], layers):
        raise ValueError(f"{where}: \"linear_attention_freq\": {json.dumps(preset['linear_attention_freq'])} is "
                         f"neither an integer N >= 1 (every Nth layer is softmax attention) nor a list of "
                         f"num_layers={layers} entries of 1 (linear) or 0 (softmax attention)")
    if "moe_layer_freq" in preset and not _pattern_ok(preset["moe_layer_freq"], layers):
        raise ValueError(f"{where}: \"moe_layer_freq\": {json.dumps(preset['moe_layer_freq'])} is neither an "
                         f"integer N >= 1 (every Nth layer from the first is MoE) nor a list of num_layers={layers} "
                         "entries of 1 (MoE) or 0 (dense MLP)")
    nope = preset.get("no_rope_freq")
    if "no_rope_freq" in preset and not (_pattern_ok(nope, layers) and (isinstance(nope, list) or layers % nope == 0)):
        raise ValueError(f"{where}: \"no_rope_freq\": {json.dumps(nope)} is neither an integer N >= 1 dividing "
                         f"num_layers={layers} (every Nth layer's attention takes no RoPE; 1: none does) nor a list of "
                         f"{layers} entries of 1 (no RoPE) or 0 (RoPE)")
    if "_doc" in preset and not isinstance(preset["_doc"], str):
        raise ValueError(f"{where}: \"_doc\" must be a string (a description of the preset)")
    if "spec" in preset:
        check_spec_name(preset["spec"], where)
    check_consistency(preset, where)


def _moe_layers(p: dict) -> list[int]:
    """The 1-based layers with a MoE MLP (none without ``num_experts``), as megatron-core reads moe_layer_freq."""
    if not p.get("num_experts"):
        return []
    freq = p.get("moe_layer_freq", 1)
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(p["num_layers"])]
    return [i + 1 for i, x in enumerate(pattern) if x]


def _attention_layers(p: dict) -> list[int]:
    """The 1-based softmax-attention layers under ``linear_attention_freq`` (megatron_kcp.spec's rule)."""
    freq = p.get("linear_attention_freq")
    if freq is None:
        return []
    if isinstance(freq, list):
        return [i + 1 for i, x in enumerate(freq) if not x]
    return [n for n in range(1, p["num_layers"] + 1) if n % freq == 0]


def head_dim(p: dict) -> int | None:
    """Softmax attention's head dim (``kv_channels``, Megatron's hidden / heads where unset); None under MLA."""
    if p.get("multi_latent_attention"):
        return None
    return p.get("kv_channels") or p["hidden_size"] // p["num_attention_heads"]


def check_consistency(p: dict, where: str) -> None:
    """The preset's keys against each other, as Megatron's validate_args and TransformerConfig (or MLA's
    config) would refuse them at startup, and the KCP spec's own rules; ValueError naming the key and the fix."""
    def fail(msg):
        raise ValueError(f"{where}: {msg}")
    heads, groups = p["num_attention_heads"], p.get("num_query_groups")
    mla = p.get("multi_latent_attention", False)
    if groups is not None and heads % groups:
        fail(f"\"num_attention_heads\": {heads} is not a multiple of \"num_query_groups\": {groups}; use query "
             f"groups that divide the heads ({', '.join(map(str, divisors(heads)))})")
    if "kv_channels" not in p and not mla and p["hidden_size"] % heads:
        fail(f"\"hidden_size\": {p['hidden_size']} is not divisible by \"num_attention_heads\": {heads}; set "
             "\"kv_channels\" (the head dim) or change the heads")
    if p["linear_num_value_heads"] % p["linear_num_key_heads"]:
        fail(f"\"linear_num_value_heads\": {p['linear_num_value_heads']} is not a multiple of "
             f"\"linear_num_key_heads\": {p['linear_num_key_heads']}; the value heads are groups of the q/k heads")
    # mixture of experts (megatron-core's TransformerConfig and validate_args)
    experts = p.get("num_experts")
    if experts is None:
        stray = [k for k in MOE_KEYS if k in p]
        if stray:
            fail(f"\"{stray[0]}\" needs \"num_experts\": add \"num_experts\" (the routed experts) or drop the MoE keys "
                 f"({len(stray)} here)")
    else:
        topk = p.get("moe_router_topk", 2)
        if topk > experts:
            fail(f"\"moe_router_topk\": {topk} exceeds \"num_experts\": {experts}; route each token to at most "
                 f"{experts} experts")
        if p.get("moe_shared_expert_gate") and "moe_shared_expert_intermediate_size" not in p:
            fail("\"moe_shared_expert_gate\" gates the shared expert: add \"moe_shared_expert_intermediate_size\" "
                 "(the shared expert's FFN) or drop the gate")
        score = p.get("moe_router_score_function", "softmax")
        if p.get("moe_router_enable_expert_bias") and score not in ("sigmoid", "sqrtsoftplus"):
            fail(f"\"moe_router_enable_expert_bias\" (aux-loss-free balancing) needs \"moe_router_score_function\" "
                 f"\"sigmoid\" or \"sqrtsoftplus\", not {json.dumps(score)}")
        if topk == 1 and score == "softmax" and not p.get("moe_router_pre_softmax") \
                and p.get("moe_router_load_balancing_type") != "sinkhorn":
            fail("\"moe_router_topk\": 1 with the softmax router needs \"moe_router_pre_softmax\": true (a softmax "
                 "over one expert has no gradient)")
        if p.get("moe_router_load_balancing_type") == "none" and p.get("moe_aux_loss_coeff", 0) > 0:
            fail(f"\"moe_aux_loss_coeff\": {p['moe_aux_loss_coeff']} with \"moe_router_load_balancing_type\": "
                 "\"none\" has no loss to scale; set a balancing type (e.g. \"aux_loss\") or drop the coefficient")
        if "moe_ffn_hidden_size" not in p and "ffn_hidden_size" not in p:
            fail("\"num_experts\" needs the experts' FFN size: add \"moe_ffn_hidden_size\" (Megatron would take "
                 "ffn_hidden_size, which this preset does not set either)")
        if not _moe_layers(p):
            fail(f"\"moe_layer_freq\": {json.dumps(p['moe_layer_freq'])} makes no layer MoE; put a 1 in the list "
                 "or drop \"num_experts\"")
        if len(_moe_layers(p)) < p["num_layers"] and "ffn_hidden_size" not in p:
            fail("\"moe_layer_freq\" leaves dense layers: add \"ffn_hidden_size\" (their MLP's size)")
    # multi-latent attention (megatron-core's MLATransformerConfig and validate_args)
    if mla:
        for key, why in (("num_query_groups", "MLA's latent KV replaces grouped-query attention (Megatron refuses "
                                              "both)"),
                         ("kv_channels", "MLA's head dims are \"qk_head_dim\", \"qk_pos_emb_head_dim\" and "
                                         "\"v_head_dim\""),
                         ("attention_output_gate", "megatron-core 0.19's MLA has no output gate")):
            if key in p and p[key] is not False:
                fail(f"\"{key}\" with \"multi_latent_attention\": {why}; drop \"{key}\"")
    else:
        stray = [k for k in MLA_KEYS if k in p]
        if stray:
            fail(f"\"{stray[0]}\" is an MLA size: add \"multi_latent_attention\": true or drop {stray}")
    # rotary embeddings
    rope = p.get("position_embedding_type", DEFAULTS["position_embedding_type"]) == "rope"
    if not rope and not mla:
        stray = [k for k in ("rotary_percent", "rotary_base", "no_rope_freq") if k in p]
        if stray:
            fail(f"\"{stray[0]}\" needs RoPE: \"position_embedding_type\" is \"none\"; drop {stray} or use \"rope\"")
    if mla and "no_rope_freq" in p and p.get("rope_type") != "rope":
        fail(f"\"no_rope_freq\" with MLA needs \"rope_type\": \"rope\" (YaRN's mscale would change a NoPE layer's "
             f"softmax scale), not {json.dumps(p.get('rope_type', 'yarn'))}")
    dim = head_dim(p)
    if rope and dim is not None:
        rotary = dim * p.get("rotary_percent", 1.0)
        if rotary != int(rotary) or int(rotary) % 2 or rotary < 2:
            fail(f"\"rotary_percent\": {p.get('rotary_percent', 1.0)} of the head dim {dim} is {rotary:g} rotary "
                 "dims; RoPE rotates an even number of them: pick a percent that gives one")
    if "kda_gate_rank" in p:
        spec = p.get("spec", DEFAULT_SPEC)
        base, _, options = spec.partition(":")
        if "kda" not in base:
            fail("\"kda_gate_rank\" is the KDA mixer's: use a KDA spec (e.g. \"spec\": \"kda_hybrid_layer_spec\") "
                 "or drop it")
        if "kda_gate_rank" in options:
            fail(f"\"kda_gate_rank\" is set twice (and in \"spec\": {json.dumps(spec)}): keep one")


def check_spec_name(name, where: str) -> None:
    """``name`` is one of :data:`megatron_kcp.SPEC_NAMES`, with options only for the KDA spec
    (``kda_hybrid_layer_spec:kda_gate_rank=64``), which are checked by building that spec (importing
    megatron-core; a plain name does not)."""
    if not isinstance(name, str):
        raise ValueError(f"{where}: \"spec\": {json.dumps(name)} is not a string; write a spec name, "
                         f"e.g. \"spec\": \"{DEFAULT_SPEC}\"")
    where = f"{where}: \"spec\": {json.dumps(name)}"
    if split_spec_name(name, where)[1]:       # the options are the KDA mixer's: their check imports megatron-core
        from megatron_kcp.spec import spec_from_name
        spec_from_name(name, where)


def spec_name(p: dict) -> str:
    """The spec's name on the command line: the preset's, with ``kda_gate_rank`` as a spec option (so that
    pretrain_gpt.py, which has no plugin flags, gets it too)."""
    name = p.get("spec", DEFAULT_SPEC)
    if "kda_gate_rank" in p:
        name += ("," if ":" in name else ":") + f"kda_gate_rank={p['kda_gate_rank']}"
    return name


def _pipeline_stages(p: dict, pp: int, extra) -> None:
    """The layers split over ``pp`` stages: evenly, or as the trainer's own --decoder-first/last-pipeline-num-layers
    (after ``--``) split them, or a --pipeline-model-parallel-layout (left to Megatron)."""
    layers = p["num_layers"]
    if pp == 1 or "--pipeline-model-parallel-layout" in extra:
        return
    ends = {flag: _flag_value(extra, flag) for flag in ("--decoder-first-pipeline-num-layers",
                                                        "--decoder-last-pipeline-num-layers")}
    given = [v for v in ends.values() if v is not None]
    rest, stages = layers - sum(given), pp - len(given)
    if given and (stages < 1 or rest < stages or rest % stages):
        raise ValueError(f"num_layers={layers} minus the first/last stages' {'+'.join(map(str, given))} layers leaves "
                         f"{rest} for {stages} middle stages of --pp {pp}: they must split evenly")
    if not given and layers % pp:
        good = ", ".join(map(str, divisors(layers)))
        raise ValueError(f"num_layers={layers} is not divisible by --pp {pp}: use --pp in {good}, or split unevenly "
                         f"with the trainer's -- --decoder-first-pipeline-num-layers N (and/or "
                         f"--decoder-last-pipeline-num-layers M) so that the other stages get equal shares")


def _flag_value(argv, flag: str, kind=int):
    """The value (an integer unless ``kind``) of the last ``flag N`` or ``flag=N`` in ``argv`` (None if absent)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{flag} {value}: not an integer") from None


def effective(p: dict, extra=()) -> dict:
    """The preset with the trainer's own --seq-length (after ``--``), which wins over the preset's."""
    seq = _flag_value(extra, "--seq-length")
    return p if seq is None else {**p, "seq_length": seq}


def check_sizes(p: dict, world: int, tp: int, cp: int, pp: int, sequence_parallel: bool, ep: int = 1,
                etp: int | None = None, extra=()) -> int:
    """Data-parallel size for this layout; ValueError naming the fix otherwise. Megatron's rules
    (megatron.core.parallel_state.initialize_model_parallel): the world is TP x CP x PP x DP; the experts'
    grid lies over the same ranks as ETP x EP x PP x expert-DP (ETP = TP unless ``etp``), so EP x ETP x PP
    divides the world too. Under MoE with TP > 1 Megatron needs sequence parallelism (the command adds it)."""
    for flag in PARALLEL_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            raise ValueError(f"{flag} after --: give the launcher's {PARALLEL_FLAGS[flag]} instead (it checks "
                             "the sizes against it)")
    p = effective(p, extra)
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} is not a multiple of TP*CP*PP = {tp}*{cp}*{pp}: change "
                         "--nproc-per-node/--nnodes or the parallel sizes")
    check_head_dims(p)
    _pipeline_stages(p, pp, extra)
    moe = bool(p.get("num_experts"))
    check_split(p, tp, cp, sequence_parallel or (moe and tp > 1))
    check_moe_split(p, tp, ep, etp)
    dp = world // (tp * cp * pp)
    expert_grid = (tp if etp is None else etp) * ep * pp
    if moe and world % expert_grid:
        raise ValueError(f"EP*ETP*PP = {ep}*{tp if etp is None else etp}*{pp} does not divide the world size {world}: "
                         f"megatron-core lays the experts over the ranks of TP*CP*DP = {tp * cp * dp} per pipeline "
                         "stage; pick --ep (and --etp) whose product divides that")
    dense = not moe or len(_moe_layers(p)) < p["num_layers"]       # layers with a dense MLP
    if dense and p.get("ffn_hidden_size") is not None and p["ffn_hidden_size"] % tp:
        raise ValueError(f"ffn_hidden_size {p['ffn_hidden_size']} is not divisible by --tp {tp}: use --tp in "
                         f"{', '.join(map(str, divisors(p['ffn_hidden_size'])))}")
    documents = "--dataloader-inter-document-masking" in extra       # THD packs, cut across documents (the spec's rule)
    balancing = _flag_value(extra, "--moe-router-load-balancing-type", str) or p.get("moe_router_load_balancing_type")
    if documents and cp > 1 and p.get("num_experts") and balancing == "seq_aux_loss":
        raise ValueError("moe_router_load_balancing_type seq_aux_loss with --dataloader-inter-document-masking at "
                         "--cp > 1: megatron-core groups a rank's tokens into samples that CP has cut; pass -- "
                         "--moe-router-load-balancing-type aux_loss (or global_aux_loss), or --cp 1")
    mtp = _flag_value(extra, "--mtp-num-layers")
    if documents and cp > 1 and (p.get("mtp_num_layers") if mtp is None else mtp):
        raise ValueError("mtp_num_layers with --dataloader-inter-document-masking at --cp > 1: Megatron's MTP layer "
                         "takes only the per-document cut; pass -- --mtp-num-layers 0 (or --sft), or --cp 1")
    rank = p.get("kda_gate_rank") or (p["linear_value_head_dim"] if "kda" in p.get("spec", "") else None)
    if rank is not None and rank % tp:
        raise ValueError(f"kda_gate_rank {rank} is not divisible by --tp {tp} (the KDA gates are split over it): "
                         f"use --tp in {', '.join(map(str, divisors(rank)))}")
    return dp


def megatron_args(p: dict, tp: int, cp: int, pp: int, sequence_parallel: bool, extra=(), ep: int = 1,
                  etp: int | None = None) -> list[str]:
    """The trainer's arguments for preset ``p`` and this layout; mock data and NullTokenizer unless the
    trainer's own arguments ``extra`` name data (--data-path ...) or a tokenizer (:func:`default_data_args`).
    Under MoE: --expert-model-parallel-size (and --expert-tensor-parallel-size with ``etp``), the all-to-all
    dispatcher when EP > 1, and --sequence-parallel when TP > 1 (Megatron's MoE layer refuses TP without it)."""
    args = ["--spec", "megatron_kcp", spec_name(p)]
    values = {**DEFAULTS, **p}
    for key in MODEL_KEYS:
        if key not in values or key in ("vocab_size", "kda_gate_rank"):
            continue
        flag, value = f"--{key.replace('_', '-')}", values[key]
        if key in FLAG_KEYS:
            args += [flag] if value else []
        elif isinstance(value, list):       # Megatron's pattern types take digits, commas and brackets only
            args += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            args += [flag, str(value)]
    if "num_query_groups" in p:
        args.append("--group-query-attention")
    moe = bool(p.get("num_experts"))
    args += ["--max-position-embeddings", str(p["seq_length"]), "--vocab-size", str(p["vocab_size"]),
             "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
             "--pipeline-model-parallel-size", str(pp)]
    if moe:
        args += ["--expert-model-parallel-size", str(ep)]
        if etp is not None:
            args += ["--expert-tensor-parallel-size", str(etp)]
        if ep > 1:
            args += ["--moe-token-dispatcher-type", "alltoall"]
    if p.get("multi_latent_attention") and p.get("rope_type") == "rope":
        args.append("--no-rope-fusion")         # megatron-core's MLA fuses RoPE for YaRN only
    args += ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--bf16", *default_data_args(extra),
             "--micro-batch-size", "1", "--lr", "3e-4", "--min-lr", "3e-5",
             "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1",
             "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000",
             # the specs' attention is causal by construction and never reads the dataloader's s x s mask,
             # which at 1M tokens would be a terabyte per sample
             "--no-create-attention-mask-in-dataloader"]
    if tp > 1 and (sequence_parallel or moe):
        args.append("--sequence-parallel")
    return args


def layout(p: dict, world: int, tp: int, cp: int, pp: int, ep: int, etp: int | None, dp: int) -> str:
    """One line on the layout the sizes were checked for (``--dry-run`` prints it on stderr)."""
    line = f"# world {world} = TP {tp} x CP {cp} x PP {pp} x DP {dp}"
    if p.get("num_experts"):
        e = tp if etp is None else etp
        line += (f"; experts {p['num_experts']} over EP {ep} ({p['num_experts'] // ep} a rank) x ETP {e} x "
                 f"expert-DP {world // (e * ep * pp)}")
    attention = _attention_layers(p)
    line += (f"; {p['num_layers']} layers, softmax attention at {attention or 'none'}, "
             f"{p['num_layers'] // pp if p['num_layers'] % pp == 0 else 'uneven'} a stage")
    return line


def build_command(a) -> list[str]:
    preset = load_preset(a.preset)
    world = a.nnodes * a.nproc_per_node
    dp = check_sizes(preset, world, a.tp, a.cp, a.pp, a.sequence_parallel, a.ep, a.etp, a.extra)
    trainer = ([str(Path(a.megatron_lm).expanduser() / "pretrain_gpt.py")] if a.megatron_lm
               else ["-m", "megatron_kcp.train"])
    run = ["torchrun", f"--nnodes={a.nnodes}", f"--nproc-per-node={a.nproc_per_node}"]
    if a.nnodes == 1:
        run.append(f"--master-port={a.master_port}")
    else:
        if not a.master_addr:
            raise ValueError("multi-node runs need --master-addr (or MASTER_ADDR) of the rank-0 node")
        if not 0 <= a.node_rank < a.nnodes:
            raise ValueError(f"--node-rank {a.node_rank} is outside 0..{a.nnodes - 1} (--nnodes {a.nnodes})")
        run += [f"--node-rank={a.node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={a.master_addr}:{a.master_port}"]
    model = megatron_args(preset, a.tp, a.cp, a.pp, a.sequence_parallel, a.extra, a.ep, a.etp)
    if a.fp32:
        model.remove("--bf16")
    if a.megatron_lm:          # megatron_kcp.train adds these itself
        model += no_te_args(model + a.extra)
    cmd = run + trainer + model + a.extra
    if "--global-batch-size" not in a.extra:          # one micro batch of 1 per data-parallel rank
        cmd += ["--global-batch-size", str(dp)]
    a.layout = layout(effective(preset, a.extra), world, a.tp, a.cp, a.pp, a.ep, a.etp, dp)
    return cmd


def parser():
    p = argparse.ArgumentParser(prog="python -m megatron_kcp.launch", description=__doc__.splitlines()[0],
                                epilog="Arguments after -- go to the trainer.")
    p.add_argument("preset", help="a JSON preset from configs/")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE presets)")
    p.add_argument("--etp", type=int, default=None,
                   help="expert tensor-parallel size (MoE presets; default: megatron-core's, the TP size)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism (on by itself for MoE presets at TP > 1)")
    p.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 (exact parity checks)")
    p.add_argument("--nnodes", type=int, default=int(os.environ.get("SLURM_NNODES", 1)))
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=int(os.environ.get("SLURM_NODEID", 0)))
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"))
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 29500)))
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                   help="train with this Megatron-LM checkout's pretrain_gpt.py (default: megatron_kcp.train)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)      # the rest goes to pretrain_gpt.py
    a = parser().parse_args(argv[:cut])
    a.extra = argv[cut + 1:]
    for name in ("tp", "cp", "pp", "ep", "etp", "nnodes", "nproc_per_node"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        cmd = build_command(a)
    except ValueError as e:
        parser().error(str(e))
    if a.dry_run:
        print(a.layout, file=sys.stderr)
        print(shlex.join(cmd))
        return 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if shutil.which("torchrun") is None:          # torch installed without its console scripts on PATH
        cmd[:1] = [sys.executable, "-m", "torch.distributed.run"]
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
