"""Activation recomputation and pipeline parallelism with the KCP mixers (CPU, gloo ranks).

Recomputation re-runs forwards in the backward pass, the KCP exchange included: full (uniform, one
layer per checkpoint) and selective (core_attn, mlp) give the loss and every gradient of the run
without, at CP=2, and the recomputed modules do run twice. Pipeline parallelism places the
linear/softmax pattern by global layer number (even and uneven stages, virtual stages), and PP=2 x
CP=2 through Megatron's pipeline schedule gives the loss and every gradient of PP=1 x CP=2 from the
same weights. Megatron's startup gives every PP rank another seed, so the weights are copied here.
"""
from __future__ import annotations

import re

import pytest
import torch

from megatron_kcp.testing.distributed import rel_err, spawn
from tests.test_train import _small_model, entry_step

pytestmark = pytest.mark.slow

FULL = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
SELECTIVE = ("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp")
PP_SIZES = ("--num-layers", "4", "--linear-attention-freq", "4", "--hidden-size", "64", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-size", "1000")


def _count_calls(modules):
    counts = [0] * len(modules)
    for i, m in enumerate(modules):
        m.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


def _recompute_step(preset, extra, out):
    args, build = _small_model(preset, 2, extra)
    model = build()
    layers = model.decoder.layers                                   # [KCP mixer, softmax attention]
    assert type(layers[0].self_attention).__name__.startswith("KCP")
    calls = {"mixer": _count_calls([layers[0].self_attention]), "mlp": _count_calls([m.mlp for m in layers]),
             "core_attn": _count_calls([layers[1].self_attention.core_attention])}
    result = entry_step(model, args.seq_length)
    result["calls"] = calls
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)


