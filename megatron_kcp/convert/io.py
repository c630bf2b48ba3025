"""Checkpoint I/O: Hugging Face directories (config.json + safetensors, sharded or not) and Megatron
distributed checkpoints in the layout Megatron-LM's ``--load`` reads.

A Megatron directory written here holds ``latest_checkpointed_iteration.txt`` (``0``), ``iter_0000000/`` (a
megatron.core.dist_checkpointing checkpoint whose ``model`` key is ``model.sharded_state_dict()``; its common
state carries ``iteration``, ``checkpoint_version`` and minimal ``args`` that mark it as saved without optimizer
and RNG state), ``megatron_args.txt`` and ``hf/`` (the HF config and tokenizer files, and ``convert.json``:
the family and the HF tensor names and dtypes, which export writes back).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil

import torch

from megatron_kcp.convert.rules import ConvertError

HF_AUX = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
          "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
          "chat_template.json", "preprocessor_config.json", "tiktoken.model", "tokenization_kimi.py")
MANIFEST = "convert.json"
TRACKER = "latest_checkpointed_iteration.txt"
ITERATION_DIR = "iter_0000000"
SHARD_BYTES = 5 * 2**30


class HFCheckpoint:
    """The tensors of an HF checkpoint directory, read lazily with safetensors.

    Args:
        directory: holds config.json and model.safetensors, or shards listed in model.safetensors.index.json
            (or any *.safetensors files).
    """

    def __init__(self, directory: str):
        from safetensors import safe_open
        self.directory = directory
        path = os.path.join(directory, "config.json")
        if not os.path.isfile(path):
            raise ConvertError(f"{directory} has no config.json (not a Hugging Face checkpoint directory)")
        with open(path) as f:
            self.config = json.load(f)
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        else:
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise ConvertError(f"{directory} has no *.safetensors files")
        self.where: dict[str, object] = {}
        for name in files:
            handle = safe_open(os.path.join(directory, name), "pt")
            for key in handle.keys():
                self.where[key] = handle

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def write_hf(directory: str, tensors: dict[str, torch.Tensor], shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write ``tensors`` as ``model.safetensors`` or, above ``shard_bytes``, as shards with an index.

    Returns:
        The files written.
    """
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    shards, size = [[]], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, names in zip(files, shards):
        save_file({n: tensors[n].contiguous() for n in names}, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def copy_aux(source: str, target: str, skip=()) -> None:
    """Copy the HF config, generation config and tokenizer files that exist in ``source`` to ``target``."""
    os.makedirs(target, exist_ok=True)
    for name in HF_AUX:
        if name not in skip and os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))


def write_manifest(directory: str, manifest: dict) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise ConvertError(f"{directory} has no {MANIFEST}: export needs the hf/ folder that `python -m "
                           "megatron_kcp.convert import` wrote (pass it with --hf-dir)")
    with open(path) as f:
        return json.load(f)


def save_megatron(model, directory: str) -> str:
    """Save ``model.sharded_state_dict()`` as Megatron-LM's iteration-0 distributed checkpoint in ``directory``.

    Returns:
        The iteration directory.
    """
    from megatron.core import dist_checkpointing
    path = os.path.join(directory, ITERATION_DIR)
    if os.path.exists(path):
        raise ConvertError(f"{path} exists: convert into an empty directory")
    os.makedirs(path)
    # the minimal args Megatron-LM's load_checkpoint reads: TP/PP sizes, and no optimizer or RNG state to load
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, no_save_optim=True,
                              no_save_rng=True, ckpt_format="torch_dist")
    state = {"model": model.sharded_state_dict(), "iteration": 0, "checkpoint_version": 3.0, "args": args}
    dist_checkpointing.save(state, path)
    with open(os.path.join(directory, TRACKER), "w") as f:
        f.write("0")
    return path


def iteration_dir(directory: str) -> str:
    """The checkpoint folder ``latest_checkpointed_iteration.txt`` names in a Megatron save directory."""
    tracker = os.path.join(directory, TRACKER)
    if not os.path.isfile(tracker):
        raise ConvertError(f"{directory} has no {TRACKER} (not a Megatron checkpoint directory)")
    with open(tracker) as f:
        text = f.read().strip()
    return os.path.join(directory, "release" if text == "release" else f"iter_{int(text):07d}")


def load_megatron(model, directory: str) -> None:
    """Load the model state of the Megatron checkpoint in ``directory`` into ``model`` (any TP/PP/CP)."""
    from megatron.core import dist_checkpointing
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iteration_dir(directory))
    missing, _ = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ConvertError(f"the checkpoint in {directory} has no {missing[0]} for this model")
