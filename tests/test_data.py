"""Real training data: a Megatron indexed dataset (PREFIX.bin/.idx) and a Hugging Face tokenizer, both
built here, through the entry's startup checks, its dataset provider and the launcher."""
from __future__ import annotations

import pathlib
import shlex
import shutil

import pytest
import torch

from megatron_kcp import launch, train
from megatron_kcp.testing.data import EOD_TOKEN, build_indexed_dataset, build_tokenizer_dir
from megatron_kcp.testing.distributed import spawn

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
SMALL = ("--num-layers", "2", "--linear-attention-freq", "2", "--hidden-size", "64", "--seq-length", "64",
         "--max-position-embeddings", "64")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 384-token BPE tokenizer, a 300-token one, 100 documents of odd lengths tokenized by the first
    (each part of --split 98,1,1 gets one), and 3 documents of 5, 1 and 7 tokens."""
    d = tmp_path_factory.mktemp("data")
    tok, small = build_tokenizer_dir(d / "tok"), build_tokenizer_dir(d / "small", vocab_size=300)
    return {"dir": d, "tok": str(tok), "small": str(small), "prefix": build_indexed_dataset(d / "docs", tok, 100),
            "three": build_indexed_dataset(d / "three", tok, 3, lengths=[5, 1, 7], seed=1)}


def _argv(*extra):
    """The launcher's arguments for tiny-gdn.json with the trainer's own ``extra``, as the launcher builds them."""
    args = launch.megatron_args(launch.load_preset(CONFIGS / "tiny-gdn.json"), 1, 1, 1, False, extra)
    return args + ["--global-batch-size", "1", "--train-iters", "10", *extra]


def _real(files, data=None, tok=None, *more):
    return ["--data-path", *(data or [files["prefix"]]), "--split", "98,1,1", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", tok or files["tok"], *more]


def test_dataset_and_tokenizer_agree(files):
    """Every document ends in the tokenizer's EOD (id of <|endoftext|>), the lengths are as asked, odd."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer
    eod = Tokenizer.from_file(files["tok"] + "/tokenizer.json").token_to_id(EOD_TOKEN)
    ds = IndexedDataset(files["prefix"])
    lengths = ds.index.sequence_lengths
    assert len(ds) == 100 and all(n % 2 for n in lengths) and len(set(lengths)) > 10
    assert list(ds.document_indices) == list(range(101))          # one sequence a document
    assert all(ds[i][-1] == eod and (ds[i][:-1] != eod).all() for i in range(len(ds)))
    three = IndexedDataset(files["three"])
    assert list(three.index.sequence_lengths) == [5, 1, 7] and three[1].tolist() == [eod]


def test_real_data_parses(files):
    argv = _argv(*_real(files, None, None, "--dataloader-inter-document-masking", "--eod-mask-loss"))
    assert "--mock-data" not in argv and "NullTokenizer" not in argv
    a = train.read_args(argv)
    assert not a.mock_data and a.data_path == [files["prefix"]] and a.tokenizer_type == "HuggingFaceTokenizer"
    assert a.dataloader_inter_document_masking and a.eod_mask_loss
    blend = ["0.3", files["prefix"], "0.7", files["prefix"]]     # Megatron's weighted blend
    assert train.read_args(_argv(*_real(files, blend))).data_path == blend
    listed = files["dir"] / "blend.txt"                          # the same list, from a file
    listed.write_text(" ".join(blend))
    real = _real(files)
    a = train.read_args(_argv("--data-args-path", str(listed), *real[real.index("--split"):]))
    assert a.data_args_path == str(listed) and not a.mock_data
    mock = train.read_args(_argv())          # no data named: mock data, NullTokenizer
    assert mock.mock_data and mock.tokenizer_type == "NullTokenizer"
    bare = train.read_args([x for x in _argv() if x not in ("--mock-data", "--tokenizer-type", "NullTokenizer")])
    assert bare.mock_data and bare.tokenizer_type == "NullTokenizer"       # read_args's own defaults


