"""The hybrid GPT on real documents through megatron_kcp.train's data path (CPU ranks, fp32): an indexed dataset
built with megatron-core's IndexedDatasetBuilder and a trained BPE tokenizer, read by GPTDataset with
--dataloader-inter-document-masking, cut by megatron-core (the flattened micro batch as one zigzag stream);
per-token losses, the loss and every gradient at CP = 2 and 4 equal CP = 1."""
from __future__ import annotations

import pytest
import torch

from megatron_kcp.testing.distributed import rel_err, spawn
from tests.test_train import _small_model

SEQ = 64         # tests.test_train.SMALL's --seq-length


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from megatron_kcp.testing.data import build_indexed_dataset, build_tokenizer_dir
    root = tmp_path_factory.mktemp("docs")
    tok = build_tokenizer_dir(root / "tok")
    g = torch.Generator().manual_seed(1)
    lengths = (2 * torch.randint(0, 12, (120,), generator=g) + 1).tolist()       # odd, 1 to 23 tokens
    prefix = build_indexed_dataset(root / "docs", tok, len(lengths), lengths)
    return ["--data-path", prefix, "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(tok), "--dataloader-inter-document-masking", "--eod-mask-loss"]


def doc_step(model, args, mbs: int) -> dict:
    """One micro batch of ``mbs`` samples through train.forward_step; the per-token losses by stream position,
    the mean token loss and every parameter's gradient of it, summed over the CP ranks."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_kcp import train
    train_ds, _, _ = train.datasets_provider([mbs, 0, 0])
    samples = [train_ds[i] for i in range(mbs)]
    docs = sum(int((s["cu_seqlens"] < SEQ).sum()) for s in samples)
    batch = torch.utils.data.default_collate(samples)
    output, loss_fn = train.forward_step(iter([batch]), model)
    loss, num_tokens, _ = loss_fn(output)
    group = ps.get_context_parallel_group()
    total = torch.stack([loss.detach(), num_tokens.float()])
    torch.distributed.all_reduce(total, group=group)
    (loss / total[1]).backward()
    where = get_batch_on_this_cp_rank({"tokens": torch.arange(mbs * SEQ)[None]}, False, group,
                                      use_per_sequence_balancing=True)["tokens"][0]
    per_token = torch.zeros(mbs * SEQ)
    per_token[where] = output.detach().reshape(-1)
    torch.distributed.all_reduce(per_token, group=group)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        torch.distributed.all_reduce(g, group=group)
    return {"loss": (total[0] / total[1]).item(), "tokens": total[1].item(), "per_token": per_token, "docs": docs,
            "grads": grads}


def _step(preset, extra, mbs, out):
    from megatron.core import parallel_state as ps
    args, build = _small_model(preset, ps.get_context_parallel_world_size(),
                               [*extra, "--micro-batch-size", str(mbs), "--global-batch-size", str(mbs)])
    result = doc_step(build(), args, mbs)
    if torch.distributed.get_rank() == 0:
        torch.save(result, out)


def check_equal(cp1: dict, cpw: dict):
    assert cp1["tokens"] == cpw["tokens"] and cp1["docs"] == cpw["docs"]
    assert rel_err(cpw["per_token"], cp1["per_token"]) < 1e-5
    assert abs(cpw["loss"] - cp1["loss"]) <= 1e-5 * abs(cp1["loss"]), (cp1["loss"], cpw["loss"])
    errs = {n: rel_err(cpw["grads"][n], g) for n, g in cp1["grads"].items()}
    assert max(errs.values()) < 1e-4, sorted(errs.items(), key=lambda e: -e[1])[:5]


@pytest.mark.parametrize("preset,cp,mbs,convert", [
    ("tiny-gdn.json", 2, 2, "0"), ("tiny-kda.json", 2, 1, "1"),
    pytest.param("tiny-gdn.json", 4, 1, "1", marks=pytest.mark.slow),
    pytest.param("tiny-kda.json", 4, 2, "0", marks=pytest.mark.slow),
    pytest.param("tiny-gdn.json", 2, 1, "1", marks=pytest.mark.slow),
    pytest.param("tiny-kda.json", 2, 2, "0", marks=pytest.mark.slow),
])
def test_documents_at_cp_equal_cp1(preset, cp, mbs, convert, data, tmp_path, monkeypatch):
    """The hybrid (linear mixers, softmax attention with RoPE, MLPs, embeddings) on Megatron's whole-stream cut
    of documents of odd lengths, micro batch 1 and 2, the layout conversion on and off: equal to CP = 1."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setenv("KCP_CONVERT", convert)
    spawn(_step, 1, preset, data, mbs, tmp_path / "cp1")
    spawn(_step, cp, preset, data, mbs, tmp_path / "cpw")
    cp1, cpw = (torch.load(tmp_path / n) for n in ("cp1", "cpw"))
    assert cp1["docs"] >= 2 * mbs, cp1["docs"]
    check_equal(cp1, cpw)


def _train(preset, extra, steps, out):
    """``steps`` Adam steps of the hybrid on the documents (the CP-summed gradients applied, as Megatron's
    reduction does); the losses, each sample the next of the dataset."""
    from megatron.core import parallel_state as ps

    from megatron_kcp import train
    args, build = _small_model(preset, ps.get_context_parallel_world_size(), [*extra, "--train-iters", str(steps)])
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    train_ds, _, _ = train.datasets_provider([steps, 0, 0])
    group = ps.get_context_parallel_group()
    losses = []
    for i in range(steps):
        opt.zero_grad()
        output, loss_fn = train.forward_step(iter([torch.utils.data.default_collate([train_ds[i]])]), model)
        loss, num_tokens, _ = loss_fn(output)
        total = torch.stack([loss.detach(), num_tokens.float()])
        torch.distributed.all_reduce(total, group=group)
        (loss / total[1]).backward()
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad, group=group)
        opt.step()
        losses.append((total[0] / total[1]).item())
    if torch.distributed.get_rank() == 0:
        torch.save(losses, out)


@pytest.mark.parametrize("preset", ["tiny-gdn.json", pytest.param("tiny-kda.json", marks=pytest.mark.slow)])
def test_training_on_documents_at_cp2_follows_cp1(preset, data, tmp_path, monkeypatch):
    """Twelve steps on the indexed dataset with --dataloader-inter-document-masking: the loss falls, and CP = 2
    follows CP = 1 to fp32 rounding."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    spawn(_train, 1, preset, data, 12, tmp_path / "cp1")
    spawn(_train, 2, preset, data, 12, tmp_path / "cp2")
    cp1, cp2 = (torch.load(tmp_path / n) for n in ("cp1", "cp2"))
    assert sum(cp1[-3:]) / 3 < sum(cp1[:3]) / 3 - 0.3, cp1          # it trains
    assert max(abs(a - b) / abs(b) for a, b in zip(cp2, cp1)) < 1e-4, list(zip(cp1, cp2))
