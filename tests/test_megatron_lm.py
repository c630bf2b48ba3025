"""Megatron-LM's pretrain_gpt.py path, on the CPU: README.md's commands as pretrain_gpt.py reads them.

The commands come from the README's ``pretrain_gpt.py`` block, expanded by bash with a stand-in
torchrun that records them (scripts/device_megatron_lm.sh runs the same block on GPUs). They are the
launcher's ``--megatron-lm`` commands; Megatron's parser and checks accept them with pretrain_gpt.py's
defaults; the model pretrain_gpt.py builds from them (``gpt_config_from_args``: a plain
TransformerConfig, the spec from ``--spec``, unpatched or patched) has the KCP mixers, the hybrid
pattern and the KDA options of the spec's name. Without the TE-less flags Megatron's config refuses
the same arguments when TE is missing.
With Megatron-LM's pretrain_gpt.py at hand (.mlm/ or MEGATRON_LM), its own dataset provider and
forward_step give the loss of megatron_kcp.train's on the same KCP model at CP=2.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from megatron_kcp import launch
from megatron_kcp.environment import NO_TE_ARGS, te_available
from megatron_kcp.testing.distributed import spawn

ROOT = pathlib.Path(__file__).resolve().parents[1]
MEGATRON_LM = "/opt/Megatron-LM"


def readme_block() -> str:
    """The README's bash block that runs pretrain_gpt.py (the same rule as scripts/device_megatron_lm.sh)."""
    blocks = re.findall(r"^```bash\n(.*?)^```$", (ROOT / "README.md").read_text(), re.S | re.M)
    found = [b for b in blocks if "pretrain_gpt.py --spec" in b]
    assert len(found) == 1, "README.md must hold one bash block with the pretrain_gpt.py commands"
    return found[0]


def readme_commands() -> list[list[str]]:
    """Each torchrun command of the block, as bash expands it (torchrun's own options included)."""
    record = 'torchrun() { "$PYTHON" -c "import json, sys; print(json.dumps(sys.argv[1:]))" "$@"; }\n'
    env = {**os.environ, "MEGATRON_LM": MEGATRON_LM, "PYTHON": sys.executable,
           "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", record + readme_block()], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines()]


def _script_args(cmd):
    i = cmd.index(f"{MEGATRON_LM}/pretrain_gpt.py")
    return cmd[:i], cmd[i + 1:]


def test_readme_commands():
    cmds = readme_commands()
    specs = [args[args.index("--spec") + 1:args.index("--spec") + 3] for _, args in map(_script_args, cmds)]
    assert specs == [["megatron_kcp", "gdn_hybrid_layer_spec"],
                     ["megatron_kcp", "kda_hybrid_layer_spec:kda_gate_rank=32,kda_norm_eps=1e-6"],
                     ["megatron_kcp", "--num-layers"]]          # the one-token form (patched Megatron-LM)
    for cmd in cmds:
        torchrun, args = _script_args(cmd)
        assert torchrun == ["--nproc-per-node", "2"]
        no_te = [x for flag in NO_TE_ARGS for x in flag]
        assert (args[-len(no_te):] == no_te) != te_available()


def _megatron_namespace(argv):
    from megatron.training.arguments import parse_args
    saved, sys.argv = sys.argv, ["pretrain_gpt.py", *argv]
    try:
        return vars(parse_args())
    finally:
        sys.argv = saved


@pytest.mark.parametrize("index,preset", [(0, "tiny-gdn.json"), (1, "tiny-kda.json"), (2, "tiny-gdn.json")])
def test_readme_commands_are_the_launchers(index, preset, capsys):
    """README and `MEGATRON_LM=... scripts/train_single_node.sh PRESET --cp 2` set the same arguments."""
    assert launch.main(["--dry-run", str(ROOT / "configs" / preset), "--nproc-per-node", "2", "--cp", "2",
                        "--megatron-lm", MEGATRON_LM, "--", "--train-iters", "20"]) == 0
    _, ours = _script_args(shlex.split(capsys.readouterr().out))
    _, readme = _script_args(readme_commands()[index])
    ours, readme = _megatron_namespace(ours), _megatron_namespace(readme)
    assert {k: v for k, v in readme.items() if k != "spec"} == {k: v for k, v in ours.items() if k != "spec"}


