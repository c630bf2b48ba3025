"""The training entry on GPUs (skip without 2 GPUs): one step of the tiny hybrid presets (full size,
fp32) at CP=2 against CP=1 with the same weights: loss, every layer's output and every gradient,
with fla's kernels and with the reference core on the GPU. Megatron's own GPU paths (RoPE slicing,
SDPA kernels, fused losses) run here and nowhere on the CPU. And the weights initialised on the
GPU do not depend on how far Megatron's startup advanced the default CUDA generator (it draws
[seq / CP, ...] numbers for its fusion warm-up): otherwise CP=1 and CP=2 runs start apart."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.layers.attention import gather_zigzag
from megatron_kcp.testing.distributed import rel_err, spawn
from tests.test_train import _small_model, entry_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _step(preset, core, out):
    from megatron.core import parallel_state as ps

    if core == "reference":                # every KCP op on the PyTorch reference
        import functools

        from megatron_kcp.ops import dispatch, kcp
        from megatron_kcp.ops.core_reference import ReferenceCore
        dispatch.build_core = lambda *args: ReferenceCore()
        kcp.causal_conv1d = functools.partial(kcp.causal_conv1d, backend="reference")
    group = ps.get_context_parallel_group()
    args, build = _small_model(preset, ps.get_context_parallel_world_size(), (), shrink=())
    model = build().cuda()
    acts = {}

    def keep(name):
        def hook(_, __, output):
            acts[name] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook
    for i, layer in enumerate(model.decoder.layers):
        for part in ("self_attention", "mlp"):
            getattr(layer, part).register_forward_hook(keep(f"layer{i}.{part}"))
    result = entry_step(model, args.seq_length)
    w = dist.get_world_size(group)
    result["acts"] = {n: gather_zigzag(a, group, w).cpu() for n, a in acts.items()}
    if dist.get_rank() == 0:
        torch.save(result, out)


@pytest.mark.parametrize("core", ["fla", "reference"])
@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_training_step_cp2_equals_cp1_on_gpu(preset, core, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    spawn(_step, 1, preset, core, tmp_path / "cp1")
    spawn(_step, 2, preset, core, tmp_path / "cp2")
    cp1, cp2 = (torch.load(tmp_path / n) for n in ("cp1", "cp2"))
    acts = {n: rel_err(cp2["acts"][n], a) for n, a in cp1["acts"].items()}
    grads = {n: rel_err(cp2["grads"][n], g) for n, g in cp1["grads"].items()}
    loss = abs(cp2["loss"] - cp1["loss"]) / abs(cp1["loss"])
    worst = sorted(grads.items(), key=lambda e: -e[1])[:6]
    line = (f"{preset} {core}: loss {cp1['loss']:.7f} vs {cp2['loss']:.7f} (rel {loss:.1e}) | "
            + " ".join(f"{n}:{e:.1e}" for n, e in acts.items()) + " | worst grads "
            + " ".join(f"{n}:{e:.1e}" for n, e in worst))
    print(line)
    if os.environ.get("KCP_EVIDENCE_DIR"):
        with open(os.path.join(os.environ["KCP_EVIDENCE_DIR"], "train_step_gpu.txt"), "a") as f:
            f.write(line + "\n")
    assert loss < 1e-5 and max(acts.values()) < 1e-4 and worst[0][1] < 3e-3, line


def _weights(preset):
    _, build = _small_model(preset, 1, (), cpu_init=False)
    a, b = ({n: p.detach().cpu() for n, p in build(draws).named_parameters()} for draws in (0, 4096 * 704))
    moved = [n for n in a if not torch.equal(a[n], b[n])]
    assert not moved, f"initialised from the default CUDA generator: {moved}"


@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_weights_do_not_depend_on_the_startup_draws(preset):
    spawn(_weights, 1, preset)
