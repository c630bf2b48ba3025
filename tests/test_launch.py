"""The launcher: presets, size checks that name the fix, and the command it would run."""
from __future__ import annotations

import json
import pathlib
import re
import shlex

import pytest

from megatron_kcp import launch

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _dry(capsys, *argv):
    assert launch.main(["--dry-run", *argv]) == 0
    return shlex.split(capsys.readouterr().out)


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.json")))
def test_presets_load_and_check(preset):
    p = launch.load_preset(CONFIGS / preset)
    assert launch.check_sizes(p, world=8, tp=1, cp=4, pp=1, sequence_parallel=False) == 2


def test_single_node_command(capsys):
    cmd = _dry(capsys, str(CONFIGS / "tiny-kda.json"), "--nproc-per-node", "4", "--cp", "4",
               "--megatron-lm", "/opt/Megatron-LM", "--", "--train-iters", "10")
    assert cmd[:4] == ["torchrun", "--nnodes=1", "--nproc-per-node=4", "--master-port=29500"]
    assert cmd[4] == "/opt/Megatron-LM/pretrain_gpt.py"
    i = cmd.index("--spec")
    assert cmd[i + 1:i + 3] == ["megatron_kcp", "kda_hybrid_layer_spec"]
    assert cmd[cmd.index("--context-parallel-size") + 1] == "4"
    assert cmd[cmd.index("--global-batch-size") + 1] == "1" and cmd[-4:-2] == ["--train-iters", "10"]


