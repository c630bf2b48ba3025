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
                         r"hidden_size, .*, vocab_size, spec, _doc$"),
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


def _preset(tmp_path, **change):
    """tiny-gdn.json with ``change`` applied (a value of None drops the key)."""
    preset = json.loads((CONFIGS / "tiny-gdn.json").read_text())
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
    if isinstance(change.get("linear_attention_freq"), list):      # Megatron's la_freq_type reads the list text
        assert cmd[cmd.index("--linear-attention-freq") + 1] == "[1, 0, 1, 0]"


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