def _pretrain_gpt_builds(index, tmp_dir):
    """pretrain_gpt.py's startup up to the model: its parse_and_validate_args call, gpt_config_from_args
    (the spec imported by Megatron's import_module, patched for the one-token command), the builder."""
    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    import megatron.training.argument_utils as argument_utils
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.arguments import parse_and_validate_args

    from tests.test_patches import patched_spec_utils_module
    _, argv = _script_args(readme_commands()[index])
    if index == 2:
        # a directory per rank: two ranks patching one copy race (the second finds it patched, and fails)
        here = os.path.join(tmp_dir, f"pid{os.getpid()}")
        argument_utils.import_module = patched_spec_utils_module(here).import_module
    sys.argv = ["pretrain_gpt.py", *argv, "--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = argument_utils.gpt_config_from_args(args)
    assert type(model_cfg.transformer) is TransformerConfig         # no KDA fields: options come with the spec
    model = model_cfg.get_builder_cls()(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    kinds = [type(layer.self_attention).__name__ for layer in model.decoder.layers]
    mixer = "KCPKimiDeltaAttention" if index == 1 else "KCPGatedDeltaNet"
    assert kinds == [mixer] * 3 + ["KCPSelfAttention"], kinds
    assert args.context_parallel_size == 2 and args.tokenizer_type == "NullTokenizer"
    if index == 1:
        first = model.decoder.layers[0].self_attention
        assert first.f_proj[0].weight.shape[0] == 32 and first.o_norm.eps == 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1, 2])
def test_readme_commands_build_the_hybrids_as_pretrain_gpt_does(index, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_pretrain_gpt_builds, 2, index, str(tmp_path))


def _stops_without_te_flags():
    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import parse_and_validate_args
    _, argv = _script_args(readme_commands()[0])
    sys.argv = ["pretrain_gpt.py", *argv[:-sum(len(f) for f in NO_TE_ARGS)], "--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        core_transformer_config_from_args(args)


@pytest.mark.slow
def test_without_te_the_flags_are_needed(monkeypatch):
    """What `MEGATRON_LM=... scripts/train_single_node.sh` hit before the launcher added the flags."""
    if te_available():
        pytest.skip("TransformerEngine is installed")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_stops_without_te_flags, 2)


LOCAL_MLM = pathlib.Path(os.environ.get("MEGATRON_LM") or ROOT / ".mlm")


def pretrain_gpt_steps(argv, check_model=lambda model: None):
    """Megatron-LM's own pretrain_gpt.py on the CPU (megatron_cpu, its .cuda() calls made no-ops): its startup
    parses and validates ``argv``, Megatron's builder makes the model (``check_model`` looks at it); then one
    step's (loss, tokens) on that model from pretrain_gpt.py's dataset provider and forward_step, and from
    megatron_kcp.train's. Returns the two pairs."""
    import importlib.util

    import torch
    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_kcp import train
    sys.path.insert(0, str(LOCAL_MLM))
    spec = importlib.util.spec_from_file_location("pretrain_gpt", LOCAL_MLM / "pretrain_gpt.py")
    pretrain_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain_gpt)
    sys.argv = ["pretrain_gpt.py", *argv, "--use-cpu-initialization"]
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = gpt_config_from_args(args)
    torch.manual_seed(args.seed)
    model = model_cfg.get_builder_cls()(model_cfg).build_model(ProcessGroupCollection.use_mpu_process_groups())
    check_model(model)
    losses = []
    for provider, forward_step in ((pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.forward_step),
                                   (train.datasets_provider, train.forward_step)):
        dataset = provider([1, 0, 0])[0]
        output, loss_func = forward_step(iter([torch.utils.data.default_collate([dataset[0]])]), model)
        loss, num_tokens, _ = loss_func(output)
        losses.append((loss.item(), num_tokens.item()))
    return losses


