"""Every shipped preset (configs/*.json) at a layout a user would pick: it loads, ``--dry-run`` checks it, the
command carries the flags the model needs, and Megatron's own parser, validate_args and TransformerConfig (MLA's
for Kimi-Linear) accept the command and read back every preset value, through megatron_kcp.train and through
pretrain_gpt.py's plain parser alike (no process starts, no model is built: tooling checks, a few seconds)."""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import shlex

import pytest

from megatron_kcp import launch

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
MULTI = ("--master-addr", "n0", "--node-rank", "0")

# preset: (launcher options, flags (with their values) the command must carry)
CASES = {
    "tiny-gdn.json": (("--nproc-per-node", "4", "--cp", "4"), ()),
    "tiny-kda.json": (("--nproc-per-node", "4", "--cp", "2", "--tp", "2", "--sequence-parallel"),
                      (("--sequence-parallel",),)),
    "tiny-qwen3-next.json": (
        ("--nproc-per-node", "8", "--tp", "2", "--cp", "2", "--ep", "4", "--etp", "1"),
        (("--num-experts", "8"), ("--moe-router-topk", "2"), ("--expert-model-parallel-size", "4"),
         ("--expert-tensor-parallel-size", "1"), ("--moe-token-dispatcher-type", "alltoall"), ("--sequence-parallel",),
         ("--moe-shared-expert-gate",), ("--attention-output-gate",), ("--qk-layernorm",), ("--apply-layernorm-1p",),
         ("--rotary-percent", "0.25"), ("--mtp-num-layers", "1"), ("--group-query-attention",))),
    "tiny-qwen3.5.json": (("--nproc-per-node", "4", "--tp", "2", "--cp", "2"),
                          (("--linear-num-value-heads", "6"), ("--attention-output-gate",), ("--mtp-num-layers", "1"))),
    "tiny-qwen3.5-moe.json": (("--nproc-per-node", "8", "--cp", "8", "--ep", "8"),
                              (("--num-experts", "16"), ("--expert-model-parallel-size", "8"),
                               ("--moe-token-dispatcher-type", "alltoall"))),
    "tiny-kimi-linear.json": (
        ("--nproc-per-node", "8", "--tp", "2", "--cp", "2", "--pp", "2", "--ep", "4", "--etp", "1"),
        (("--multi-latent-attention",), ("--kv-lora-rank", "32"), ("--position-embedding-type", "none"),
         ("--rope-type", "rope"), ("--no-rope-freq", "1"), ("--no-rope-fusion",), ("--moe-layer-freq", "[0,1,1,1]"),
         ("--linear-attention-freq", "[1,1,1,0]"), ("--moe-router-score-function", "sigmoid"),
         ("--moe-router-enable-expert-bias",), ("--pipeline-model-parallel-size", "2"))),
    "qwen3-next-gdn.json": (("--nnodes", "2", "--nproc-per-node", "8", "--tp", "2", "--cp", "8", *MULTI), ()),
    "kimi-linear-kda.json": (("--nproc-per-node", "8", "--cp", "8"), ()),
    # the released shapes, at layouts of 2-4 nodes of 8 GPUs
    "qwen3-next-80b-a3b.json": (
        ("--nnodes", "4", "--nproc-per-node", "8", "--tp", "2", "--cp", "4", "--ep", "16", "--etp", "1", *MULTI),
        (("--num-experts", "512"), ("--moe-router-topk", "10"), ("--moe-ffn-hidden-size", "512"),
         ("--moe-shared-expert-intermediate-size", "512"), ("--moe-shared-expert-gate",),
         ("--expert-model-parallel-size", "16"), ("--expert-tensor-parallel-size", "1"), ("--sequence-parallel",),
         ("--moe-token-dispatcher-type", "alltoall"), ("--moe-router-load-balancing-type", "global_aux_loss"),
         ("--moe-router-dtype", "fp32"), ("--attention-output-gate",), ("--qk-layernorm",),
         ("--apply-layernorm-1p",), ("--rotary-percent", "0.25"), ("--rotary-base", "10000000"),
         ("--norm-epsilon", "1e-06"), ("--mtp-num-layers", "1"), ("--kv-channels", "256"),
         ("--num-query-groups", "2"), ("--untie-embeddings-and-output-weights",), ("--global-batch-size", "4"))),
    "qwen3.5-27b.json": (
        ("--nnodes", "2", "--nproc-per-node", "8", "--tp", "4", "--cp", "2", "--pp", "2", *MULTI),
        (("--num-layers", "64"), ("--hidden-size", "5120"), ("--ffn-hidden-size", "17408"),
         ("--linear-num-value-heads", "48"), ("--num-attention-heads", "24"), ("--num-query-groups", "4"),
         ("--vocab-size", "248320"), ("--attention-output-gate",), ("--mtp-num-layers", "1"))),
    "qwen3.5-35b-a3b.json": (
        ("--nnodes", "2", "--nproc-per-node", "8", "--cp", "8", "--ep", "16", *MULTI),
        (("--num-experts", "256"), ("--moe-router-topk", "8"), ("--expert-model-parallel-size", "16"),
         ("--moe-token-dispatcher-type", "alltoall"), ("--num-layers", "40"), ("--vocab-size", "248320"))),
    "kimi-linear-48b-a3b.json": (
        ("--nnodes", "4", "--nproc-per-node", "8", "--tp", "2", "--cp", "8", "--ep", "8", "--etp", "1", *MULTI),
        (("--spec", "megatron_kcp", "kda_hybrid_layer_spec"), ("--multi-latent-attention",),
         ("--kv-lora-rank", "512"), ("--qk-head-dim", "128"), ("--qk-pos-emb-head-dim", "64"), ("--v-head-dim", "128"),
         ("--position-embedding-type", "none"), ("--rope-type", "rope"), ("--no-rope-freq", "1"),
         ("--num-experts", "256"),
         ("--moe-router-topk", "8"), ("--moe-ffn-hidden-size", "1024"),
         ("--moe-shared-expert-intermediate-size", "1024"),
         ("--moe-layer-freq", "[0" + ",1" * 26 + "]"), ("--moe-router-score-function", "sigmoid"),
         ("--moe-router-topk-scaling-factor", "2.446"), ("--moe-router-enable-expert-bias",),
         ("--linear-attention-freq", json.dumps([0 if n in (4, 8, 12, 16, 20, 24, 27) else 1 for n in range(1, 28)],
                                                separators=(",", ":"))),
         ("--expert-model-parallel-size", "8"), ("--sequence-parallel",), ("--seq-length", "1048576"))),
}
# Megatron's dest where it is not the flag's name
DEST = {"apply_layernorm_1p": "layernorm_zero_centered_gamma", "norm_epsilon": "layernorm_epsilon"}


