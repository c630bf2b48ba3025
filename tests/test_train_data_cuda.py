"""Real documents on one GPU: Megatron-LM's pretrain_gpt.py (``.mlm/`` or ``MEGATRON_LM``) and megatron_kcp.train,
launched by megatron_kcp.launch on an indexed dataset this test builds (a trained BPE tokenizer, megatron-core's
IndexedDatasetBuilder), with --dataloader-inter-document-masking --eod-mask-loss: the loss falls. The presets: the
dense toy hybrids, and the tiny Qwen3-Next (MoE, gated attention with QK norm, partial RoPE, zero-centred norms,
MTP) and Kimi Linear (KDA, NoPE MLA, a dense first layer, MoE) of the released models."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = pathlib.Path(__file__).resolve().parents[1]
MLM = pathlib.Path(os.environ.get("MEGATRON_LM") or ROOT / ".mlm")


# without TE, megatron-core's MTP layer refuses zero-centred norms and THD packs (the specs say so): the tiny
# Qwen3-Next trains without its MTP layer, and MTP through Megatron's own path on the dense toy, the dataset's
# samples as rows (no --dataloader-inter-document-masking)
PRESETS = {"tiny-gdn.json": [], "tiny-kda.json": [], "tiny-qwen3-next.json": ["--mtp-num-layers", "0"],
           "tiny-kimi-linear.json": [], "tiny-gdn.json+mtp": ["--mtp-num-layers", "1"]}


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("trainer", ["megatron_kcp.train", "pretrain_gpt.py"])
def test_trains_on_documents_on_gpu(trainer, preset, tmp_path):
    if trainer == "pretrain_gpt.py" and not (MLM / "pretrain_gpt.py").is_file():
        pytest.skip("needs Megatron-LM's pretrain_gpt.py in .mlm/ or MEGATRON_LM (scripts/fetch_megatron_lm.sh)")
    from megatron_kcp.testing.data import build_indexed_dataset, build_tokenizer_dir
    from megatron_kcp.testing.distributed import free_port   # cases side by side on one machine
    tok = build_tokenizer_dir(tmp_path / "tok")
    g = torch.Generator().manual_seed(0)
    lengths = (2 * torch.randint(10, 300, (600,), generator=g) + 1).tolist()
    prefix = build_indexed_dataset(tmp_path / "docs", tok, len(lengths), lengths)
    cmd = [sys.executable, "-m", "megatron_kcp.launch", str(ROOT / "configs" / preset.split("+")[0]), "--cp", "1"]
    cmd += ["--megatron-lm", str(MLM)] if trainer == "pretrain_gpt.py" else []
    cmd += ["--", "--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tok), "--eod-mask-loss",
            *([] if "+mtp" in preset else ["--dataloader-inter-document-masking"]),
            "--train-iters", "40", "--lr", "1e-3", "--lr-warmup-iters", "4", "--seed", "7", *PRESETS[preset]]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "MASTER_PORT": str(free_port())}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    log = run.stdout + run.stderr
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.]+E[+-][0-9]+)", log)]
    print(f"{trainer} {preset}: {len(losses)} steps, loss {losses[:1]} -> {losses[-1:]}", flush=True)
    assert run.returncode == 0, log[-4000:]
    assert "[megatron_kcp] KCP active" in log, log[-4000:]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    if "+mtp" in preset:
        mtp = [float(x) for x in re.findall(r"mtp_1 loss: ([0-9.]+E[+-][0-9]+)", log)]
        assert len(mtp) == 40 and sum(mtp[-5:]) / 5 < sum(mtp[:5]) / 5 - 0.5, mtp
