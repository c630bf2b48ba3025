"""Training data options: Megatron indexed datasets (PREFIX.bin + PREFIX.idx) or mock data.

:func:`default_data_args` is what the launcher and ``megatron_kcp.train`` add when the command
names no data (``--mock-data``, and Megatron's ``NullTokenizer`` when it names no tokenizer either).
:func:`check_data_args` checks at startup, before Megatron's own validation, that every dataset
prefix has both files and that the tokenizer covers every token id of the data; it raises a
ValueError naming the fix. No megatron import at module level (the launcher imports this module).
"""
from __future__ import annotations

import argparse
import os
import re

DATA_FLAGS = ("--data-path", "--data-args-path", "--train-data-path", "--valid-data-path", "--test-data-path",
              "--per-split-data-args-path", "--mock-data")
TOKENIZER_FLAGS = ("--tokenizer-type", "--tokenizer-model")
# tokenizer types that read --tokenizer-model (a file or a directory)
MODEL_FILE_TOKENIZERS = ("HuggingFaceTokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                         "Llama2Tokenizer", "TikTokenizer", "SFTTokenizer")
PREPROCESS = ("preprocess the documents with Megatron-LM's tools/preprocess_data.py (or, for a test, "
              "megatron_kcp.testing.data.build_indexed_dataset)")
SCAN_TOKENS = 1 << 26          # a .bin with more tokens than this is sampled, not read whole


def names(argv, flags) -> bool:
    """Whether the command line ``argv`` gives one of ``flags`` (``--flag value`` or ``--flag=value``)."""
    return any(x.split("=", 1)[0] in flags for x in argv if x.startswith("--"))


def default_data_args(argv) -> list[str]:
    """``--mock-data`` when ``argv`` names no data, and ``--tokenizer-type NullTokenizer`` when it
    names no tokenizer either (mock tokens need no tokenizer file); nothing for real data."""
    if names(argv, DATA_FLAGS):
        return []
    return ["--mock-data"] + ([] if names(argv, TOKENIZER_FLAGS) else ["--tokenizer-type", "NullTokenizer"])


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}" if str(e).strip() else type(e).__name__


