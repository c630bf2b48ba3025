"""The tiny presets of the released models (configs/tiny-qwen3-next.json, tiny-qwen3.5.json, tiny-qwen3.5-moe.json,
tiny-kimi-linear.json) trained through megatron_kcp.train's own path on the CPU (fp32, gloo ranks): the command
the launcher builds for the preset, Megatron's parser and checks, the GPTModel the entry builds, its mock data,
get_batch (CP zigzag cut), forward_step and loss_func. At CP = 2 the loss, the MoE load-balancing loss and every
gradient equal CP = 1's.

Why CP = 2 equals CP = 1 with MoE: routing is per token. The router scores each token from that token's hidden
state alone (fp32 router, --moe-router-dtype fp32; no input jitter; no capacity factor, so no token is dropped
and no token's fate depends on the others in its batch), so a token picks the same experts whichever CP rank
holds it; the experts and the shared expert are per-token MLPs. What does couple tokens is the load-balancing
loss: megatron-core sums its token counts per expert over the TP x CP group (global_aux_loss over TP x DP x CP)
before it forms the loss, so each CP rank's loss is its own tokens' share of the CP = 1 loss: the shares sum
to it, and so do the gradients they send back (Megatron sums the gradients over the CP ranks, as
tests.test_train.entry_step does). Kimi-Linear's expert bias moves only between steps (from the counts), and
is zero at the first one. The attention (gated, QK-normed, partial RoPE; MLA with NoPE for Kimi-Linear) and
the linear mixers are CP-exact by construction (tests/test_train.py, tests/test_spec.py).

Through Megatron-LM's pretrain_gpt.py (.mlm/ or MEGATRON_LM): the launcher's --megatron-lm command for a tiny
MoE preset, parsed and validated as pretrain_gpt.py does, its model built by Megatron's builder from the KCP spec,
its own dataset provider and forward_step give megatron_kcp.train's loss on every rank at CP = 2.

MTP stays out of these CPU runs (-- --mtp-num-layers 0): megatron_kcp's specs refuse --mtp-num-layers at CP > 1
without TransformerEngine (megatron_kcp.layers.hybrid), and on the CPU megatron-core's MTP layer does not run even
at CP = 1 (its own norms, megatron-core's local ones, refuse --apply-layernorm-1p; its local attention builds the
causal mask on CUDA). The presets' MTP flags are checked by tests/test_presets.py.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from megatron_kcp.testing.distributed import rel_err, spawn
from tests.test_megatron_lm import LOCAL_MLM, pretrain_gpt_steps
from tests.test_train import _small_model, entry_step

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
TINY = ("tiny-qwen3-next.json", "tiny-qwen3.5.json", "tiny-qwen3.5-moe.json", "tiny-kimi-linear.json")
# the tiny presets' model at 64 tokens and a vocabulary of 512 (the widths, layers, heads and experts as shipped)
SHRINK = ("--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "512")
NO_MTP = ("--mtp-num-layers", "0")


def _features(model) -> dict:
    """What the entry built, layer by layer: mixer and MLP classes, shared experts, the MTP block."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    layers = model.decoder.layers
    return {"mixers": [type(layer.self_attention).__name__ for layer in layers],
            "moe": [isinstance(layer.mlp, MoELayer) for layer in layers],
            "shared": [isinstance(layer.mlp, MoELayer) and layer.mlp.shared_experts is not None for layer in layers],
            "mtp": getattr(model, "mtp", None) is not None}


