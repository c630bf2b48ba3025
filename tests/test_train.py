"""The pip-only training entry: its options, its startup checks, and the model it builds (CPU)."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from megatron_kcp import launch, train
from megatron_kcp.testing.distributed import spawn

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def _argv(preset="tiny-gdn.json", tp=1, cp=1, sp=False, *extra):
    args = launch.megatron_args(launch.load_preset(CONFIGS / preset), tp, cp, 1, sp, extra)
    return args + ["--global-batch-size", "1", "--train-iters", "10", *extra]


def test_launcher_command_parses_with_plugin_options():
    a = train.read_args(_argv("tiny-kda.json", 2, 2, True, "--kda-gate-rank", "32", "--kda-norm-eps", "1e-6"))
    assert a.spec == ["megatron_kcp", "kda_hybrid_layer_spec"]
    assert (a.kda_gate_rank, a.kda_norm_eps) == (32, 1e-6)
    assert a.context_parallel_size == 2 and a.sequence_parallel and a.linear_attention_freq == 4
    if not train.te_available():
        assert a.transformer_impl == "local" and not a.apply_rope_fusion
    assert not a.create_attention_mask_in_dataloader         # s x s per sample: 1 TB at 1M tokens
    argv = [x for x in _argv() if x != "--no-create-attention-mask-in-dataloader"]
    assert not train.read_args(argv).create_attention_mask_in_dataloader


def test_help_prints(capsys):
    """``--help`` prints every option, megatron-core's help with a bare ``%`` included."""
    with pytest.raises(SystemExit) as e:
        train.read_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--moe-paged-stash-buffer-size-factor-cuda" in out and "--kcp-log" in out


def test_one_token_spec_is_the_default_hybrid():
    argv = _argv()
    i = argv.index("--spec")
    argv[i + 1:i + 3] = ["megatron_kcp"]
    assert train.read_args(argv).spec == ["megatron_kcp.spec", "default_spec"]


