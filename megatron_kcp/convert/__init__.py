"""Hugging Face checkpoints in and out of Megatron: ``python -m megatron_kcp.convert import|export``.

:func:`import_hf` reads an HF checkpoint directory, builds the Megatron GPTModel of the KCP spec for it
(``gdn_hybrid_layer_spec`` for Qwen3-Next and Qwen3.5, ``kda_hybrid_layer_spec`` for Kimi Linear) at
TP = PP = 1 on the CPU, fills ``model.state_dict()`` from the HF tensors through the family's rules and saves
``model.sharded_state_dict()`` as a distributed checkpoint, which any TP/PP/EP/CP size loads.
:func:`export_hf` loads such a checkpoint at TP = PP = 1 and writes the HF directory back, with the HF tensor
names and dtypes the import recorded; HF -> Megatron -> HF is bit-exact (the Megatron checkpoint is fp32).

The families live one per module (``qwen3_next``, ``qwen3_5``, ``kimi_linear``) in the registry of
:mod:`megatron_kcp.convert.base`; transformers is not needed (config.json is read as JSON, tensors with
safetensors).
"""
from __future__ import annotations

import os
import shlex

import torch

from megatron_kcp.convert import kimi_linear, qwen3_5, qwen3_next  # noqa: F401 (registers the families)
from megatron_kcp.convert import io
from megatron_kcp.convert.base import FAMILIES, Family, ModelSpec, family_for, supported  # noqa: F401
from megatron_kcp.convert.rules import ConvertError

SKIPPED = ("_extra_state",)         # state-dict entries that are not weights (TE's FP8 metadata)


def dropped_names(family: Family, names, drop=()) -> list[str]:
    """The HF tensors left out: those under a prefix the family lets a flag drop (MTP, vision tower), when
    that flag is in ``drop``; present without it they are a ConvertError naming the flag."""
    out = []
    for prefix, flag in family.droppable.items():
        hit = [n for n in names if n.startswith(prefix)]
        if hit and flag not in drop:
            raise ConvertError(f"unexpected tensors: {len(hit)} under {prefix} ({hit[0]}, ...), which the KCP model "
                               f"has no place for; pass {flag} to leave them out")
        out += hit
    return out


def fill_state(model, family: Family, rules, get, names) -> dict:
    """Megatron tensors from the HF ones.

    Args:
        model: the Megatron model (TP = PP = 1).
        family: its family (for messages).
        rules: the family's rules.
        get: HF name -> tensor.
        names: the HF names to map (all must be used).

    Returns:
        Megatron state dict (every weight of ``model.state_dict()``).
    """
    targets = {k: v for k, v in model.state_dict().items() if not k.endswith(SKIPPED)}
    names, used, state = set(names), set(), {}
    for rule in rules:
        for name in rule.hf_names:
            if name not in names:
                raise ConvertError(f"missing tensor: {name} (needed by {family.name}'s {', '.join(rule.megatron)})")
        for m in rule.megatron:
            if m not in targets:
                raise ConvertError(f"the Megatron model has no {m} (mapped from {', '.join(rule.hf_names) or 'none'}):"
                                   f" megatron_kcp's spec and the {family.name} mapping disagree")
        state.update(rule.to_megatron({n: get(n) for n in rule.hf_names}, targets))
        used.update(rule.hf_names)
    extra = sorted(names - used)
    if extra:
        raise ConvertError(f"unexpected tensor: {extra[0]} (no {family.name} mapping takes it"
                           f"{f'; {len(extra) - 1} more' if len(extra) > 1 else ''})")
    unset = sorted(set(targets) - set(state))
    if unset:
        raise ConvertError(f"the Megatron model's {unset[0]} has no HF source in the {family.name} mapping")
    return state


def _tied_head(family: Family, spec: ModelSpec, names, get) -> bool:
    """Whether the checkpoint stores lm_head.weight although the embeddings are tied (it must equal them)."""
    if not spec.gpt.get("share_embeddings_and_output_weights") or "lm_head.weight" not in names:
        return False
    embed = next(n for n in names if n.endswith("embed_tokens.weight"))
    if not torch.equal(get("lm_head.weight"), get(embed)):
        raise ConvertError(f"unexpected tensor: lm_head.weight differs from {embed} although {family.name}'s config "
                           "ties them (tie_word_embeddings)")
    return True


