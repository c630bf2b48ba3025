"""Train a GPT with the KCP layer specs using only the pip-installed megatron-core.

    torchrun --nproc-per-node 4 -m megatron_kcp.train --spec megatron_kcp.spec gdn_hybrid_layer_spec \\
        --context-parallel-size 4 --mock-data ... (Megatron's usual arguments)

This is Megatron-LM's ``pretrain_gpt.py`` reduced to what a GPT needs (``megatron.training`` ships
in the megatron-core wheel), plus the plugin's own command-line options (:func:`add_kcp_args`),
checked at startup with the layout rules of KCP (:func:`validate_kcp_args`), and one progress line
per step (loss, tokens/s, peak memory; ``--kcp-log FILE`` also writes them as JSON lines).
``--spec megatron_kcp`` (one token) means the default hybrid spec, as with the patched Megatron-LM.
``megatron_kcp.launch`` builds the command from a preset.
"""
from __future__ import annotations

import json
import os
import sys
import time
from functools import partial

import torch

from megatron_kcp.spec_names import SPEC_NAMES
from megatron_kcp.environment import no_te_args, te_available
from megatron_kcp.sizes import check_head_dims, check_split
from megatron_kcp.spec import spec_from_name
from megatron_kcp.wheel import skip_make_of_prebuilt_dataset_helpers


def add_kcp_args(parser):
    """Megatron ``extra_args_provider``: the plugin's options."""
    g = parser.add_argument_group("megatron_kcp")
    g.add_argument("--kda-gate-rank", type=int, default=None,
                   help="KDA: rank of the low-rank forget/output gate projections (default: value head dim)")
    g.add_argument("--kda-norm-eps", type=float, default=None,
                   help="KDA: epsilon of the gated output RMSNorm (default 1e-5)")
    g.add_argument("--kcp-log", default=None, help="also write the per-step progress as JSON lines to this file")
    escape_unformattable_help(parser)
    return parser


def escape_unformattable_help(parser):
    """Escapes the ``%`` of every help text argparse cannot format (megatron-core 0.19.2's
    ``--moe-paged-stash-buffer-size-factor-cuda`` has a bare ``10%)``), so that ``--help`` prints
    instead of stopping on a ValueError; help that formats is left as it is."""
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                action.help % {**vars(action), "prog": parser.prog, "default": action.default}
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def normalize_spec(spec):
    """``--spec megatron_kcp`` -> the package's default spec; None -> the GDN hybrid."""
    if not spec:
        return ["megatron_kcp.spec", "gdn_hybrid_layer_spec"]
    if list(spec) == ["megatron_kcp"]:
        return ["megatron_kcp.spec", "default_spec"]
    return list(spec)


def validate_kcp_args(args):
    """Checks Megatron's own validation does not make; raises ValueError naming the fix."""
    spec = args.spec
    base, _, spec_options = spec[-1].partition(":")
    if len(spec) != 2 or spec[0] not in ("megatron_kcp", "megatron_kcp.spec") or base not in SPEC_NAMES:
        raise ValueError(f"--spec {' '.join(spec)}: megatron_kcp.train builds the KCP hybrids only; use "
                         f"--spec megatron_kcp {{{','.join(SPEC_NAMES)}}} (or pretrain_gpt.py for others)")
    if spec_options:                # both module paths take options (megatron_kcp.spec_from_name)
        spec_from_name(spec[-1], where=f"--spec {' '.join(spec)}")
        if args.kda_gate_rank is not None or args.kda_norm_eps is not None:
            raise ValueError(f"--spec {' '.join(spec)} sets KDA options: drop --kda-gate-rank/--kda-norm-eps "
                             "(or the options in the spec name)")
    if getattr(args, "experimental_attention_variant", None):
        raise ValueError("--experimental-attention-variant selects megatron-core's own cp2hp mixer; "
                         "drop it, the KCP spec provides the linear mixers")
    for flag in ("sft", "fim_data"):
        if getattr(args, flag, False):
            raise ValueError(f"--{flag.replace('_', '-')}: megatron_kcp.train trains on pretraining documents "
                             "(GPTDataset); for SFT/FIM data use Megatron-LM's pretrain_gpt.py with the KCP spec")
    if getattr(args, "reset_attention_mask", False):     # an s x s mask per sample, which no KCP layer reads
        raise ValueError("--reset-attention-mask: the KCP layers take document boundaries as cu_seqlens, "
                         "not as a mask: use --dataloader-inter-document-masking instead")
    if args.save and args.save_interval is None:     # Megatron would stop on a bare assert
        raise ValueError("--save needs --save-interval N (steps between checkpoints)")
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    sizes = {**vars(args), "num_query_groups": args.num_query_groups if args.group_query_attention else None}
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    check_split(sizes, tp, cp, args.sequence_parallel, name=flag, tp_flag="--tensor-model-parallel-size")
    check_head_dims(sizes, name=flag)
    is_kda = "kda" in base
    if not is_kda and (args.kda_gate_rank is not None or args.kda_norm_eps is not None):
        raise ValueError("--kda-gate-rank/--kda-norm-eps apply to the KDA spec only: use --spec megatron_kcp "
                         "kda_hybrid_layer_spec or drop them")
    if is_kda and args.kda_gate_rank is not None and (args.kda_gate_rank < 1 or args.kda_gate_rank % tp):
        raise ValueError(f"--kda-gate-rank {args.kda_gate_rank} must be a positive multiple of the TP size {tp}")
    if is_kda and args.kda_norm_eps is not None and not 0 < args.kda_norm_eps < float("inf"):
        raise ValueError(f"--kda-norm-eps {args.kda_norm_eps} must be a positive number")
    if cp > 1 and args.transformer_impl == "transformer_engine" and not te_available():
        raise ValueError("--transformer-impl transformer_engine but TransformerEngine is not importable: "
                         "install it or pass --transformer-impl local")