def _real_pretrain_gpt_step(index, data=()):
    """The README's ``index``-th pretrain_gpt.py command: pretrain_gpt.py's step equals megatron_kcp.train's.
    ``data``: the data options that replace the README's mock data (an indexed dataset and its tokenizer)."""
    _, argv = _script_args(readme_commands()[index])
    argv = [a for a in argv if a != "--bf16"]
    if data:
        i = argv.index("--tokenizer-type")
        argv = [a for a in argv[:i] + argv[i + 2:] if a != "--mock-data"] + list(data)
    losses = pretrain_gpt_steps([*argv, "--seq-length", "256", "--max-position-embeddings", "256"])
    assert losses[0] == losses[1] and (losses[0][1] == 128 or data), losses    # this rank's half of 256 tokens


@pytest.mark.skipif(not (LOCAL_MLM / "pretrain_gpt.py").is_file(),
                    reason="needs Megatron-LM's pretrain_gpt.py in .mlm/ or MEGATRON_LM (scripts/fetch_megatron_lm.sh)")
@pytest.mark.parametrize("index", [0, 1])
def test_real_pretrain_gpt_step_equals_the_entrys(index, monkeypatch, capfd):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_real_pretrain_gpt_step, 2, index)
    mixer = "KCPKimiDeltaAttention (layer 1, kda_gate_rank=32" if index else "KCPGatedDeltaNet (layer 1)"
    assert f"[megatron_kcp] KCP active: {mixer}" in capfd.readouterr().out


@pytest.mark.skipif(not (LOCAL_MLM / "pretrain_gpt.py").is_file(),
                    reason="needs Megatron-LM's pretrain_gpt.py in .mlm/ or MEGATRON_LM (scripts/fetch_megatron_lm.sh)")
@pytest.mark.parametrize("index", [0, 1])
def test_real_pretrain_gpt_step_on_documents_equals_the_entrys(index, tmp_path, monkeypatch, capfd):
    """pretrain_gpt.py --dataloader-inter-document-masking on an indexed dataset at CP = 2 (its GPTDataset, its
    get_batch's whole-stream cut, its PackedSeqParams) gives megatron_kcp.train's loss on every rank."""
    from megatron_kcp.testing.data import build_indexed_dataset, build_tokenizer_dir
    tok = build_tokenizer_dir(tmp_path / "tok")
    prefix = build_indexed_dataset(tmp_path / "docs", tok, 60)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_real_pretrain_gpt_step, 2, index, ("--data-path", prefix, "--split", "100,0,0", "--tokenizer-type",
                                              "HuggingFaceTokenizer", "--tokenizer-model", str(tok),
                                              "--dataloader-inter-document-masking", "--eod-mask-loss"))
    assert "THD packed documents, zigzag (--dataloader-inter-document-masking)" in capfd.readouterr().out


@pytest.mark.slow
def test_spec_import_skips_the_wheels_make_of_built_helpers(tmp_path, monkeypatch):
    """pretrain_gpt.py next to the wheel: Megatron's startup `make` has no Makefile there and exits; the
    spec, imported first, skips it when the helpers are built. A checkout's Makefile is left alone."""
    from megatron.core.datasets import utils
    if (pathlib.Path(utils.__file__).parent / "Makefile").exists():
        pytest.skip("megatron-core from a checkout: its make step works")
    call = "from megatron.core.datasets import utils; utils.compile_helpers(); print('went on')"
    plain = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 1 and "went on" not in plain.stdout      # what Megatron's startup does here
    kcp = subprocess.run([sys.executable, "-c", "import megatron_kcp.spec; " + call], capture_output=True, text=True,
                         timeout=300)
    assert kcp.returncode == 0 and "went on" in kcp.stdout, kcp.stderr[-2000:]
    from megatron_kcp.wheel import skip_make_of_prebuilt_dataset_helpers
    (tmp_path / "Makefile").write_text("default:\n")
    monkeypatch.setattr(utils, "__file__", str(tmp_path / "utils.py"))
    original = utils.compile_helpers
    assert not skip_make_of_prebuilt_dataset_helpers() and utils.compile_helpers is original