def import_hf(hf_dir: str, out_dir: str, drop=(), mtp_num_layers: int | None = None) -> list[str]:
    """HF checkpoint directory -> Megatron distributed checkpoint (see the module docstring).

    Args:
        hf_dir: the HF directory.
        out_dir: the Megatron directory to write (must not hold a checkpoint).
        drop: flags that leave tensor groups out ("--drop-mtp", "--drop-vision").
        mtp_num_layers: MTP layers to map (the KCP specs have no MTP block: refused).

    Returns:
        The Megatron-LM flags that build the model (also written to ``out_dir/megatron_args.txt``).
    """
    from megatron_kcp.convert.model import build_model, single_rank_world
    ckpt = io.HFCheckpoint(hf_dir)
    family = family_for(ckpt.config)
    if mtp_num_layers:
        raise ConvertError(f"--mtp-num-layers {mtp_num_layers}: the converter does not map MTP weights yet "
                           "(Megatron builds the MTP block from megatron-core's own GPT layer spec); leave them out "
                           "with --drop-mtp")
    names = ckpt.names
    dropped = set(dropped_names(family, names, drop))
    names = [n for n in names if n not in dropped]
    spec = family.model_spec({})
    tied_head = _tied_head(family, spec, names, ckpt.get)
    mapped = [n for n in names if not (tied_head and n == "lm_head.weight")]
    rules = family.rules({"names": mapped})
    with single_rank_world():
        model = build_model(spec)
        state = fill_state(model, family, rules, ckpt.get, mapped)
        missing, _ = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith(SKIPPED)]
        if missing:
            raise ConvertError(f"the Megatron model's {missing[0]} was not filled")
        os.makedirs(out_dir, exist_ok=True)
        io.save_megatron(model, out_dir)
    hf_copy = os.path.join(out_dir, "hf")
    io.copy_aux(hf_dir, hf_copy)
    io.write_manifest(hf_copy, {"family": family.name, "tensors": {n: io.dtype_name(ckpt.get(n).dtype) for n in names},
                                "tied_lm_head": tied_head, "dropped": sorted(dropped), "spec": spec.spec})
    with open(os.path.join(out_dir, "megatron_args.txt"), "w") as f:
        f.write(shlex.join(spec.flags) + "\n")
    return spec.flags


def export_hf(megatron_dir: str, hf_out: str, hf_dir: str | None = None) -> list[str]:
    """Megatron checkpoint -> HF directory (config.json, tokenizer files, safetensors).

    Args:
        megatron_dir: a directory ``import_hf`` wrote, or a Megatron-LM save directory of the same model.
        hf_out: the HF directory to write.
        hf_dir: the ``hf/`` folder ``import_hf`` wrote (default ``megatron_dir/hf``).

    Returns:
        The safetensors files written.
    """
    from megatron_kcp.convert.model import build_model, single_rank_world
    hf_dir = hf_dir or os.path.join(megatron_dir, "hf")
    manifest = io.read_manifest(hf_dir)
    import json
    with open(os.path.join(hf_dir, "config.json")) as f:
        family = family_for(json.load(f))
    spec = family.model_spec({})
    dtypes = {n: io.to_dtype(d) for n, d in manifest["tensors"].items()}
    mapped = [n for n in dtypes if not (manifest.get("tied_lm_head") and n == "lm_head.weight")]
    rules = family.rules({"names": mapped})
    with single_rank_world():
        model = build_model(spec)
        io.load_megatron(model, megatron_dir)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not k.endswith(SKIPPED)}
    tensors = {}
    for rule in rules:
        tensors.update(rule.to_hf(state, dtypes))
    if manifest.get("tied_lm_head"):
        embed = next(n for n in tensors if n.endswith("embed_tokens.weight"))
        tensors["lm_head.weight"] = tensors[embed].clone()
    ordered = {n: tensors[n] for n in manifest["tensors"] if n in tensors}
    files = io.write_hf(hf_out, ordered)
    io.copy_aux(hf_dir, hf_out)
    return files
