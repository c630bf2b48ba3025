"""A real tokenizer and a real Megatron indexed dataset, built locally (no downloads), for tests.

    tok = build_tokenizer_dir(tmp / "tok")               # BPE, Hugging Face format, eos <|endoftext|>
    prefix = build_indexed_dataset(tmp / "docs", tok, num_docs=40)   # docs.bin + docs.idx
    python -m megatron_kcp.train ... --data-path PREFIX --split 98,1,1 \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model TOK_DIR

The tokenizer is trained with the ``tokenizers`` package on seeded pseudo-English; Megatron's
``HuggingFaceTokenizer`` loads it through ``transformers`` (``.eod`` is the id of ``EOD_TOKEN``).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

EOD_TOKEN = "<|endoftext|>"
WORDS = ("the a of to and in is it that for on with as was at by from this be or are not have an they "
         "which one you were her all she there would their we him been has when who will more no if out so "
         "said what up its about into than them can only other new some could time these two may then do "
         "first any my now such like our over man me even most made after also did many before must through "
         "back years where much your way well down should because each just those people how too little state "
         "good very make world still own see men work long get here between both life being under never day "
         "same another know while last might us great old year off come since against go came right used take "
         "three parallel context linear attention gated delta kernel chunk state memory token layer").split()


def pseudo_english(num_sentences: int, seed: int = 0) -> list[str]:
    """Deterministic sentences of 4-16 words drawn from :data:`WORDS`.

    Args:
        num_sentences: how many sentences.
        seed: seed of the word draws.

    Returns:
        The sentences, each capitalised and ending in a period.
    """
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 16))).capitalize() + "." for _ in range(num_sentences)]


def build_tokenizer_dir(path, vocab_size: int = 384, seed: int = 0) -> Path:
    """Train a byte-level BPE tokenizer on :func:`pseudo_english` and save it as a Hugging Face
    tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``, eos :data:`EOD_TOKEN`, id 0).

    Args:
        path: the directory to write (created if missing).
        vocab_size: the BPE vocabulary size (> 257: 256 bytes + the eos token + merges).
        seed: seed of the training text.

    Returns:
        The directory, for ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(pseudo_english(2000, seed), trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN,
        "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}, indent=1))
    return path


def build_indexed_dataset(prefix, tokenizer_dir, num_docs: int, lengths=None, seed: int = 0) -> str:
    """Write ``PREFIX.bin``/``PREFIX.idx`` with megatron-core's ``IndexedDatasetBuilder``: ``num_docs``
    documents of tokenized :func:`pseudo_english`, document ``i`` of ``lengths[i]`` tokens, its last
    token the tokenizer's EOD (as Megatron's ``tools/preprocess_data.py --append-eod`` writes them).

    Args:
        prefix: the path prefix of the two files.
        tokenizer_dir: a directory from :func:`build_tokenizer_dir`.
        num_docs: the number of documents.
        lengths: token counts of the documents, EOD included (default: varied odd counts in 3..99).
        seed: seed of the text and of the default lengths.

    Returns:
        The prefix, as a string, for ``--data-path``.
    """
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer
    rng = random.Random(seed)
    lengths = list(lengths) if lengths is not None else [2 * rng.randint(1, 49) + 1 for _ in range(num_docs)]
    if len(lengths) != num_docs or min(lengths) < 1:
        raise ValueError(f"lengths: {num_docs} positive token counts expected, got {lengths}")
    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    eod = tok.token_to_id(EOD_TOKEN)
    prefix = str(prefix)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(tok.get_vocab_size()))
    for i, n in enumerate(lengths):
        ids = []
        while len(ids) < n - 1:
            ids += tok.encode(" ".join(pseudo_english(8, seed * 1_000_003 + i * 101 + len(ids)))).ids
        builder.add_document(torch.tensor(ids[:n - 1] + [eod], dtype=torch.int64), [n])
    builder.finalize(prefix + ".idx")
    return prefix
