"""The training entry on GPUs (skip without 2 GPUs): one step of the tiny hybrid presets (full size,
fp32) at CP=2 against CP=1 with the same weights: loss, every layer's output and every gradient,
with fla's kernels and with the reference core on the GPU. Megatron's own GPU paths (RoPE slicing,
SDPA kernels, fused losses) run here and nowhere on the CPU. Each layer's output is gathered from
the layout it ran in (the linear run's: contiguous where it is converted). fla's gradients are
measured against the reference core's at CP=1 (fp32 PyTorch) and CP's may not exceed 1.5x one
GPU's error (or the kernels' fp32 rounding): GDN's gate gradients carry the TF32 rounding of fla's
backward on Hopper, larger than any fixed bound. And the weights initialised on the GPU do not
depend on how far Megatron's startup advanced the default CUDA generator (it draws [seq / CP, ...]
numbers for its fusion warm-up): otherwise CP=1 and CP=2 runs start apart."""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

from megatron_kcp.plan import build_plan, local_token_index
from megatron_kcp.testing.distributed import rel_err, spawn
from tests.test_train import _small_model, entry_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def _gathered(a, layout, group, world_size):
    """A rank's ``[s / W, b, h]`` activations in ``layout`` as the whole sequence, in order."""
    parts = [torch.empty_like(a) for _ in range(world_size)]
    dist.all_gather(parts, a.contiguous(), group=group)
    seq = a.shape[0] * world_size
    full = a.new_empty(seq, *a.shape[1:])
    for r, part in enumerate(parts):
        full[local_token_index(build_plan((0, seq), layout, world_size, r)).to(a.device)] = part
    return full


def _layout(layer, a):
    """The layout a layer's outputs are in: its run's (contiguous where converted), else Megatron's."""
    return "contiguous" if getattr(layer, "linear", False) and layer.layout(a, None)[1] else "zigzag"


def _pooled(grads):
    """Gradients pooled by parameter kind over the layers (``decoder.layers.*.self_attention.A_log``): a
    gate's gradient has a value a head, too few for a ratio of two rounding errors to mean anything."""
    kinds = {}
    for n, g in grads.items():
        kinds.setdefault(re.sub(r"layers\.\d+\.", "layers.*.", n), []).append(g.flatten())
    return {k: torch.cat(v) for k, v in kinds.items()}


def _step(preset, core, out):
    from megatron.core import parallel_state as ps

    if core == "reference":                # every KCP op on the PyTorch reference
        import functools

        from megatron_kcp.ops import dispatch, kcp
        from megatron_kcp.kernels.core_reference import ReferenceCore
        dispatch.build_core = lambda *args: ReferenceCore()
        kcp.causal_conv1d = functools.partial(kcp.causal_conv1d, backend="reference")
    group = ps.get_context_parallel_group()
    args, build = _small_model(preset, ps.get_context_parallel_world_size(), (), shrink=())
    model = build().cuda()
    acts = {}

    def keep(name, layer):
        def hook(_, __, output):
            a = (output[0] if isinstance(output, tuple) else output).detach()
            acts[name] = (a, _layout(layer, a))
        return hook
    for i, layer in enumerate(model.decoder.layers):
        for part in ("self_attention", "mlp"):
            getattr(layer, part).register_forward_hook(keep(f"layer{i}.{part}", layer))
    result = entry_step(model, args.seq_length)
    w = dist.get_world_size(group)
    result["acts"] = {n: _gathered(a, lay, group, w).cpu() for n, (a, lay) in acts.items()}
    result["layouts"] = {n: lay for n, (_, lay) in acts.items()}
    if dist.get_rank() == 0:
        torch.save(result, out)


@pytest.mark.parametrize("core", ["fla", "reference"])
@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_training_step_cp2_equals_cp1_on_gpu(preset, core, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    spawn(_step, 1, preset, core, tmp_path / "cp1")
    spawn(_step, 2, preset, core, tmp_path / "cp2")
    if core != "reference":
        spawn(_step, 1, preset, "reference", tmp_path / "truth")
    cp1, cp2 = (torch.load(tmp_path / n) for n in ("cp1", "cp2"))
    truth = torch.load(tmp_path / "truth") if core != "reference" else cp1
    acts = {n: rel_err(cp2["acts"][n], a) for n, a in cp1["acts"].items()}
    got, one, exact = (_pooled(r["grads"]) for r in (cp2, cp1, truth))
    floor = 1e-4 if core == "reference" else 3e-3          # the reference's fp32 sums; fla's kernels'
    grads = {k: rel_err(got[k], exact[k]) for k in got}
    bound = {k: max(1.5 * rel_err(one[k], exact[k]), floor) for k in got}
    loss = abs(cp2["loss"] - cp1["loss"]) / abs(cp1["loss"])
    worst = sorted(grads, key=lambda k: -grads[k] / bound[k])[:6]
    line = (f"{preset} {core}: loss {cp1['loss']:.7f} vs {cp2['loss']:.7f} (rel {loss:.1e}) | "
            + " ".join(f"{n} ({cp2['layouts'][n]}):{e:.1e}" for n, e in acts.items())
            + f" | grads against the reference core at CP=1, CP=2 / bound (1.5x CP=1's, at least {floor:g}): "
            + " ".join(f"{k}:{grads[k]:.1e}/{bound[k]:.1e}" for k in worst))
    print(line)
    if os.environ.get("KCP_EVIDENCE_DIR"):
        with open(os.path.join(os.environ["KCP_EVIDENCE_DIR"], "train_step_gpu.txt"), "a") as f:
            f.write(line + "\n")
    assert loss < 1e-5 and max(acts.values()) < 1e-4 and grads[worst[0]] <= bound[worst[0]], line


def _weights(preset):
    _, build = _small_model(preset, 1, (), cpu_init=False)
    a, b = ({n: p.detach().cpu() for n, p in build(draws).named_parameters()} for draws in (0, 4096 * 704))
    moved = [n for n in a if not torch.equal(a[n], b[n])]
    assert not moved, f"initialised from the default CUDA generator: {moved}"


@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_weights_do_not_depend_on_the_startup_draws(preset):
    spawn(_weights, 1, preset)