def _step(preset, extra, out):
    """One training step's loss, load-balancing losses and gradients (CP-summed) of ``preset`` at this world's CP."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    args, build = _small_model(preset, ps.get_context_parallel_world_size(), extra, shrink=SHRINK)
    model = build()
    result = entry_step(model, args.seq_length)
    aux = {}
    for name, entry in get_moe_metrics_tracker().metrics.items():      # each rank's share, per layer
        values = entry.values.clone()
        torch.distributed.all_reduce(values, group=ps.get_context_parallel_group())
        aux[name] = values
    result.update(aux=aux, features=_features(model), args={k: getattr(args, k) for k in (
        "num_experts", "moe_router_topk", "moe_router_dtype", "moe_input_jitter_eps", "moe_expert_capacity_factor",
        "multi_latent_attention", "attention_output_gate", "qk_layernorm", "rotary_percent", "mtp_num_layers")})
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)


def _expected_features(preset: dict) -> dict:
    layers = preset["num_layers"]
    freq = preset.get("moe_layer_freq", 1)
    moe = [bool(x) for x in freq] if isinstance(freq, list) else [bool(preset.get("num_experts"))] * layers
    return {"moe": moe, "shared": [m and "moe_shared_expert_intermediate_size" in preset for m in moe]}


@pytest.mark.parametrize("name", ["tiny-qwen3-next.json", "tiny-kimi-linear.json",        # ~30 s each, 2 CPU cores
                                  pytest.param("tiny-qwen3.5-moe.json", marks=pytest.mark.slow),
                                  pytest.param("tiny-qwen3.5.json", marks=pytest.mark.slow)])
def test_tiny_preset_training_step_cp2_equals_cp1(name, tmp_path, monkeypatch):
    """The released models' features at tiny size (MoE with a shared expert, gated attention with QK norm and
    partial RoPE, zero-centred norms; Kimi-Linear's MLA, NoPE, dense first layer, sigmoid router with expert
    bias): the loss, the load-balancing loss of every MoE layer and every gradient at CP = 2 equal CP = 1."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")      # Megatron's check for TP/CP > 1
    spawn(_step, 1, name, NO_MTP, tmp_path / "cp1")
    spawn(_step, 2, name, NO_MTP, tmp_path / "cp2")
    cp1, cp2 = (torch.load(tmp_path / n) for n in ("cp1", "cp2"))
    preset = json.loads((CONFIGS / name).read_text())
    want = _expected_features(preset)
    assert {k: cp1["features"][k] for k in want} == want, cp1["features"]
    if preset.get("multi_latent_attention"):
        assert "MLA" in cp1["features"]["mixers"][-1], cp1["features"]
    assert cp1["args"]["moe_router_dtype"] == preset.get("moe_router_dtype")       # the deterministic router
    assert cp1["args"]["moe_input_jitter_eps"] is None and cp1["args"]["moe_expert_capacity_factor"] is None
    assert abs(cp2["loss"] - cp1["loss"]) <= 1e-5 * abs(cp1["loss"]), (cp1["loss"], cp2["loss"])
    assert cp1["aux"].keys() == cp2["aux"].keys() and bool(cp1["aux"]) == bool(preset.get("num_experts"))
    for key, values in cp1["aux"].items():
        assert values.abs().sum() > 0 and rel_err(cp2["aux"][key], values) < 1e-5, (key, values, cp2["aux"][key])
    assert cp1["grads"].keys() == cp2["grads"].keys()
    errs = {n: rel_err(cp2["grads"][n], g) for n, g in cp1["grads"].items()}
    assert max(errs.values()) < 1e-4, sorted(errs.items(), key=lambda e: -e[1])[:5]
    routers = [n for n in cp1["grads"] if n.endswith("router.weight")]
    assert len(routers) == sum(want["moe"]) and all(cp1["grads"][n].abs().sum() > 0 for n in routers)


def _real_pretrain_gpt_step(preset):
    """Megatron-LM's pretrain_gpt.py on the CPU, as tests.test_megatron_lm runs it for the dense hybrids: the
    launcher's --megatron-lm command for ``preset`` at this world's CP, parsed and validated by pretrain_gpt.py's
    startup; its dataset provider and forward_step against megatron_kcp.train's on the MoE model Megatron's
    builder makes of it."""
    import contextlib
    import io
    import shlex

    from megatron.core import parallel_state as ps

    from megatron_kcp import launch
    cp = ps.get_context_parallel_world_size()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        launch.main(["--dry-run", str(CONFIGS / preset), "--nproc-per-node", str(cp), "--cp", str(cp), "--fp32",
                     "--megatron-lm", str(LOCAL_MLM), "--", *NO_MTP, *SHRINK])
    cmd = shlex.split(out.getvalue())

    def has_moe(model):
        assert any(type(layer.mlp).__name__ == "MoELayer" for layer in model.decoder.layers)
    losses = pretrain_gpt_steps(cmd[cmd.index(str(LOCAL_MLM / "pretrain_gpt.py")) + 1:], has_moe)
    assert losses[0] == losses[1] and losses[0][1] == 64 // cp, losses       # this rank's share of 64 tokens


@pytest.mark.skipif(not (LOCAL_MLM / "pretrain_gpt.py").is_file(),
                    reason="needs Megatron-LM's pretrain_gpt.py in .mlm/ or MEGATRON_LM (scripts/fetch_megatron_lm.sh)")
@pytest.mark.parametrize("name", [pytest.param("tiny-qwen3-next.json", marks=pytest.mark.slow),
                                  pytest.param("tiny-kimi-linear.json", marks=pytest.mark.slow)])
def test_real_pretrain_gpt_step_on_a_tiny_moe_preset(name, monkeypatch, capfd):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_real_pretrain_gpt_step, 2, name)
    assert "[megatron_kcp] KCP active:" in capfd.readouterr().out


def test_every_tiny_preset_of_a_released_model_is_trained_here():
    shipped = {p.name for p in CONFIGS.glob("tiny-*.json")} - {"tiny-gdn.json", "tiny-kda.json"}   # test_train's
    assert shipped == set(TINY)