def _prefixes(args):
    """(flag, prefix) of every dataset the arguments name, through Megatron's own blend parser."""
    from megatron.training.utils import get_blend_and_blend_per_split
    for flag in ("data_args_path", "per_split_data_args_path"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file; give a file of weight/prefix lists")
    try:
        blend, per_split = get_blend_and_blend_per_split(args)
    except (AssertionError, KeyError, ValueError, OSError) as e:
        raise ValueError(f"cannot read the dataset list ({_first_line(e)}): give either --data-path "
                         "(or --data-args-path) or --train/valid/test-data-path") from None
    flag = "--data-args-path" if args.data_args_path else "--data-path"
    for where, b in [(flag, blend)] + list(zip(("--train-data-path", "--valid-data-path", "--test-data-path"),
                                               per_split or ())):
        for prefix in (b[0] if b else ()):
            yield where, prefix


def _max_token(ds):
    """The largest token id of an IndexedDataset: every token of a small .bin, 64 windows of a big one."""
    import numpy
    total = int(ds.index.sequence_lengths.sum(dtype=numpy.int64))
    if total == 0:
        return -1
    window = total if total <= SCAN_TOKENS else SCAN_TOKENS // 64
    starts = [0] if window == total else numpy.linspace(0, total - window, 64).astype(numpy.int64)
    item = numpy.dtype(ds.index.dtype).itemsize
    return max(int(ds.bin_reader.read(ds.index.dtype, window, int(s) * item).max()) for s in starts)


def _check_split(args, flag, prefix, n):
    """Every part of --split that is asked for gets a sequence of the dataset: on an empty part
    Megatron's GPTDataset counts epochs forever (even for 0 samples, as with --eval-iters 0)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split)
    split = args.split or "969, 30, 1"      # Megatron's default for --data-path
    parts = ([(0.0, 1.0)] if flag.endswith(("train-data-path", "valid-data-path", "test-data-path"))
             else convert_split_vector_to_split_matrix(parse_and_normalize_split(split)))
    for name, part in zip(("train", "valid", "test"), parts):
        if part is not None and int(round(part[1] * n)) == int(round(part[0] * n)):
            what = f"--split {split} leaves its {name} part empty ({n} sequences)" if n else "it has no sequences"
            fix = "use more documents, or give that part 0 in --split (e.g. 98,2,0)" if n else PREPROCESS
            raise ValueError(f"{flag} {prefix}: {what}, and Megatron's dataset builder loops forever on an "
                             f"empty part; {fix}")


def _tokenizer(args):
    """Megatron's tokenizer for these arguments (its vocab size unpadded, ``args`` left unchanged)."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    if args.tokenizer_type in MODEL_FILE_TOKENIZERS:
        model = args.tokenizer_model
        if model is None:
            raise ValueError(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model (the tokenizer "
                             "file or directory the data was preprocessed with)")
        hub_id = args.tokenizer_type == "HuggingFaceTokenizer" and re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", model)
        if not os.path.exists(os.path.expanduser(model)) and not hub_id:
            raise ValueError(f"--tokenizer-model {model}: no such file or directory; give the tokenizer the data "
                             "was preprocessed with")
    for flag in ("vocab_file", "merge_file"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.exists(path):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: no such file")
    try:
        return build_tokenizer(argparse.Namespace(**{**vars(args), "pad_vocab_size": False}))
    except Exception as e:     # noqa: BLE001  (a tokenizer library's own error, or a missing library)
        raise ValueError(f"--tokenizer-type {args.tokenizer_type}: cannot build the tokenizer "
                         f"({_first_line(e)})") from None


def check_data_args(args) -> None:
    """Check the data options of parsed Megatron arguments; ValueError (one line, naming the fix).

    Mock data needs nothing. Real data (``--data-path``, its file form ``--data-args-path``, or the
    per-split paths) needs: exactly one data source, both PREFIX.bin and PREFIX.idx of every prefix
    (given without the suffix), a ``--tokenizer-type`` that builds, and every token id of the data
    below the tokenizer's vocab size.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    real = [f for f, v in (("--data-path", args.data_path), ("--data-args-path", args.data_args_path),
                           ("--train/valid/test-data-path", args.train_data_path or args.valid_data_path
                            or args.test_data_path),
                           ("--per-split-data-args-path", args.per_split_data_args_path)) if v]
    if args.mock_data and real:
        raise ValueError(f"--mock-data with {real[0]}: drop --mock-data to train on the dataset, or drop {real[0]}")
    if len(real) > 1:
        raise ValueError(f"{' and '.join(real)}: give one data source")
    if not real:
        return
    if args.tokenizer_type is None:
        raise ValueError(f"{real[0]} needs the tokenizer the data was preprocessed with: add --tokenizer-type "
                         "(e.g. HuggingFaceTokenizer) and --tokenizer-model PATH")
    import numpy
    vocab, largest, where = _tokenizer(args).vocab_size, -1, None
    for flag, prefix in _prefixes(args):
        if prefix.startswith(("s3://", "msc://")):       # object storage: Megatron reads it, not checked here
            continue
        have = {ext: os.path.isfile(prefix + ext) for ext in (".bin", ".idx")}
        if prefix.endswith((".bin", ".idx")) and not all(have.values()):
            raise ValueError(f"{flag} {prefix}: give the path prefix without the suffix, i.e. {prefix[:-4]}")
        for ext, ok in have.items():
            if not ok:
                weight = " (a weight? --data-path takes 'WEIGHT PREFIX' pairs)" if re.fullmatch(
                    r"[\d.eE+-]+", prefix) else ""
                raise ValueError(f"{flag} {prefix}: {prefix}{ext} not found{weight}; {PREPROCESS}")
        try:
            ds = IndexedDataset(prefix, mmap=True)
        except Exception as e:     # noqa: BLE001  (a truncated or foreign .idx)
            raise ValueError(f"{flag} {prefix}: {prefix}.idx is not a Megatron index ({type(e).__name__}); "
                             f"{PREPROCESS}") from None
        size = os.path.getsize(prefix + ".bin")
        expected = int(ds.index.sequence_lengths.sum(dtype=numpy.int64)) * numpy.dtype(ds.index.dtype).itemsize
        if size != expected:
            raise ValueError(f"{flag} {prefix}: {prefix}.bin has {size} bytes, its .idx describes {expected}: "
                             f"the two files are from different runs; {PREPROCESS}")
        _check_split(args, flag, prefix, len(ds))
        if vocab is not None and numpy.iinfo(ds.index.dtype).max >= vocab:   # else the dtype bounds the ids
            top = _max_token(ds)
            largest, where = (top, prefix) if top > largest else (largest, where)
    if vocab is not None and largest >= vocab:
        model = f" --tokenizer-model {args.tokenizer_model}" if args.tokenizer_model else ""
        raise ValueError(f"{where}.bin holds token id {largest}, not below the vocab size {vocab} of "
                         f"--tokenizer-type {args.tokenizer_type}{model}: use the tokenizer the data was "
                         "preprocessed with (--tokenizer-model, or --vocab-size for NullTokenizer)")
