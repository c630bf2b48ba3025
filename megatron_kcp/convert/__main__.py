"""``python -m megatron_kcp.convert import HF_DIR OUT_DIR`` / ``... export MEGATRON_DIR HF_OUT``.

    python -m megatron_kcp.convert import Qwen3-Next-80B-A3B ckpt/qwen3-next [--drop-mtp]
    torchrun ... -m megatron_kcp.train $(cat ckpt/qwen3-next/megatron_args.txt) --load ckpt/qwen3-next \\
        --finetune ...
    python -m megatron_kcp.convert export ckpt/qwen3-next hf/qwen3-next   # or a later --save directory,
                                                                          # with --hf-dir ckpt/qwen3-next/hf
Errors are one line naming the tensor, config field or architecture at fault (exit status 2).
"""
from __future__ import annotations

import argparse
import shlex
import sys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_kcp.convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face checkpoint -> Megatron distributed checkpoint")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    imp.add_argument("--drop-mtp", action="store_true", help="leave the multi-token-prediction weights (mtp.*) out")
    imp.add_argument("--drop-vision", action="store_true", help="leave a vision tower (model.visual.*) out")
    imp.add_argument("--mtp-num-layers", type=int, default=None,
                     help="map the MTP weights to megatron-core's MTP block (not supported by the KCP specs)")
    exp = sub.add_parser("export", help="Megatron checkpoint -> Hugging Face directory")
    exp.add_argument("megatron_dir")
    exp.add_argument("hf_out")
    exp.add_argument("--hf-dir", default=None, help="the hf/ folder the import wrote (default MEGATRON_DIR/hf)")
    return p


def main(argv=None) -> int:
    from megatron_kcp.convert import ConvertError, export_hf, import_hf
    args = parser().parse_args(argv)
    try:
        if args.command == "import":
            drop = [f for f, on in (("--drop-mtp", args.drop_mtp), ("--drop-vision", args.drop_vision)) if on]
            flags = import_hf(args.hf_dir, args.out_dir, drop=drop, mtp_num_layers=args.mtp_num_layers)
            print(shlex.join(flags))      # as megatron_args.txt holds them
        else:
            files = export_hf(args.megatron_dir, args.hf_out, hf_dir=args.hf_dir)
            print(f"wrote {', '.join(files)} to {args.hf_out}")
    except ConvertError as e:
        print(f"megatron_kcp.convert: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