def read_args(argv=None):
    """Megatron's argument parser with the plugin's options, and the plugin's checks (before
    Megatron's own). Defaults for a run without TransformerEngine (local layers, no TE fusions),
    without the dataloader's attention mask, and, when no data is named, mock data (with
    NullTokenizer unless a tokenizer is named); real data (--data-path ...) is checked by
    :func:`megatron_kcp.data.check_data_args`."""
    from megatron.training import arguments

    from megatron_kcp.data import check_data_args, default_data_args
    argv = list(sys.argv[1:] if argv is None else argv)
    argv += no_te_args(argv)       # Megatron's defaults assume TE's fused kernels
    argv += default_data_args(argv)
    if "--no-create-attention-mask-in-dataloader" not in argv:     # s x s bytes per sample, read by no layer
        argv.append("--no-create-attention-mask-in-dataloader")    # of the KCP specs (causal by construction)
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]        # Megatron parses sys.argv
    try:
        args = arguments.parse_args(extra_args_provider=add_kcp_args)
    finally:
        sys.argv = saved
    if args.use_checkpoint_args or args.yaml_cfg:
        raise ValueError("--use-checkpoint-args / --yaml-cfg are not supported by megatron_kcp.train: pass the "
                         "model arguments on the command line (megatron_kcp.launch builds them from a preset)")
    args.spec = normalize_spec(args.spec)
    validate_kcp_args(args)
    check_data_args(args)
    return args


def parse_args(argv=None):
    """:func:`read_args`, then Megatron's validation; sets Megatron's global args."""
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_global_variables
    args = read_args(argv)
    validate_args(args)
    set_global_variables(args)
    return args


# ---- the GPT training step, as Megatron-LM's pretrain_gpt.py (core_r0.19.0) does it ----

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded",
              "max_seqlen")


def get_batch(data_iterator, vp_stage=None, layout=None):
    """This rank's micro batch, cut by megatron-core's own functions as pretrain_gpt.py cuts it: TP rank 0
    reads and broadcasts, a micro batch of documents (``--dataloader-inter-document-masking``) is flattened
    into one stream, and the CP cut is the whole-stream zigzag there (``use_per_sequence_balancing``), the
    per-row zigzag otherwise; the stage holding MTP (``--mtp-num-layers``) gets the tokens and labels too.
    ``vp_stage`` and ``layout`` (the config's pipeline layout) say where MTP is. Returns the batch dict
    (:data:`BATCH_KEYS`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.utils import (flatten_batch_for_packed_sequences, get_batch_on_this_cp_rank,
                                     get_batch_on_this_tp_rank)
    from megatron.training import get_args
    args = get_args()
    documents = args.dataloader_inter_document_masking
    first_or_last = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
    mtp = mtp_on_this_rank(layout=layout, mtp_num_layers=args.mtp_num_layers,
                           ignore_virtual=False, vp_stage=vp_stage)
    if not first_or_last and not mtp and not documents:
        return dict.fromkeys(BATCH_KEYS)
    batch = {}
    if ps.get_tensor_model_parallel_rank() == 0:
        sample = next(data_iterator)
        batch = {k: (sample[k].to(torch.cuda.current_device(), non_blocking=True) if sample.get(k) is not None
                     else None) for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=documents, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=ps.get_tensor_model_parallel_src_rank(),
        broadcast_group=ps.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=ps.get_tensor_model_parallel_rank(), micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length, mtp_on_this_rank=mtp,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=ps.is_pipeline_first_stage(), is_pipeline_last_stage=ps.is_pipeline_last_stage())
    batch = flatten_batch_for_packed_sequences(batch)
    if not first_or_last and not mtp:       # a middle stage needs the documents only
        return {k: batch.get(k) if k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen") else None
                for k in BATCH_KEYS}
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=ps.get_context_parallel_group(),
                                      use_per_sequence_balancing=documents)
    return {k: batch.get(k) for k in BATCH_KEYS}


def packed_seq_params(batch, seq_length: int):
    """The THD ``PackedSeqParams`` pretrain_gpt.py builds from a batch with documents (None without)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    cu, padded = batch["cu_seqlens"], batch["cu_seqlens_padded"]
    if cu is None:
        return None
    cu = cu.squeeze(0)
    padded = padded.squeeze(0) if padded is not None else None
    given = padded if padded is not None else cu
    max_seqlen = int(batch["max_seqlen"].max().item())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=given, cu_seqlens_kv=given, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
                           tokens_per_sample=seq_length)


