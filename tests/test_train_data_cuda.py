"""Real documents on one GPU: Megatron-LM's pretrain_gpt.py (``.mlm/`` or ``MEGATRON_LM``) and megatron_kcp.train,
launched by megatron_kcp.launch on an indexed dataset this test builds (a trained BPE tokenizer, megatron-core's
IndexedDatasetBuilder), with --dataloader-inter-document-masking --eod-mask-loss: the loss falls."""
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


@pytest.mark.parametrize("preset", ["tiny-gdn.json", "tiny-kda.json"])
@pytest.mark.parametrize("trainer", ["megatron_kcp.train", "pretrain_gpt.py"])
def test_trains_on_documents_on_gpu(trainer, preset, tmp_path):
    if trainer == "pretrain_gpt.py" and not (MLM / "pretrain_gpt.py").is_file():
        pytest.skip("needs Megatron-LM's pretrain_gpt.py in .mlm/ or MEGATRON_LM (scripts/fetch_megatron_lm.sh)")
    from megatron_kcp.testing.data import build_indexed_dataset, build_tokenizer_dir
    tok = build_tokenizer_dir(tmp_path / "tok")
    g = torch.Generator().manual_seed(0)
    lengths = (2 * torch.randint(10, 300, (600,), generator=g) + 1).tolist()
    prefix = build_indexed_dataset(tmp_path / "docs", tok, len(lengths), lengths)
    cmd = [sys.executable, "-m", "megatron_kcp.launch", str(ROOT / "configs" / preset), "--cp", "1"]
    cmd += ["--megatron-lm", str(MLM)] if trainer == "pretrain_gpt.py" else []
    cmd += ["--", "--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tok), "--dataloader-inter-document-masking", "--eod-mask-loss",
            "--train-iters", "40", "--lr", "1e-3", "--lr-warmup-iters", "4", "--seed", "7"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", "MASTER_PORT": "29517"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    log = run.stdout + run.stderr
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.]+E[+-][0-9]+)", log)]
    print(f"{trainer} {preset}: {len(losses)} steps, loss {losses[:1]} -> {losses[-1:]}", flush=True)
    assert run.returncode == 0, log[-4000:]
    assert "[megatron_kcp] KCP active" in log, log[-4000:]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