def _dry(capsys, preset, *argv):
    assert launch.main(["--dry-run", str(CONFIGS / preset), *argv]) == 0
    captured = capsys.readouterr()
    return shlex.split(captured.out), captured.err


def _carries(cmd, flag_and_values) -> bool:
    n = len(flag_and_values)
    return any(tuple(cmd[i:i + n]) == tuple(flag_and_values) for i in range(len(cmd)))


def test_every_shipped_preset_has_a_case():
    assert sorted(CASES) == sorted(p.name for p in CONFIGS.glob("*.json"))


@pytest.mark.parametrize("preset", sorted(CASES))
def test_preset_dry_runs_with_its_flags(preset, capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    argv, flags = CASES[preset]
    cmd, err = _dry(capsys, preset, *argv)
    missing = [f for f in flags if not _carries(cmd, f)]
    assert not missing, (missing, shlex.join(cmd))
    p = launch.load_preset(CONFIGS / preset)
    assert err.startswith("# world ") and (("experts" in err) == bool(p.get("num_experts"))), err
    assert isinstance(p.get("_doc"), str) and len(p["_doc"]) > 40           # says what it is and where from
    if p.get("num_experts") and "--tp" in argv and argv[argv.index("--tp") + 1] != "1":
        assert "--sequence-parallel" in cmd                                 # Megatron's MoE layer refuses TP without


@pytest.fixture
def megatron_env(monkeypatch):
    """What Megatron's validate_args reads from the machine: the world size, and the GPU generation (CPU here)."""
    import megatron.training.arguments as arguments
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("RANK", "0")
    return monkeypatch


def _world(argv) -> int:
    get = {a: int(argv[i + 1]) for i, a in enumerate(argv) if a in ("--nnodes", "--nproc-per-node")}
    return get.get("--nnodes", 1) * get["--nproc-per-node"]


def _check_values(preset: dict, args, where: str):
    """Every preset value as Megatron's parsed (and validated) arguments hold it."""
    for key, value in preset.items():
        if key in ("_doc", "spec", "kda_gate_rank"):
            continue
        got = getattr(args, DEST.get(key, key))
        assert got == value, (where, key, got, value)
    assert args.spec[-1] == launch.spec_name(preset), (where, args.spec)
    assert args.max_position_embeddings == preset["seq_length"]


@pytest.mark.parametrize("preset", sorted(CASES))
def test_command_parses_and_validates_with_megatron(preset, capsys, megatron_env):
    """megatron_kcp.train's command through Megatron's parse_args (with the plugin's options) and validate_args,
    then its TransformerConfig; and the --megatron-lm command through pretrain_gpt.py's plain parse_args, which
    knows no plugin flag (kda_gate_rank travels in the spec's name)."""
    import sys

    import megatron.training.arguments as arguments
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.core.transformer import MLATransformerConfig

    from megatron_kcp import train
    argv, _ = CASES[preset]
    megatron_env.setenv("WORLD_SIZE", str(_world(argv)))
    p = launch.load_preset(CONFIGS / preset)
    cmd, _ = _dry(capsys, preset, *argv)
    ours = cmd[cmd.index("megatron_kcp.train") + 1:]
    with contextlib.redirect_stdout(io.StringIO()):
        args = train.read_args(ours)
        arguments.validate_args(args)
    _check_values(p, args, "megatron_kcp.train")
    config = core_transformer_config_from_args(args)
    assert isinstance(config, MLATransformerConfig) == bool(p.get("multi_latent_attention"))
    assert config.num_moe_experts == p.get("num_experts")
    assert config.moe_shared_expert_gate == p.get("moe_shared_expert_gate", False)
    assert config.layernorm_zero_centered_gamma == p.get("apply_layernorm_1p", False)
    assert config.attention_output_gate == p.get("attention_output_gate", False)
    assert config.qk_layernorm == p.get("qk_layernorm", False)
    assert config.mtp_num_layers == p.get("mtp_num_layers")
    mlm, _ = _dry(capsys, preset, *argv, "--megatron-lm", "/opt/Megatron-LM")
    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *mlm[mlm.index("/opt/Megatron-LM/pretrain_gpt.py") + 1:]]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            plain = arguments.parse_args()
            arguments.validate_args(plain)
    finally:
        sys.argv = saved
    _check_values(p, plain, "pretrain_gpt.py")