def _copy(files, name, idx_from=None, bin_from=None):
    """A prefix ``name`` with the .idx of the fixture's prefix ``idx_from`` and the .bin of ``bin_from``."""
    for ext, source in ((".idx", idx_from), (".bin", bin_from)):
        if source:
            shutil.copy(files[source] + ext, files["dir"] / (name + ext))
    return str(files["dir"] / name)


@pytest.mark.parametrize("case,match", [
    ("no_bin", r"only_idx\.bin not found; preprocess .*tools/preprocess_data\.py"),
    ("no_idx", r"only_bin\.idx not found; preprocess"),
    ("suffix", r"--data-path .*docs\.bin: give the path prefix without the suffix, i\.e\. .*docs$"),
    ("blend", r"--data-path .*nowhere: .*nowhere\.bin not found"),
    ("small_vocab", r"docs\.bin holds token id 3\d\d, not below the vocab size 300 of --tokenizer-type "
                    r"HuggingFaceTokenizer --tokenizer-model .*small: use the tokenizer"),
    ("no_tokenizer_dir", r"--tokenizer-model .*nope: no such file or directory"),
    ("mock_and_data", r"--mock-data with --data-path: drop --mock-data"),
    ("no_tokenizer_type", r"--data-path needs the tokenizer .*add --tokenizer-type .*--tokenizer-model"),
    ("no_tokenizer_model", r"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model"),
    ("per_split", r"--valid-data-path .*gone: .*gone\.bin not found"),
    ("mismatch", r"--data-path .*mixed: .*mixed\.bin has \d+ bytes, its \.idx describes \d+: the two files are "
                 r"from different runs"),
    ("null_vocab", r"docs\.bin holds token id \d+, not below the vocab size 100 of --tokenizer-type NullTokenizer: "
                   r".*--vocab-size for NullTokenizer"),
    ("no_args_file", r"--data-args-path .*absent\.txt: no such file"),
    ("split_empty", r"--data-path .*three: --split 98,1,1 leaves its valid part empty \(3 sequences\), and "
                    r"Megatron's dataset builder loops forever .*give that part 0 in --split"),
])
def test_bad_data_options_fail_naming_the_fix(files, case, match):
    p, d = files["prefix"], files["dir"]
    extra = {
        "no_bin": lambda: _real(files, [_copy(files, "only_idx", idx_from="prefix")]),
        "no_idx": lambda: _real(files, [_copy(files, "only_bin", bin_from="prefix")]),
        "suffix": lambda: _real(files, [p + ".bin"]),
        "blend": lambda: _real(files, ["0.5", p, "0.5", str(d / "nowhere")]),
        "small_vocab": lambda: _real(files, None, files["small"]),
        "no_tokenizer_dir": lambda: _real(files, None, str(d / "nope")),
        "mock_and_data": lambda: _real(files) + ["--mock-data"],
        "no_tokenizer_type": lambda: ["--data-path", p, "--split", "98,1,1"],
        "no_tokenizer_model": lambda: ["--data-path", p, "--tokenizer-type", "HuggingFaceTokenizer"],
        "mismatch": lambda: _real(files, [_copy(files, "mixed", "prefix", "three")]),
        "null_vocab": lambda: ["--data-path", p, "--split", "98,1,1", "--tokenizer-type", "NullTokenizer",
                               "--vocab-size", "100"],
        "no_args_file": lambda: ["--data-args-path", str(d / "absent.txt"), "--tokenizer-type", "NullTokenizer"],
        "split_empty": lambda: _real(files, [files["three"]]),
        "per_split": lambda: ["--train-data-path", p, "--valid-data-path", str(d / "gone"), "--test-data-path", p,
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", files["tok"]],
    }[case]()
    with pytest.raises(ValueError, match=match) as e:
        train.read_args(_argv(*extra))
    assert "\n" not in str(e.value)


def test_main_prints_one_line(files, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(_argv(*_real(files, [files["prefix"] + ".idx"])))
    assert str(e.value).startswith("megatron_kcp.train: --data-path ") and "\n" not in str(e.value)


def _samples(argv, out):
    from megatron_kcp import megatron_cpu
    megatron_cpu.enable()
    from megatron.training import get_tokenizer
    args = train.parse_args([x for x in argv if x != "--bf16"] + ["--use-cpu-initialization", *SMALL])
    train_ds, _, _ = train.datasets_provider([8, 0, 0])
    samples = [train_ds[i] for i in range(8)]
    torch.save({"kind": type(train_ds).__name__, "eod": get_tokenizer().eod, "padded": args.padded_vocab_size,
                "mask": args.create_attention_mask_in_dataloader, "samples": samples}, out)


def test_provider_gives_document_boundaries(files, tmp_path, monkeypatch):
    """GPTDataset from the entry's provider: cu_seqlens end each document after its EOD, positions restart
    there, the EOD tokens carry no loss (--eod-mask-loss), and the tokenizer's EOD is the data's."""
    monkeypatch.setenv("KCP_RANK_TIMEOUT", "240")       # a stalled dataset build fails, with its stack
    argv = _argv(*_real(files, None, None, "--dataloader-inter-document-masking", "--eod-mask-loss"))
    spawn(_samples, 1, argv, tmp_path / "out")
    out = torch.load(tmp_path / "out")
    assert out["kind"] == "GPTDataset" and out["eod"] == 0 and out["padded"] == 384 and not out["mask"]
    inner = 0
    for s in out["samples"]:
        tokens, cu = s["tokens"], s["cu_seqlens"].tolist()
        assert tokens.shape == (64,) and "attention_mask" not in s
        cu = cu[:cu.index(64) + 1]                # the rest pads to a fixed length
        eods = (tokens == out["eod"]).nonzero().flatten().tolist()
        assert [b - 1 for b in cu[1:-1]] == [i for i in eods if i < 63], (cu, eods)
        assert all(s["position_ids"][b] == 0 for b in cu[:-1]) and s["max_seqlen"] == max(
            b - a for a, b in zip(cu, cu[1:]))
        assert (s["loss_mask"][tokens == out["eod"]] == 0).all() and s["loss_mask"].sum() == 64 - len(eods)
        inner += len(cu) - 2
    assert inner >= 8          # the samples do cross documents


def _dry(capsys, *argv):
    assert launch.main(["--dry-run", str(CONFIGS / "tiny-gdn.json"), *argv]) == 0
    return shlex.split(capsys.readouterr().out)


def test_launcher_passes_data_options(capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    data = ["--data-path", "0.5", "/d/a", "0.5", "/d/b", "--split", "98,1,1",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/t"]
    cmd = _dry(capsys, "--", *data)
    assert "--mock-data" not in cmd and "NullTokenizer" not in cmd
    i = cmd.index("--data-path")
    assert cmd[i:i + len(data)] == data
    assert "--mock-data" not in _dry(capsys, "--", "--data-path=/d/a", "--tokenizer-type", "HuggingFaceTokenizer")
    tok_only = _dry(capsys, "--", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/t")
    assert "--mock-data" in tok_only and "NullTokenizer" not in tok_only       # mock tokens, the user's tokenizer
    mock = _dry(capsys)
    assert "--mock-data" in mock and mock[mock.index("--tokenizer-type") + 1] == "NullTokenizer"


def test_readme_data_command_parses(files, capsys, monkeypatch):
    """The README's own-data command (its launcher line, the data and tokenizer swapped for this test's), through
    the launcher and the trainer's startup checks, as a user pastes it."""
    import re
    block = next(b for b in re.findall(r"^```bash\n(.*?)^```$", (CONFIGS.parent / "README.md").read_text(), re.S | re.M)
                 if "--dataloader-inter-document-masking" in b)
    line = next(x for x in block.replace("\\\n", " ").splitlines() if x.startswith("scripts/train_single_node.sh"))
    words = shlex.split(line)[1:]
    words[words.index("--data-path") + 1] = files["prefix"]
    words[words.index("--tokenizer-model") + 1] = files["tok"]
    monkeypatch.delenv("MEGATRON_LM", raising=False)
    cut = words.index("--")
    cmd = _dry(capsys, *words[1:cut], "--nproc-per-node", "2", *words[cut:])
    argv = cmd[cmd.index("megatron_kcp.train") + 1:]
    a = train.read_args(argv)
    assert a.dataloader_inter_document_masking and a.eod_mask_loss and a.context_parallel_size == 2
    assert not a.mock_data and a.data_path == [files["prefix"]]