@pytest.mark.parametrize("change,match", [
    (["--kda-gate-rank", "16"], "apply to the KDA spec only"),
    (["--tensor-model-parallel-size", "3"], "not divisible by --tensor-model-parallel-size 3"),
    (["--seq-length", "4100", "--context-parallel-size", "4"], "must be a multiple of 8"),
    (["--linear-num-value-heads", "6"], "multiple of --linear-num-key-heads"),
    (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"], "KCP hybrids only"),
    (["--experimental-attention-variant", "gated_delta_net"], "cp2hp"),
    (["--sft"], "pretrain_gpt.py with the KCP spec"),
    (["--reset-attention-mask"], "use --dataloader-inter-document-masking"),
    (["--save", "/tmp/kcp-ckpt"], "--save needs --save-interval"),
    (["--spec", "megatron_kcp", "kda_hybrid_layer_spec:kda_gate_rank=32", "--kda-gate-rank", "32"], "in the spec name"),
    (["--spec", "megatron_kcp.spec", "kda_hybrid_layer_spec:kda_gate_rank=32", "--kda-norm-eps", "1e-6"],
     "in the spec name"),
    (["--spec", "megatron_kcp", "kda_hybrid_layer_spec:kda_gate_rank=-2"], "kda_gate_rank=-2: must be a positive int"),
    (["--spec", "megatron_kcp.spec", "kda_hybrid_layer_spec:kda_gate_rank=-2"],
     "^--spec megatron_kcp.spec kda_hybrid_layer_spec:kda_gate_rank=-2: kda_gate_rank=-2: must be a positive int"),
    (["--spec", "megatron_kcp.spec", "gdn_hybrid_layer_spec:kda_gate_rank=32"], "takes no options"),
    (["--linear-key-head-dim", "512"], "--linear-key-head-dim 512 exceeds the kernels' limit of 256"),
    (["--spec", "megatron_kcp", "kda_hybrid_layer_spec", "--kda-norm-eps", "0"],
     "--kda-norm-eps 0.0 must be a positive"),
])
def test_bad_options_fail_at_startup_naming_the_fix(change, match):
    with pytest.raises(ValueError, match=match):
        train.read_args(_argv() + change)


@pytest.mark.parametrize("module", ["megatron_kcp", "megatron_kcp.spec"])
def test_spec_options_through_either_module(module):
    """--spec megatron_kcp NAME:OPTIONS and --spec megatron_kcp.spec NAME:OPTIONS both pass the startup checks."""
    name = "kda_hybrid_layer_spec:kda_gate_rank=32,kda_norm_eps=1e-6"
    assert train.read_args(_argv("tiny-kda.json") + ["--spec", module, name]).spec == [module, name]


def test_kda_gate_rank_must_divide_by_tp():
    with pytest.raises(ValueError, match="positive multiple of the TP size 2"):
        train.read_args(_argv("tiny-kda.json", 2, 1, False, "--kda-gate-rank", "33"))


SMALL = ("--num-layers", "2", "--linear-attention-freq", "2", "--hidden-size", "64", "--seq-length", "64",
         "--max-position-embeddings", "64", "--vocab-size", "1000")


def _small_model(preset, cp, extra, shrink=SMALL, cpu_init=True):
    """train.parse_args on a preset (shrunk unless ``shrink=()``), then the GPTModel the entry builds
    (fp32; initialised on the CPU unless ``cpu_init=False``). Returns the args and a builder
    ``build(startup_draws=0)``: ``startup_draws`` numbers are drawn from the default CUDA generator
    after seeding, as Megatron's fusion warm-up does before it builds the model."""
    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    from megatron.core.process_groups_config import ProcessGroupCollection
    argv = [a for a in _argv(preset, 1, cp, False, *extra) if a != "--bf16"]
    args = train.parse_args(argv + ["--use-cpu-initialization"] * cpu_init + list(shrink))
    model_cfg = train.model_config(args)

    def build(startup_draws=0):
        torch.manual_seed(args.seed)        # as Megatron's initialisation does: the same weights on every CP rank
        if torch.cuda.is_available():       # Megatron's model-parallel stream, which some weights draw from
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(args.seed)
            torch.rand(startup_draws, device="cuda")
        return model_cfg.get_builder_cls()(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    return args, build


def _build_and_run(preset, extra):
    args, build = _small_model(preset, 1, extra)
    model = build()
    from megatron.training.training import get_train_valid_test_num_samples
    assert get_train_valid_test_num_samples()[0] == 10      # what pretrain() asks of the arguments first
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    assert kinds[0].startswith("KCP") and kinds[1] == "KCPSelfAttention", kinds
    if "kda" in args.spec[-1]:
        mixer = model.decoder.layers[0].self_attention
        assert mixer.f_proj[0].weight.shape[0] == 16 and mixer.o_norm.eps == 1e-6, mixer.options
    tokens = torch.randint(0, 1000, (1, 64))
    loss = model(tokens, torch.arange(64)[None], None, labels=tokens)
    loss.mean().backward()
    assert torch.isfinite(loss).all()


@pytest.mark.slow
@pytest.mark.parametrize("preset,extra", [
    ("tiny-gdn.json", ()), ("tiny-kda.json", ("--kda-gate-rank", "16", "--kda-norm-eps", "1e-6")),
    ("tiny-kda.json", ("--spec", "megatron_kcp", "kda_hybrid_layer_spec:kda_gate_rank=16,kda_norm_eps=1e-6"))])
def test_entry_builds_the_hybrid_gpt(preset, extra):
    spawn(_build_and_run, 1, preset, extra)


def entry_step(model, seq_length):
    """The entry's own data path on ``model``: mock dataset, get_batch (TP broadcast, CP zigzag split),
    forward_step and loss_func, then backward of the mean token loss. Returns that loss and every
    parameter's gradient of it, summed over the CP ranks as Megatron's gradient reduction does."""
    from megatron.core import parallel_state as ps
    train_ds, _, _ = train.datasets_provider([1, 0, 0])
    batch = torch.utils.data.default_collate([train_ds[0]])
    output, loss_fn = train.forward_step(iter([batch]), model)
    loss, num_tokens, _ = loss_fn(output)
    (loss / seq_length).backward()
    total = torch.stack([loss.detach(), num_tokens.float()])
    group = ps.get_context_parallel_group()
    torch.distributed.all_reduce(total, group=group)
    assert total[1] == seq_length, total        # every token counted once over the CP ranks
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        torch.distributed.all_reduce(g, group=group)
    return {"loss": (total[0] / total[1]).item(), "grads": {n: g.cpu() for n, g in grads.items()}}


def _training_step(preset, out):
    from megatron.core import parallel_state as ps
    args, build = _small_model(preset, ps.get_context_parallel_world_size(), ())
    result = entry_step(build(), args.seq_length)
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_entry_training_step_cp2_equals_cp1(preset, tmp_path, monkeypatch):
    """Loss and every gradient of the hybrid (linear mixers, softmax attention with RoPE, MLPs,
    embeddings) at CP=2 equal CP=1 in fp32."""
    from megatron_kcp.testing.distributed import rel_err
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")      # Megatron's check for TP/CP > 1
    spawn(_training_step, 1, preset, tmp_path / "cp1")
    spawn(_training_step, 2, preset, tmp_path / "cp2")
    cp1, cp2 = (torch.load(tmp_path / n) for n in ("cp1", "cp2"))
    assert abs(cp2["loss"] - cp1["loss"]) <= 1e-5 * abs(cp1["loss"]), (cp1["loss"], cp2["loss"])
    assert cp1["grads"].keys() == cp2["grads"].keys()
    errs = {n: rel_err(cp2["grads"][n], g) for n, g in cp1["grads"].items()}
    assert max(errs.values()) < 1e-4, sorted(errs.items(), key=lambda e: -e[1])[:5]


def _builds_cp2hp_peer(model):
    spec = ("--spec", "megatron_kcp.spec", f"cp2hp_{model}_hybrid_layer_spec")
    mixer = _small_model(f"tiny-{model}.json", 1, spec)[1]().decoder.layers[0].self_attention
    if model == "gdn":
        assert type(mixer).__name__ == "GatedDeltaNet"
    else:           # megatron-core has no KDA module: ours, with the all-to-all around its kernel
        assert type(mixer).__name__ == "KCPKimiDeltaAttention" and mixer.strategy == "cp2hp"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gdn", "kda"])
def test_entry_builds_the_cp2hp_peer(model):
    spawn(_builds_cp2hp_peer, 1, model)


def _progress_line(log):
    import argparse
    calls = []
    progress = train.Progress(lambda *a, **k: calls.append(a[3]) or "flag", argparse.Namespace(
        global_batch_size=2, seq_length=4096, kcp_log=log))
    for it in (1, 2):
        flag = progress({"lm loss": torch.tensor(2.5 / it)}, {}, 1e-4, it, 1.0, True, 0, 1.0, None, None, None)
        assert flag == "flag"
    assert calls == [1, 2]          # Megatron's own log ran first, every step


def test_progress_line_per_step(tmp_path, capfd):
    spawn(_progress_line, 1, str(tmp_path / "log.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and [r["loss"] for r in rows] == [2.5, 1.25]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "[kcp] step     2 | loss 1.250000 |" in capfd.readouterr().out


def _twenty_steps(preset, out):
    """20 Adam steps of the entry's hybrid at CP=2 on its own data path (the CP-summed gradients applied,
    as Megatron's reduction does); the losses."""
    args, build = _small_model(preset, 2, ())
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        result = entry_step(model, args.seq_length)
        for n, p in model.named_parameters():
            p.grad.copy_(result["grads"][n])
        opt.step()
        losses.append(result["loss"])
    converted = model.decoder.layers[0].layout(torch.empty(args.seq_length // 2, 1, 1), None)[1]
    if torch.distributed.get_rank() == 0:
        torch.save((converted, losses), out)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_training_with_the_layout_conversion_matches_without(preset, tmp_path, monkeypatch):
    """The hybrid trained 20 steps at CP=2 with its linear run moved to the contiguous layout
    (KCP_CONVERT=1) follows the run that keeps Megatron's layout (KCP_CONVERT=0) to fp32 rounding."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    runs = {}
    for convert in ("0", "1"):
        monkeypatch.setenv("KCP_CONVERT", convert)
        spawn(_twenty_steps, 2, preset, tmp_path / convert)
        converted, runs[convert] = torch.load(tmp_path / convert)
        assert converted == (convert == "1")
    diffs = [abs(a - b) / abs(b) for a, b in zip(runs["1"], runs["0"])]
    assert runs["0"][-1] < runs["0"][0] - 0.1, runs["0"]          # it trains
    assert max(diffs) < 1e-5, list(zip(runs["0"], runs["1"]))


def _mtp_step():
    args, build = _small_model("tiny-gdn.json", 1, ("--mtp-num-layers", "1"))
    model = build()
    assert type(model.mtp).__name__ == "MultiTokenPredictionBlock"
    grads = entry_step(model, args.seq_length)["grads"]
    mtp = {n: g for n, g in grads.items() if n.startswith("mtp.")}
    assert mtp and all(g.abs().sum() > 0 for g in mtp.values()), [n for n, g in mtp.items() if not g.abs().sum()]


def test_mtp_trains_through_megatrons_own_mtp_block():
    """--mtp-num-layers builds Megatron's MTP block (megatron-core's GPT layer after our hybrid decoder) and its
    loss reaches every MTP parameter through the entry's get_batch and forward_step."""
    spawn(_mtp_step, 1)
