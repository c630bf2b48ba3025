"""``python -m megatron_kcp.convert``: HF -> Megatron logits equal transformers' (fp32, CPU), HF -> Megatron -> HF is
bit-exact, errors are one line naming the tensor / architecture / config field; the slow tier loads the converted
checkpoint at TP = 2 and at CP = 2."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from megatron_kcp.convert import ConvertError, export_hf, family_for, import_hf, io  # noqa: E402
from megatron_kcp.convert.__main__ import main  # noqa: E402
from megatron_kcp.convert.model import build_model, single_rank_world  # noqa: E402
from megatron_kcp.testing import hf  # noqa: E402
from megatron_kcp.testing.distributed import rel_err, spawn  # noqa: E402

SEQ = 24
TOL = 1e-5


def tokens(batch=2, seq=SEQ):
    return torch.randint(0, hf.VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """family -> (HF dir, Megatron dir, transformers' fp32 logits of :func:`tokens`), made on first use."""
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            hf_dir = hf.save_tiny(family, root / "hf")
            import_hf(hf_dir, str(root / "megatron"))
            made[family] = (hf_dir, str(root / "megatron"), hf.reference_logits(family, tokens()))
        return made[family]
    return get


def megatron_logits(megatron_dir, toks, **overrides):
    """Logits of the converted checkpoint (model built for its hf/config.json in the current parallel state)."""
    with open(os.path.join(megatron_dir, "hf", "config.json")) as f:
        spec = family_for(json.load(f)).model_spec({})
    model = build_model(spec, **overrides)
    io.load_megatron(model, megatron_dir)
    position_ids = torch.arange(toks.shape[1])[None].expand(toks.shape[0], -1)
    with torch.no_grad():
        return model(toks, position_ids, None)


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_logits_equal_transformers(family, converted):
    _, megatron_dir, ref = converted(family)
    with single_rank_world():
        out = megatron_logits(megatron_dir, tokens())
    assert out.shape == ref.shape
    assert rel_err(out, ref) < TOL, rel_err(out, ref)


def _same_files(a, b):
    from safetensors import safe_open
    fa, fb = (safe_open(os.path.join(d, "model.safetensors"), "pt") for d in (a, b))
    assert sorted(fa.keys()) == sorted(fb.keys())
    for k in fa.keys():
        x, y = fa.get_tensor(k), fb.get_tensor(k)
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_round_trip_is_bit_exact(family, converted, tmp_path):
    hf_dir, megatron_dir, _ = converted(family)
    export_hf(megatron_dir, str(tmp_path / "back"))
    _same_files(hf_dir, tmp_path / "back")
    with open(os.path.join(hf_dir, "config.json")) as f, open(tmp_path / "back" / "config.json") as g:
        assert json.load(f) == json.load(g)


def test_bf16_round_trip_and_megatron_args(tmp_path, capsys):
    """A bf16 checkpoint (zero-centred out_norm offset included) comes back bit-exact through the CLI; the fp32
    Megatron checkpoint holds the same values; megatron_args.txt is what the CLI printed."""
    hf_dir = hf.save_tiny("qwen3_next", tmp_path / "hf", dtype=torch.bfloat16, seed=3)
    assert main(["import", hf_dir, str(tmp_path / "m")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    with open(tmp_path / "m" / "megatron_args.txt") as f:
        assert f.read().strip() == printed
    assert "--apply-layernorm-1p" in printed and "--attention-output-gate" in printed
    assert main(["export", str(tmp_path / "m"), str(tmp_path / "back")]) == 0
    _same_files(hf_dir, tmp_path / "back")


def _edit(src, dst, change):
    """Copy the HF dir ``src`` to ``dst`` with its tensors changed by ``change(dict)`` (in place)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


QKVZ = "model.layers.0.linear_attn.in_proj_qkvz.weight"


@pytest.mark.parametrize("change,match", [
    (lambda t: t.pop(QKVZ), f"^missing tensor: {QKVZ} "),
    (lambda t: t.update({"model.layers.0.linear_attn.extra.weight": torch.zeros(2)}),
     "^unexpected tensor: model.layers.0.linear_attn.extra.weight "),
    (lambda t: t.update({QKVZ: t[QKVZ][:-1]}), rf"^shape mismatch: {QKVZ} has shape \(151, 32\), expected \(152, 32\)"),
    (lambda t: t.update({"mtp.fc.weight": torch.zeros(2, 2)}), "mtp.fc.weight, ...\\), .* pass --drop-mtp"),
])
def test_errors_are_one_line_naming_the_tensor(change, match, converted, tmp_path, capsys):
    hf_dir = _edit(converted("qwen3_next")[0], tmp_path / "bad", change)
    with pytest.raises(ConvertError, match=match) as e:
        import_hf(hf_dir, str(tmp_path / "out"))
    assert "\n" not in str(e.value)
    assert main(["import", hf_dir, str(tmp_path / "out2")]) == 2          # the CLI: one line on stderr, status 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_drop_mtp(converted, tmp_path):
    hf_dir = _edit(converted("qwen3_next")[0], tmp_path / "mtp", lambda t: t.update({"mtp.fc.weight": torch.ones(2)}))
    with pytest.raises(ConvertError, match="^--mtp-num-layers 1: the converter does not map MTP weights yet"):
        import_hf(hf_dir, str(tmp_path / "a"), mtp_num_layers=1)
    import_hf(hf_dir, str(tmp_path / "b"), drop=["--drop-mtp"])
    with open(tmp_path / "b" / "hf" / io.MANIFEST) as f:
        assert json.load(f)["dropped"] == ["mtp.fc.weight"]


def _config_dir(tmp_path, **edit):
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**hf.tiny_config_kwargs("qwen3_next"), "model_type": "qwen3_next",
                                               **edit}))
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize("edit,match", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
     "^unknown architecture: model_type='llama', architectures=\\['LlamaForCausalLM'\\]; supported model types: "
     "kimi_linear, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, qwen3_next$"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "^config field rope_parameters.rope_type='yarn' of qwen3_next cannot be honoured"),
    ({"hidden_act": "gelu"}, "^config field hidden_act='gelu' of qwen3_next cannot be honoured"),
])
def test_config_errors_name_the_field(edit, match, tmp_path):
    with pytest.raises(ConvertError, match=match) as e:
        import_hf(_config_dir(tmp_path, **edit), str(tmp_path / "out"))
    assert "\n" not in str(e.value)


def test_kimi_refuses_what_megatron_core_routes_otherwise(tmp_path):
    cfg = {**hf.tiny_config_kwargs("kimi_linear"), "model_type": "kimi_linear", "num_expert_group": 2,
           "topk_group": 2, "num_experts_per_token": 2}
    with pytest.raises(ConvertError, match="^config field num_expert_group=2 of kimi_linear cannot be honoured"):
        family_for(cfg).model_spec({})


def test_zero_centred_offset_is_exact_or_refused():
    """``w - 1`` in float64 and back: exact for bf16 weights and fp32 ones in [0.5, 2]; an fp32 weight whose
    offset would lose a bit is refused, naming the tensor."""
    from megatron_kcp.convert.rules import copy
    rule = copy("m.w", "h.w", (1000,), offset=-1.0)
    target = {"m.w": torch.empty(1000)}
    g = torch.Generator().manual_seed(0)
    for w in (torch.randn(1000, generator=g).to(torch.bfloat16), torch.rand(1000, generator=g) * 1.5 + 0.5):
        m = rule.to_megatron({"h.w": w}, target)
        back = rule.to_hf(m, {"h.w": w.dtype})["h.w"]
        assert back.dtype == w.dtype and torch.equal(back, w)
    with pytest.raises(ConvertError, match="^h.w: its offset w -1 is not exact in torch.float32"):
        rule.to_megatron({"h.w": torch.full((1000,), 0.25 + 2 ** -25)}, target)


def test_transformers_is_not_imported(tmp_path):
    """The converter reads config.json as JSON and tensors with safetensors (transformers is a test extra)."""
    import subprocess
    import sys
    code = ("import sys; import megatron_kcp.convert, megatron_kcp.convert.__main__; "
            "assert not any(m.split('.')[0] == 'transformers' for m in sys.modules), 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- slow: the converted checkpoint at TP = 2 and CP = 2 ----

def _tp_logits(megatron_dir, toks, ref):
    out = megatron_logits(megatron_dir, toks, parallel_output=False)
    assert rel_err(out, ref) < TOL, rel_err(out, ref)


def _cp_logits(megatron_dir, toks, ref):
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_kcp.layers.attention import gather_zigzag
    group = ps.get_context_parallel_group()
    batch = get_batch_on_this_cp_rank({"tokens": toks, "position_ids": torch.arange(toks.shape[1])[None]}, False,
                                      group)
    with open(os.path.join(megatron_dir, "hf", "config.json")) as f:
        spec = family_for(json.load(f)).model_spec({})
    model = build_model(spec)
    io.load_megatron(model, megatron_dir)
    with torch.no_grad():
        local = model(batch["tokens"], batch["position_ids"], None)          # [b, s / W, V]
    out = gather_zigzag(local.transpose(0, 1).contiguous(), group, group.size()).transpose(0, 1)
    assert rel_err(out, ref) < TOL, rel_err(out, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", hf.FAMILIES)
@pytest.mark.parametrize("parallel", ["tp2", "cp2"])
def test_converted_checkpoint_loads_at_tp2_and_cp2(family, parallel, converted):
    _, megatron_dir, _ = converted(family)
    toks = tokens(1)
    ref = hf.reference_logits(family, toks)
    if parallel == "tp2":
        spawn(_tp_logits, 2, megatron_dir, toks, ref, tp=2)
    else:
        spawn(_cp_logits, 2, megatron_dir, toks, ref)


def _megatron_lm_load(megatron_dir, extra):
    """megatron_kcp.train's parser on megatron_args.txt (+ --load DIR --finetune), the model its config builds,
    and Megatron-LM's own load_checkpoint: every weight as the converter wrote it."""
    import shlex

    import megatron.training.checkpointing as ckpt
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_kcp import train
    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    with open(os.path.join(megatron_dir, "megatron_args.txt")) as f:
        flags = shlex.split(f.read())
    args = train.parse_args(flags + ["--load", megatron_dir, "--finetune", "--micro-batch-size", "1",
                                     "--global-batch-size", "1", "--seq-length", str(SEQ), "--train-iters", "1",
                                     "--lr", "1e-4", "--use-cpu-initialization", "--mock-data", "--tokenizer-type",
                                     "NullTokenizer", *extra])
    cfg = train.model_config(args)
    model = cfg.get_builder_cls()(cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    if not torch.cuda.is_available():       # Megatron's read_metadata all-reduces the iteration on a CUDA tensor
        ckpt.read_metadata = lambda path: (int(open(path).read()), False)
    ckpt.load_checkpoint([model], None, None)
    with open(os.path.join(megatron_dir, "hf", "config.json")) as f:
        spec = family_for(json.load(f)).model_spec({})
    ours = build_model(spec)
    io.load_megatron(ours, megatron_dir)
    theirs = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    mine = {k: v for k, v in ours.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(theirs) == sorted(mine), set(theirs) ^ set(mine)
    for k in mine:
        assert theirs[k].shape == mine[k].shape and torch.equal(theirs[k].float(), mine[k].float()), k


@pytest.mark.slow
@pytest.mark.parametrize("family", hf.FAMILIES)
def test_megatron_args_build_the_model_and_load_it(family, converted):
    """The printed flags build, with megatron_kcp.train's parser (Megatron-LM's plus the plugin's), a model of
    the same names and shapes, and Megatron-LM's load_checkpoint (--load DIR --finetune) fills it."""
    cpu = ["--moe-token-dispatcher-type", "allgather"] if family != "qwen3_5" else []     # alltoall needs CUDA
    spawn(_megatron_lm_load, 1, converted(family)[1], cpu)
