"""Build, check and run the torchrun command that trains a preset.

    python -m megatron_kcp.launch configs/tiny-gdn.json --nproc-per-node 4 --cp 4 -- --train-iters 100
    python -m megatron_kcp.launch configs/qwen3-next-gdn.json --nnodes 2 --nproc-per-node 8 --tp 2 --cp 8 \\
        --master-addr node0 --node-rank 0 --megatron-lm ~/Megatron-LM -- --train-iters 100

The trainer is ``megatron_kcp.train`` (pip-installed megatron-core only), or Megatron-LM's
``pretrain_gpt.py`` with ``--megatron-lm DIR``. Inconsistent sizes (world size, heads, sequence
length) fail here, before any process starts. Arguments after ``--`` go to the trainer unchanged;
the command trains on mock data unless they name data (``-- --data-path PREFIX --split 98,1,1
--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``, a Megatron indexed dataset).

A preset (configs/*.json) is a JSON object of Megatron's model sizes under their argument names
(:data:`MODEL_KEYS`, positive integers; ``linear_attention_freq`` N >= 1 or a 0/1 list of
``num_layers`` entries), ``spec`` (a name of :mod:`megatron_kcp.spec`, default
``gdn_hybrid_layer_spec``; options allowed for the KDA spec: ``kda_hybrid_layer_spec:kda_gate_rank=64``)
and ``_doc`` (a description). :func:`load_preset` checks them all.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from megatron_kcp import split_spec_name
from megatron_kcp.data import default_data_args
from megatron_kcp.environment import no_te_args
from megatron_kcp.sizes import check_head_dims, check_split

MODEL_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
              "kv_channels", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
              "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "seq_length", "vocab_size")
OTHER_KEYS = ("spec", "_doc")        # the layer spec (--spec megatron_kcp NAME), and a free-text description
ALLOWED_KEYS = MODEL_KEYS + OTHER_KEYS
DEFAULT_SPEC = "gdn_hybrid_layer_spec"


# what the size checks and the command need; the rest falls back to Megatron's defaults
REQUIRED_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "seq_length", "vocab_size")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load_preset(path: str | Path) -> dict:
    """The preset's model sizes; ValueError naming the file and the fix if it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        shipped = sorted(p.name for p in CONFIGS.glob("*.json"))
        raise ValueError(f"preset {path}: no such file; give the path of a JSON preset"
                         + (f", e.g. one of configs/{{{','.join(shipped)}}}" if shipped else ""))
    try:
        preset = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"preset {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): "
                         "fix the file (configs/tiny-gdn.json shows the format)") from None
    if not isinstance(preset, dict):
        raise ValueError(f"preset {path}: must be a JSON object of model sizes, e.g. {{\"num_layers\": 4, ...}}")
    unknown = [k for k in preset if k not in ALLOWED_KEYS]
    if unknown:
        raise ValueError(f"preset {path}: unknown keys {unknown}; the allowed keys are {', '.join(ALLOWED_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in preset]
    if missing:
        raise ValueError(f"preset {path}: missing keys {missing}; add them (configs/tiny-gdn.json has every key)")
    check_preset_values(preset, f"preset {path}")
    return preset


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_preset_values(preset: dict, where: str) -> None:
    """Every size a positive integer, ``linear_attention_freq`` N >= 1 or a 0/1 list of ``num_layers``
    entries, ``spec`` a spec name of :mod:`megatron_kcp.spec` (options for the KDA spec);
    ValueError starting with ``where`` and naming the fix otherwise."""
    for key in MODEL_KEYS:
        value = preset.get(key)
        if key == "linear_attention_freq" or key not in preset:
            continue
        if not _is_int(value) or value < 1:
            raise ValueError(f"{where}: \"{key}\": {json.dumps(value)} is not a positive integer; "
                             f"write a whole number >= 1, e.g. \"{key}\": 4")
    if "linear_attention_freq" in preset:
        freq, layers = preset["linear_attention_freq"], preset["num_layers"]
        pattern_ok = (isinstance(freq, list) and len(freq) == layers
                      and all(_is_int(x) and x in (0, 1) for x in freq))
        if not (_is_int(freq) and freq >= 1 or pattern_ok):
            raise ValueError(f"{where}: \"linear_attention_freq\": {json.dumps(freq)} is neither an integer N >= 1 "
                             f"(every Nth layer is softmax attention) nor a list of num_layers={layers} entries of "
                             "1 (linear) or 0 (softmax attention)")
    if "_doc" in preset and not isinstance(preset["_doc"], str):
        raise ValueError(f"{where}: \"_doc\" must be a string (a description of the preset)")
    if "spec" in preset:
        check_spec_name(preset["spec"], where)


def check_spec_name(name, where: str) -> None:
    """``name`` is one of :data:`megatron_kcp.SPEC_NAMES`, with options only for the KDA spec
    (``kda_hybrid_layer_spec:kda_gate_rank=64``), which are checked by building that spec (importing
    megatron-core; a plain name does not)."""
    if not isinstance(name, str):
        raise ValueError(f"{where}: \"spec\": {json.dumps(name)} is not a string; write a spec name, "
                         f"e.g. \"spec\": \"{DEFAULT_SPEC}\"")
    where = f"{where}: \"spec\": {json.dumps(name)}"
    if split_spec_name(name, where)[1]:       # the options are the KDA mixer's: their check imports megatron-core
        from megatron_kcp.spec import spec_from_name
        spec_from_name(name, where)


def check_sizes(p: dict, world: int, tp: int, cp: int, pp: int, sequence_parallel: bool) -> int:
    """Data-parallel size for this layout; ValueError naming the fix otherwise."""
    if world % (tp * cp * pp):
        raise ValueError(f"world size {world} is not a multiple of TP*CP*PP = {tp}*{cp}*{pp}: change "
                         "--nproc-per-node/--nnodes or the parallel sizes")
    check_head_dims(p)
    if p["num_layers"] % pp:
        raise ValueError(f"num_layers={p['num_layers']} is not divisible by --pp {pp}")
    check_split(p, tp, cp, sequence_parallel)
    return world // (tp * cp * pp)


def megatron_args(p: dict, tp: int, cp: int, pp: int, sequence_parallel: bool, extra=()) -> list[str]:
    """The trainer's arguments for preset ``p`` and this layout; mock data and NullTokenizer unless the
    trainer's own arguments ``extra`` name data (--data-path ...) or a tokenizer (:func:`default_data_args`)."""
    args = ["--spec", "megatron_kcp", p.get("spec", DEFAULT_SPEC)]
    for key in MODEL_KEYS:
        if key in p and key not in ("vocab_size",):
            args += [f"--{key.replace('_', '-')}", str(p[key])]
    if "num_query_groups" in p:
        args.append("--group-query-attention")
    args += ["--max-position-embeddings", str(p["seq_length"]), "--vocab-size", str(p["vocab_size"]),
             "--tensor-model-parallel-size", str(tp), "--context-parallel-size", str(cp),
             "--pipeline-model-parallel-size", str(pp),
             "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--bf16", *default_data_args(extra),
             "--micro-batch-size", "1", "--lr", "3e-4", "--min-lr", "3e-5",
             "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1",
             "--attention-dropout", "0", "--hidden-dropout", "0", "--eval-iters", "0", "--eval-interval", "1000",
             # the specs' attention is causal by construction and never reads the dataloader's s x s mask,
             # which at 1M tokens would be a terabyte per sample
             "--no-create-attention-mask-in-dataloader"]
    if sequence_parallel and tp > 1:
        args.append("--sequence-parallel")
    return args


def build_command(a) -> list[str]:
    preset = load_preset(a.preset)
    world = a.nnodes * a.nproc_per_node
    dp = check_sizes(preset, world, a.tp, a.cp, a.pp, a.sequence_parallel)
    trainer = ([str(Path(a.megatron_lm).expanduser() / "pretrain_gpt.py")] if a.megatron_lm
               else ["-m", "megatron_kcp.train"])
    run = ["torchrun", f"--nnodes={a.nnodes}", f"--nproc-per-node={a.nproc_per_node}"]
    if a.nnodes == 1:
        run.append(f"--master-port={a.master_port}")
    else:
        if not a.master_addr:
            raise ValueError("multi-node runs need --master-addr (or MASTER_ADDR) of the rank-0 node")
        if not 0 <= a.node_rank < a.nnodes:
            raise ValueError(f"--node-rank {a.node_rank} is outside 0..{a.nnodes - 1} (--nnodes {a.nnodes})")
        run += [f"--node-rank={a.node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint={a.master_addr}:{a.master_port}"]
    model = megatron_args(preset, a.tp, a.cp, a.pp, a.sequence_parallel, a.extra)
    if a.fp32:
        model.remove("--bf16")
    if a.megatron_lm:          # megatron_kcp.train adds these itself
        model += no_te_args(a.extra)
    cmd = run + trainer + model + a.extra
    if "--global-batch-size" not in a.extra:          # one micro batch of 1 per data-parallel rank
        cmd += ["--global-batch-size", str(dp)]
    return cmd


def parser():
    p = argparse.ArgumentParser(prog="python -m megatron_kcp.launch", description=__doc__.splitlines()[0],
                                epilog="Arguments after -- go to the trainer.")
    p.add_argument("preset", help="a JSON preset from configs/")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 (exact parity checks)")
    p.add_argument("--nnodes", type=int, default=int(os.environ.get("SLURM_NNODES", 1)))
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=int(os.environ.get("SLURM_NODEID", 0)))
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR"))
    p.add_argument("--master-port", type=int, default=int(os.environ.get("MASTER_PORT", 29500)))
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"),
                   help="train with this Megatron-LM checkout's pretrain_gpt.py (default: megatron_kcp.train)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)      # the rest goes to pretrain_gpt.py
    a = parser().parse_args(argv[:cut])
    a.extra = argv[cut + 1:]
    for name in ("tp", "cp", "pp", "nnodes", "nproc_per_node"):
        if getattr(a, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        cmd = build_command(a)
    except ValueError as e:
        parser().error(str(e))
    if a.dry_run:
        print(shlex.join(cmd))
        return 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if shutil.which("torchrun") is None:          # torch installed without its console scripts on PATH
        cmd[:1] = [sys.executable, "-m", "torch.distributed.run"]
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