@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_recompute_gives_the_same_loss_and_gradients_at_cp2(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    runs = {}
    for name, extra in (("none", ()), ("full", FULL), ("selective", SELECTIVE)):
        spawn(_recompute_step, 2, preset, extra, tmp_path / name)
        runs[name] = torch.load(tmp_path / name)
    none = runs["none"]
    assert none["calls"] == {"mixer": [1], "mlp": [1, 1], "core_attn": [1]}
    # what ran twice: the whole layer (full), the MLPs and softmax core attention (selective)
    assert runs["full"]["calls"] == {"mixer": [2], "mlp": [2, 2], "core_attn": [2]}
    assert runs["selective"]["calls"] == {"mixer": [1], "mlp": [2, 2], "core_attn": [2]}
    for name in ("full", "selective"):
        run = runs[name]
        assert abs(run["loss"] - none["loss"]) <= 1e-6 * abs(none["loss"]), (name, run["loss"], none["loss"])
        errs = {n: rel_err(run["grads"][n], g) for n, g in none["grads"].items()}
        assert max(errs.values()) < 1e-6, (name, sorted(errs.items(), key=lambda e: -e[1])[:3])


def _layernorm_recompute_without_te():
    with pytest.raises(ValueError, match="--recompute-modules layernorm needs TransformerEngine"):
        _small_model("tiny-gdn.json", 1, ("--recompute-granularity", "selective", "--recompute-modules",
                                          "layernorm"))[1]()


def test_layernorm_recompute_without_te_names_the_fix():
    """megatron-core 0.19's layernorm recompute stops on a NameError without TE: say so at construction."""
    from megatron_kcp.environment import te_available
    if te_available():
        pytest.skip("TransformerEngine is installed")
    spawn(_layernorm_recompute_without_te, 1)


# ---- pipeline parallelism ----

def _stage_kinds(preset, extra, out):
    """Layer number and mixer kind of every layer this rank builds (every virtual stage)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kcp import train
    args, _ = _small_model(preset, 1, extra, shrink=PP_SIZES)
    cfg = train.model_config(args)
    builder = cfg.get_builder_cls()(cfg)
    kinds = []
    for vp in range(args.virtual_pipeline_model_parallel_size or 1):
        model = builder.build_model(ProcessGroupCollection.use_mpu_process_groups(),
                                    vp_stage=vp if args.virtual_pipeline_model_parallel_size else None)
        kinds += [(layer.layer_number, "attn" if type(layer.self_attention).__name__ == "KCPSelfAttention" else "kcp")
                  for layer in model.decoder.layers]
    torch.save(kinds, f"{out}.{ps.get_pipeline_model_parallel_rank()}")


@pytest.mark.parametrize("extra,expected", [
    ((), [[(1, "kcp"), (2, "kcp")], [(3, "kcp"), (4, "attn")]]),
    (("--decoder-first-pipeline-num-layers", "1"), [[(1, "kcp")], [(2, "kcp"), (3, "kcp"), (4, "attn")]]),
    (("--num-layers-per-virtual-pipeline-stage", "1"), [[(1, "kcp"), (3, "kcp")], [(2, "kcp"), (4, "attn")]]),
])
def test_pipeline_stages_place_the_pattern_by_global_layer_number(extra, expected, tmp_path, monkeypatch):
    """Every 4th layer is softmax attention: layer 4, wherever it lives (local numbering would put none)."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_stage_kinds, 2, "tiny-gdn.json", ("--pipeline-model-parallel-size", "2", *extra), tmp_path / "k", pp=2)
    assert [torch.load(tmp_path / f"k.{r}") for r in range(2)] == expected


def _pipeline_step(preset, pp, weights, out):
    """One step of two micro-batches through Megatron's schedule at PP=pp x CP=2 from ``weights`` (saved
    by the PP=1 run): the loss (sum, count) and every gradient summed over CP, by global parameter name."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_kcp import train
    args, build = _small_model(preset, 2, ("--pipeline-model-parallel-size", str(pp), "--global-batch-size", "2"),
                               shrink=PP_SIZES)
    model = build()

    def global_name(name):           # decoder.layers.<local index> -> <global layer number - 1>
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        return f"decoder.layers.{model.decoder.layers[int(m[1])].layer_number - 1}.{m[2]}" if m else name
    if pp == 1 and torch.distributed.get_rank() == 0:
        torch.save(model.state_dict(), weights)
    torch.distributed.barrier()
    full = torch.load(weights)
    model.load_state_dict({n: full[global_name(n)] for n in model.state_dict()})
    train_ds, _, _ = train.datasets_provider([2, 0, 0])
    data = iter([torch.utils.data.default_collate([train_ds[i]]) for i in range(2)])
    losses = get_forward_backward_func()(
        forward_step_func=train.forward_step, data_iterator=data, model=[model], num_microbatches=2,
        seq_length=args.seq_length, micro_batch_size=1, forward_only=False)
    group = ps.get_context_parallel_group()
    loss = torch.stack([x["lm loss"] for x in losses]).sum(0) if losses else torch.zeros(2)
    grads = {global_name(n): p.grad.clone() for n, p in model.named_parameters()}
    for t in (loss, *grads.values()):
        torch.distributed.all_reduce(t, group=group)
    if ps.get_context_parallel_rank() == 0:
        torch.save({"loss": loss, "grads": grads}, f"{out}.{ps.get_pipeline_model_parallel_rank()}")


@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
def test_pp2_cp2_equals_pp1_cp2(preset, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_pipeline_step, 2, preset, 1, tmp_path / "w.pt", tmp_path / "pp1", pp=1)
    spawn(_pipeline_step, 4, preset, 2, tmp_path / "w.pt", tmp_path / "pp2", pp=2)
    ref = torch.load(tmp_path / "pp1.0")
    stages = [torch.load(tmp_path / f"pp2.{r}") for r in range(2)]
    assert ref["loss"][1] == 128 and torch.equal(stages[1]["loss"][1], ref["loss"][1])     # 2 x 64 tokens
    assert rel_err(stages[1]["loss"], ref["loss"]) < 1e-6, (stages[1]["loss"], ref["loss"])
    grads = {**stages[0]["grads"], **stages[1]["grads"]}
    assert grads.keys() == ref["grads"].keys() and not stages[0]["grads"].keys() & stages[1]["grads"].keys()
    errs = {n: rel_err(grads[n], g) for n, g in ref["grads"].items()}
    assert max(errs.values()) < 1e-5, sorted(errs.items(), key=lambda e: -e[1])[:3]