def test_pip_only_entry_is_the_default(capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    cmd = _dry(capsys, str(CONFIGS / "tiny-gdn.json"), "--nproc-per-node", "2", "--cp", "2", "--master-port", "29611")
    assert cmd[3:6] == ["--master-port=29611", "-m", "megatron_kcp.train"]
    assert cmd[cmd.index("--hidden-dropout") + 1] == "0"       # CP runs must see the same function as CP=1
    assert "--bf16" in cmd
    assert "--bf16" not in _dry(capsys, str(CONFIGS / "tiny-gdn.json"), "--fp32")


def test_multi_node_command(capsys):
    cmd = _dry(capsys, str(CONFIGS / "qwen3-next-gdn.json"), "--nnodes", "2", "--nproc-per-node", "8",
               "--tp", "2", "--cp", "8", "--node-rank", "1", "--master-addr", "n0", "--sequence-parallel")
    assert "--node-rank=1" in cmd and "--rdzv-endpoint=n0:29500" in cmd and "--sequence-parallel" in cmd


@pytest.mark.parametrize("argv,match", [
    (["--nproc-per-node", "6", "--cp", "4"], "not a multiple of TP\\*CP\\*PP"),
    (["--nproc-per-node", "8", "--tp", "8"], "not divisible by --tp 8"),
    (["--nproc-per-node", "4", "--pp", "4", "--cp", "1"], None),
    (["--nproc-per-node", "8", "--pp", "8"], "num_layers=4 is not divisible by --pp 8"),
    (["--nnodes", "2", "--nproc-per-node", "4"], "--master-addr"),
])
def test_bad_sizes_fail_before_start(argv, match, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    if match is None:
        _dry(capsys, str(CONFIGS / "tiny-gdn.json"), *argv)
        return
    with pytest.raises(SystemExit) as e:
        launch.main(["--dry-run", str(CONFIGS / "tiny-gdn.json"), *argv])
    assert e.value.code == 2 and re.search(match, capsys.readouterr().err)


def test_sequence_length_must_split_zigzag(tmp_path, capsys):
    preset = tmp_path / "odd.json"
    preset.write_text((CONFIGS / "tiny-gdn.json").read_text().replace('"seq_length": 4096', '"seq_length": 4100'))
    with pytest.raises(SystemExit):
        launch.main(["--dry-run", str(preset), "--nproc-per-node", "4", "--cp", "4"])
    assert "multiple of 8" in capsys.readouterr().err


@pytest.mark.parametrize("text,match", [
    (None, r"preset .*nope\.json: no such file; give the path of a JSON preset, "
           r"e\.g\. one of configs/\{.*tiny-gdn\.json"),
    ('{"num_layers": 4,', r"preset .*bad\.json: not valid JSON \(.* at line 1, column \d+\): fix the file"),
    ('[4, 256]', r"preset .*bad\.json: must be a JSON object"),
    ('{"num_layers": 4, "hidden_size": 256}',
     r"preset .*bad\.json: missing keys \['num_attention_heads', .*'vocab_size'\]"),
    ('{"num_layer": 4}', r"preset .*bad\.json: unknown keys \['num_layer'\]; the allowed keys are num_layers, "
                         r"hidden_size, .*, vocab_size, num_experts, .*, moe_layer_freq, no_rope_freq, spec, _doc$"),
])
def test_preset_errors_name_the_file_and_the_fix(text, match, tmp_path, capsys):
    path = tmp_path / ("nope.json" if text is None else "bad.json")
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as e:           # an argparse error, not a traceback
        launch.main(["--dry-run", str(path)])
    assert e.value.code == 2 and re.search(match, capsys.readouterr().err)


@pytest.mark.parametrize("te", [False, True])
def test_megatron_lm_command_without_te_turns_off_te_fusions(te, capsys, monkeypatch):
    """pretrain_gpt.py stops at startup on Megatron's TE/apex fusion defaults when TE is missing; the
    launcher adds the flags that turn them off then (megatron_kcp.train adds its own), and only then."""
    from megatron_kcp import environment as te_mod
    monkeypatch.setattr(te_mod, "te_available", lambda: te)
    flags = [x for flag in te_mod.NO_TE_ARGS for x in flag]
    mlm = _dry(capsys, str(CONFIGS / "tiny-gdn.json"), "--megatron-lm", "/opt/Megatron-LM")
    assert all(f in mlm for f in flags) != te and (te or mlm[mlm.index("--transformer-impl") + 1] == "local")
    assert not set(flags) & set(_dry(capsys, str(CONFIGS / "tiny-gdn.json")))        # megatron_kcp.train
    own = _dry(capsys, str(CONFIGS / "tiny-gdn.json"), "--megatron-lm", "/opt/Megatron-LM", "--",
               "--transformer-impl", "transformer_engine")
    assert own.count("--transformer-impl") == 1 and own[own.index("--transformer-impl") + 1] == "transformer_engine"


def _preset(tmp_path, base="tiny-gdn.json", **change):
    """``base`` (tiny-gdn.json) with ``change`` applied (a value of None drops the key)."""
    preset = json.loads((CONFIGS / base).read_text())
    preset.update(change)
    path = tmp_path / "changed.json"
    path.write_text(json.dumps({k: v for k, v in preset.items() if v is not None}))
    return path


@pytest.mark.parametrize("change,match", [
    ({"num_layers": "four"}, r'"num_layers": "four" is not a positive integer; write a whole number >= 1'),
    ({"hidden_size": 0}, r'"hidden_size": 0 is not a positive integer'),
    ({"seq_length": -4096}, r'"seq_length": -4096 is not a positive integer'),
    ({"linear_num_key_heads": 2.5}, r'"linear_num_key_heads": 2.5 is not a positive integer'),
    ({"vocab_size": True}, r'"vocab_size": true is not a positive integer'),
    ({"num_query_groups": None, "kv_channels": 0}, r'"kv_channels": 0 is not a positive integer'),
    ({"linear_attention_freq": 0}, r'"linear_attention_freq": 0 is neither an integer N >= 1 .* nor a list of '
                                   r"num_layers=4 entries of 1 \(linear\) or 0"),
    ({"linear_attention_freq": [1, 1, 0]}, r'"linear_attention_freq": \[1, 1, 0\] is neither'),
    ({"linear_attention_freq": [1, 2, 1, 0]}, r'"linear_attention_freq": \[1, 2, 1, 0\] is neither'),
    ({"linear_attention_freq": "4"}, r'"linear_attention_freq": "4" is neither'),
    ({"spec": "gdn_hybrd_layer_spec"},
     r'"spec": "gdn_hybrd_layer_spec": unknown spec .*; use one of gdn_hybrid_layer_spec, kda_hybrid_layer_spec'),
    ({"spec": 4}, r'"spec": 4 is not a string; write a spec name, e.g. "spec": "gdn_hybrid_layer_spec"'),
    ({"spec": "gdn_hybrid_layer_spec:kda_gate_rank=32"},
     r'"spec": "gdn_hybrid_layer_spec:kda_gate_rank=32": gdn_hybrid_layer_spec takes no options'),
    ({"spec": "kda_hybrid_layer_spec:kda_gate_rank=0"},
     r'"spec": "kda_hybrid_layer_spec:kda_gate_rank=0": kda_gate_rank=0: must be a positive int'),
    ({"_doc": ["a", "list"]}, r'"_doc" must be a string'),
])
def test_bad_preset_values_fail_before_start(change, match, tmp_path, capsys):
    """Wrong types, non-positive sizes and unknown spec names stop --dry-run too, naming the file and the fix."""
    path = _preset(tmp_path, **change)
    with pytest.raises(SystemExit) as e:
        launch.main(["--dry-run", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(f"preset {re.escape(str(path))}: " + match, err), err


@pytest.mark.parametrize("change", [
    {"linear_attention_freq": [1, 0, 1, 0]},
    {"spec": "kda_hybrid_layer_spec:kda_gate_rank=32,kda_norm_eps=1e-6"},
    {"spec": "cp2hp_gdn_hybrid_layer_spec"},
    {"spec": None, "_doc": None, "linear_attention_freq": None, "ffn_hidden_size": None},
])
def test_good_preset_values_pass(change, tmp_path, capsys):
    cmd = _dry(capsys, str(_preset(tmp_path, **change)))
    i = cmd.index("--spec")
    assert cmd[i + 1:i + 3] == ["megatron_kcp", change.get("spec") or "gdn_hybrid_layer_spec"]
    if isinstance(change.get("linear_attention_freq"), list):      # Megatron's la_freq_type takes no spaces
        assert cmd[cmd.index("--linear-attention-freq") + 1] == "[1,0,1,0]"


def test_node_rank_within_nnodes(capsys):
    with pytest.raises(SystemExit):
        launch.main(["--dry-run", str(CONFIGS / "tiny-gdn.json"), "--nnodes", "2", "--node-rank", "2",
                     "--master-addr", "n0"])
    assert "--node-rank 2 is outside 0..1 (--nnodes 2)" in capsys.readouterr().err


def test_trainer_does_not_import_the_launcher():
    """The size checks both use live in megatron_kcp.sizes: no module of the package imports the launcher
    (so the trainer does not, directly or through another module)."""
    import ast
    package = CONFIGS.parent / "megatron_kcp"
    importers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if "megatron_kcp.launch" in names:
                importers.append(str(path.relative_to(package)))
    assert importers == [], importers


QN, KL = "tiny-qwen3-next.json", "tiny-kimi-linear.json"


@pytest.mark.parametrize("base,change,match", [
    # types and ranges of the MoE, MLA, RoPE and norm keys
    (QN, {"qk_layernorm": 1}, r'"qk_layernorm": 1 is not true or false; write "qk_layernorm": true '
                              r"\(Megatron's --qk-layernorm\) or drop it"),
    (QN, {"rotary_percent": 0}, r'"rotary_percent": 0 is not a number in \(0, 1\]; e.g. "rotary_percent": 0.25'),
    (QN, {"rotary_percent": 1.5}, r'"rotary_percent": 1.5 is not a number in \(0, 1\]'),
    (QN, {"norm_epsilon": "1e-6"}, r'"norm_epsilon": "1e-6" is not a number in \(0, 1\]'),
    (QN, {"moe_aux_loss_coeff": -1}, r'"moe_aux_loss_coeff": -1 is not a number in \[0, inf\]'),
    (QN, {"mtp_num_layers": 0}, r'"mtp_num_layers": 0 is not a positive integer'),
    (QN, {"num_experts": 2.0}, r'"num_experts": 2.0 is not a positive integer'),
    (QN, {"moe_router_score_function": "relu"},
     r'"moe_router_score_function": "relu" is not one of "softmax", "sigmoid", "sqrtsoftplus"'),
    (QN, {"position_embedding_type": "learned_absolute"},
     r'"position_embedding_type": "learned_absolute" is not one of'),
    (QN, {"moe_layer_freq": [1, 1]}, r'"moe_layer_freq": \[1, 1\] is neither an integer N >= 1 \(every Nth layer '
                                     r"from the first is MoE\) nor a list of num_layers=4 entries of 1 \(MoE\)"),
    (QN, {"moe_layer_freq": 0}, r'"moe_layer_freq": 0 is neither'),
    # consistency: MoE
    (QN, {"num_experts": None}, r'"moe_router_topk" needs "num_experts": add "num_experts" .* or drop the MoE keys'),
    (QN, {"moe_router_topk": 9}, r'"moe_router_topk": 9 exceeds "num_experts": 8; route each token to at most 8'),
    (QN, {"moe_shared_expert_intermediate_size": None},
     r'"moe_shared_expert_gate" gates the shared expert: add "moe_shared_expert_intermediate_size"'),
    (QN, {"moe_router_enable_expert_bias": True},
     r'"moe_router_enable_expert_bias" \(aux-loss-free balancing\) needs "moe_router_score_function" "sigmoid" or '
     r'"sqrtsoftplus", not "softmax"'),
    (QN, {"moe_router_topk": 1}, r'"moe_router_topk": 1 with the softmax router needs "moe_router_pre_softmax": true'),
    (QN, {"moe_router_load_balancing_type": "none"},
     r'"moe_aux_loss_coeff": 0.001 with "moe_router_load_balancing_type": "none" has no loss to scale'),
    (QN, {"moe_ffn_hidden_size": None, "ffn_hidden_size": None},
     r'"num_experts" needs the experts\' FFN size: add "moe_ffn_hidden_size"'),
    (QN, {"moe_layer_freq": [0, 0, 0, 0]}, r'"moe_layer_freq": \[0, 0, 0, 0\] makes no layer MoE'),
    (QN, {"moe_layer_freq": [0, 1, 1, 1], "ffn_hidden_size": None},
     r'"moe_layer_freq" leaves dense layers: add "ffn_hidden_size"'),
    # consistency: attention, MLA, RoPE
    (QN, {"num_query_groups": 3}, r'"num_attention_heads": 4 is not a multiple of "num_query_groups": 3; use query '
                                  r"groups that divide the heads \(1, 2, 4\)"),
    ("tiny-gdn.json", {"hidden_size": 130}, r'"hidden_size": 130 is not divisible by "num_attention_heads": 4; set '
                                            r'"kv_channels"'),
    ("tiny-gdn.json", {"linear_num_value_heads": 6},
     r'"linear_num_value_heads": 6 is not a multiple of "linear_num_key_heads": 4'),
    (KL, {"num_query_groups": 2}, r'"num_query_groups" with "multi_latent_attention": MLA\'s latent KV replaces '
                                  r'grouped-query attention .*; drop "num_query_groups"'),
    (KL, {"attention_output_gate": True}, r'"attention_output_gate" with "multi_latent_attention": megatron-core '
                                          r"0.19's MLA has no output gate"),
    (KL, {"kv_channels": 32}, r'"kv_channels" with "multi_latent_attention": MLA\'s head dims are "qk_head_dim"'),
    (KL, {"multi_latent_attention": False}, r'"kv_lora_rank" is an MLA size: add "multi_latent_attention": true or '
                                            r"drop \['kv_lora_rank', "),
    (QN, {"position_embedding_type": "none"}, r'"rotary_percent" needs RoPE: "position_embedding_type" is "none"'),
    (QN, {"rotary_percent": 0.3}, r'"rotary_percent": 0.3 of the head dim 32 is 9.6 rotary dims; RoPE rotates an '
                                  r"even number of them"),
    (KL, {"no_rope_freq": 3}, r'"no_rope_freq": 3 is neither an integer N >= 1 dividing num_layers=4 \(every Nth '
                              r"layer's attention takes no RoPE; 1: none does\) nor a list of 4 entries"),
    (KL, {"rope_type": "yarn"}, r'"no_rope_freq" with MLA needs "rope_type": "rope" \(YaRN\'s mscale would change a '
                                r'NoPE layer\'s softmax scale\), not "yarn"'),
    ("tiny-gdn.json", {"position_embedding_type": "none", "no_rope_freq": 4},
     r'"no_rope_freq" needs RoPE: "position_embedding_type" is "none"'),
    # KDA's gate rank
    ("tiny-gdn.json", {"kda_gate_rank": 16}, r'"kda_gate_rank" is the KDA mixer\'s: use a KDA spec'),
    ("tiny-kda.json", {"kda_gate_rank": 16, "spec": "kda_hybrid_layer_spec:kda_gate_rank=32"},
     r'"kda_gate_rank" is set twice \(and in "spec": "kda_hybrid_layer_spec:kda_gate_rank=32"\): keep one'),
])
def test_bad_model_keys_fail_before_start(base, change, match, tmp_path, capsys):
    """Each MoE / MLA / RoPE / norm key of the wrong type, range or against another key stops --dry-run with one
    line naming the file, the key and the fix."""
    path = _preset(tmp_path, base, **change)
    with pytest.raises(SystemExit) as e:
        launch.main(["--dry-run", str(path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(f"preset {re.escape(str(path))}: " + match, err), err
    assert len(err.strip().splitlines()[-1]) < 400


def test_kda_gate_rank_travels_in_the_spec_name(tmp_path, capsys):
    cmd = _dry(capsys, str(_preset(tmp_path, "tiny-kda.json", kda_gate_rank=16)))
    i = cmd.index("--spec")
    assert cmd[i + 1:i + 3] == ["megatron_kcp", "kda_hybrid_layer_spec:kda_gate_rank=16"]
    assert "--kda-gate-rank" not in cmd            # pretrain_gpt.py has no plugin flags
    cmd = _dry(capsys, str(_preset(tmp_path, "tiny-kda.json", kda_gate_rank=16,
                                   spec="kda_hybrid_layer_spec:kda_norm_eps=1e-6")))
    assert "kda_hybrid_layer_spec:kda_norm_eps=1e-6,kda_gate_rank=16" in cmd


def test_switches_are_emitted_only_when_true(tmp_path, capsys):
    """Megatron's store-true flags: on when the preset says true, absent when false; the embeddings are untied
    unless the preset says false, RoPE unless it says none."""
    on = _dry(capsys, str(CONFIGS / QN))
    assert {"--qk-layernorm", "--attention-output-gate", "--apply-layernorm-1p", "--moe-shared-expert-gate",
            "--untie-embeddings-and-output-weights"} <= set(on)
    off = _dry(capsys, str(_preset(tmp_path, QN, qk_layernorm=False, attention_output_gate=False,
                                   untie_embeddings_and_output_weights=False)))
    assert not {"--qk-layernorm", "--attention-output-gate", "--untie-embeddings-and-output-weights"} & set(off)
    assert off[off.index("--position-embedding-type") + 1] == "rope"
    plain = _dry(capsys, str(CONFIGS / "tiny-gdn.json"))
    assert "--untie-embeddings-and-output-weights" in plain and "--num-experts" not in plain
    assert "--expert-model-parallel-size" not in plain


@pytest.mark.parametrize("preset,argv,match", [
    (QN, ["--nproc-per-node", "4", "--ep", "3"],
     r"num_experts 8 is not divisible by --ep 3: use an EP that divides it \(1, 2, 4, 8\)"),
    ("tiny-gdn.json", ["--nproc-per-node", "2", "--ep", "2"], r"--ep 2 needs a mixture-of-experts model "
                                                              r"\(num_experts is not set\): use --ep 1"),
    ("tiny-gdn.json", ["--nproc-per-node", "2", "--tp", "2", "--etp", "1"], r"--etp 1 needs a mixture-of-experts"),
    ("qwen3-next-80b-a3b.json", ["--nproc-per-node", "8", "--tp", "2", "--ep", "8"],
     r"EP\*ETP\*PP = 8\*2\*1 does not divide the world size 8: megatron-core lays the experts over the ranks of "
     r"TP\*CP\*DP = 8 per pipeline stage; pick --ep \(and --etp\)"),
    ("qwen3-next-80b-a3b.json", ["--nproc-per-node", "8", "--tp", "4", "--cp", "2"],
     r"num_query_groups 2 is not divisible by --tp 4"),
    ("qwen3-next-80b-a3b.json", ["--nproc-per-node", "8", "--ep", "3"], r"num_experts 512 is not divisible by --ep 3"),
    ("kimi-linear-48b-a3b.json", ["--nproc-per-node", "4", "--pp", "4"],
     r"num_layers=27 is not divisible by --pp 4: use --pp in 1, 3, 9, 27, or split unevenly with the trainer's -- "
     r"--decoder-first-pipeline-num-layers N"),
    ("kimi-linear-48b-a3b.json", ["--nproc-per-node", "4", "--pp", "4", "--", "--decoder-first-pipeline-num-layers",
                                  "5"],
     r"num_layers=27 minus the first/last stages' 5 layers leaves 22 for 3 middle stages of --pp 4: they must split"),
    ("kimi-linear-48b-a3b.json", ["--nproc-per-node", "64", "--tp", "64"],
     r"num_attention_heads 32 is not divisible by --tp 64"),
    (QN, ["--nproc-per-node", "4", "--tp", "2", "--cp", "2", "--", "--seq-length", "1004"],
     r"seq_length 1004 must be a multiple of 8 \(2 x CP for Megatron's zigzag split, times TP for sequence "
     r"parallelism\)"),
    (KL, ["--nproc-per-node", "2", "--cp", "2", "--", "--dataloader-inter-document-masking"],
     r"seq_aux_loss with --dataloader-inter-document-masking at --cp > 1: .*; pass -- "
     r"--moe-router-load-balancing-type aux_loss"),
    (QN, ["--nproc-per-node", "2", "--cp", "2", "--", "--dataloader-inter-document-masking"],
     r"mtp_num_layers with --dataloader-inter-document-masking at --cp > 1: .*; pass -- --mtp-num-layers 0"),
    ("tiny-gdn.json", ["--nproc-per-node", "2", "--", "--tensor-model-parallel-size", "2"],
     r"--tensor-model-parallel-size after --: give the launcher's --tp instead"),
    ("tiny-gdn.json", ["--nproc-per-node", "2", "--", "--expert-model-parallel-size=2"],
     r"--expert-model-parallel-size after --: give the launcher's --ep instead"),
])
def test_bad_parallel_sizes_fail_before_start(preset, argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--dry-run", str(CONFIGS / preset), *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(match, err), err


@pytest.mark.parametrize("change,argv,match", [
    ({"moe_ffn_hidden_size": 51}, ["--tp", "2"], r"moe_ffn_hidden_size 51 is not divisible by --tp 2 \(each expert's "
                                                 r"FFN is split over it\): use --tp in 1, 3, 17, 51, or --etp 1"),
    ({"moe_ffn_hidden_size": 66}, ["--tp", "2", "--etp", "4"], r"moe_ffn_hidden_size 66 is not divisible by --etp 4"),
    ({"moe_shared_expert_intermediate_size": 51}, ["--tp", "2"],
     r"moe_shared_expert_intermediate_size 51 is not divisible by --tp 2"),
    ({"moe_layer_freq": [0, 1, 1, 1], "ffn_hidden_size": 255}, ["--tp", "2"],
     r"ffn_hidden_size 255 is not divisible by --tp 2: use --tp in 1, 3, 5"),
])
def test_expert_ffn_must_split_over_tp(change, argv, match, tmp_path, capsys):
    path = _preset(tmp_path, QN, **change)
    with pytest.raises(SystemExit) as e:
        launch.main(["--dry-run", str(path), "--nproc-per-node", "8", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search(match, err), err


def test_kda_gate_rank_must_split_over_tp(tmp_path, capsys):
    path = _preset(tmp_path, KL, kda_gate_rank=18)
    with pytest.raises(SystemExit):
        launch.main(["--dry-run", str(path), "--nproc-per-node", "4", "--tp", "4"])
    assert "kda_gate_rank 18 is not divisible by --tp 4 (the KDA gates are split over it)" in capsys.readouterr().err


@pytest.mark.parametrize("preset,argv,flags", [
    # MoE at TP > 1: Megatron's MoE layer needs sequence parallelism, so the command adds it
    (QN, ["--nproc-per-node", "2", "--tp", "2"], ["--sequence-parallel"]),
    # EP over the CP ranks (EP x ETP divides TP x CP x DP), the all-to-all dispatcher
    (QN, ["--nproc-per-node", "8", "--cp", "8", "--ep", "8"], ["--expert-model-parallel-size", "8"]),
    # PP = 3 divides Kimi-Linear's 27 layers; uneven stages with the trainer's own flags
    ("kimi-linear-48b-a3b.json", ["--nproc-per-node", "24", "--pp", "3", "--cp", "8", "--ep", "8"],
     ["--pipeline-model-parallel-size", "3"]),
    ("kimi-linear-48b-a3b.json", ["--nproc-per-node", "4", "--pp", "4", "--", "--decoder-first-pipeline-num-layers",
                                  "6"], ["--decoder-first-pipeline-num-layers", "6"]),
    ("kimi-linear-48b-a3b.json", ["--nproc-per-node", "4", "--pp", "4", "--", "--decoder-first-pipeline-num-layers",
                                  "5", "--decoder-last-pipeline-num-layers", "6"],
     ["--decoder-last-pipeline-num-layers"]),
    # documents at CP > 1: the fixes the errors name
    (KL, ["--nproc-per-node", "2", "--cp", "2", "--", "--dataloader-inter-document-masking",
          "--moe-router-load-balancing-type", "aux_loss"], ["--dataloader-inter-document-masking"]),
    (QN, ["--nproc-per-node", "2", "--cp", "2", "--", "--dataloader-inter-document-masking", "--mtp-num-layers", "0"],
     ["--mtp-num-layers", "0"]),
    # the trainer's --seq-length is the one checked (2 x CP x TP divides 4104 = 8 x 513)
    (QN, ["--nproc-per-node", "4", "--tp", "2", "--cp", "2", "--", "--seq-length", "4104"], ["--seq-length", "4104"]),
])
def test_good_parallel_sizes_pass(preset, argv, flags, capsys):
    cmd = _dry(capsys, str(CONFIGS / preset), *argv)
    assert any(cmd[i:i + len(flags)] == flags for i in range(len(cmd))), flags
    if "--ep" in argv and argv[argv.index("--ep") + 1] != "1":
        assert cmd[cmd.index("--moe-token-dispatcher-type") + 1] == "alltoall"


def test_dry_run_prints_the_layout(capsys):
    assert launch.main(["--dry-run", str(CONFIGS / "qwen3-next-80b-a3b.json"), "--nnodes", "4", "--nproc-per-node", "8",
                        "--tp", "2", "--cp", "4", "--ep", "16", "--etp", "1", "--master-addr", "n0"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("# world 32 = TP 2 x CP 4 x PP 1 x DP 4; experts 512 over EP 16 (32 a rank) x ETP 1 x "
                          "expert-DP 2; 48 layers, softmax attention at [4, 8, 12"), err