def loss_func(loss_mask, output_tensor):
    """Sum of token losses and token count; Megatron divides by the count across DP x CP."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model, get_model_config
    from megatron.training import get_args
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"),
                      get_model_config(model).pipeline_model_parallel_layout)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params(batch, get_args().seq_length))
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's GPT datasets (mock with --mock-data, else the indexed datasets of --data-path ...),
    configured as pretrain_gpt.py's ``core_gpt_dataset_config_from_args``; with
    --dataloader-inter-document-masking every sample carries its document boundaries (cu_seqlens)."""
    from megatron.core import parallel_state as ps
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    sequences_per_dataset = None
    if args.per_dataset_sequences_path is not None:
        with open(args.per_dataset_sequences_path) as f:
            sequences_per_dataset = json.load(f)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens, fast_cache_load=args.dataloader_fast_cache_load,
        sequences_per_dataset=sequences_per_dataset, defer_npy_index_mmap=args.dataloader_defer_npy_index_mmap,
        context_parallel_size=args.context_parallel_size,
        inter_document_masking=args.dataloader_inter_document_masking)
    # TP rank 0 of every pipeline stage (get_batch reads there and broadcasts over TP; a middle stage reads
    # the document boundaries with --dataloader-inter-document-masking)
    built_here = lambda: ps.get_tensor_model_parallel_rank() == 0  # noqa: E731
    return BlendedMegatronDatasetBuilder(MockGPTDataset if args.mock_data else GPTDataset,
                                         train_val_test_num_samples, built_here, config).build()


datasets_provider.is_distributed = True      # every rank calls it (Megatron's convention)


# ---- progress line ----

class Progress:
    """Wraps Megatron's ``training_log``: after its own log, the last rank prints
    ``step | loss | tokens/s | peak memory`` for every step (and appends it to ``--kcp-log``)."""

    def __init__(self, training_log, args):
        self.log, self.args, self.t = training_log, args, time.perf_counter()

    def __call__(self, loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw):
        out = self.log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kw)
        now, dt = time.perf_counter(), time.perf_counter() - self.t
        self.t = now
        if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            loss = loss_dict.get("lm loss")
            if isinstance(loss, torch.Tensor):
                loss = (loss[0] / loss[1] if loss.numel() == 2 else loss).item()
            row = {"step": iteration, "loss": loss,
                   "tokens_per_s": self.args.global_batch_size * self.args.seq_length / dt,
                   "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0}
            print(f"[kcp] step {iteration:5d} | loss {loss:.6f} | {row['tokens_per_s']:,.0f} tokens/s | "
                  f"peak memory {row['peak_mem_gib']:.2f} GiB (rank {torch.distributed.get_rank()})", flush=True)
            if self.args.kcp_log:
                with open(self.args.kcp_log, "a") as f:
                    f.write(json.dumps(row) + "\n")
        return out


def model_config(args):
    """The GPT model config from the arguments (imports the spec). Its transformer config is a KDAConfig,
    TransformerConfig plus the KDA fields (--kda-*), which the GDN spec ignores."""
    from megatron.training.argument_utils import core_transformer_config_from_args, gpt_config_from_args

    from megatron_kcp.layers.kda import KDAConfig
    config = core_transformer_config_from_args(args, KDAConfig)
    config.kda_gate_rank, config.kda_norm_eps = args.kda_gate_rank, args.kda_norm_eps
    return gpt_config_from_args(args, config=config)


def main(argv=None):
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")   # Megatron's TP/CP overlap needs it; before CUDA starts
    try:
        args = parse_args(argv)
    except ValueError as e:
        sys.exit(f"megatron_kcp.train: {e}")
    container = pretrain_cfg_container_from_args(args, model_config(args))
    training.training_log = Progress(training.training_log, args)
    skip_make_of_prebuilt_dataset_helpers()
    training.pretrain(container, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
