#!/usr/bin/env bash
# Train a preset on this node's GPUs (one torchrun, --nnodes 1, every GPU unless NPROC_PER_NODE is set) through
# `python -m megatron_kcp.launch`, which checks the sizes before anything starts. The trainer is
# megatron_kcp.train (the pip-installed megatron-core), or Megatron-LM's pretrain_gpt.py with the KCP
# spec when MEGATRON_LM names a Megatron-LM checkout (or with --megatron-lm DIR).
#   scripts/train_single_node.sh configs/tiny-gdn.json --cp 4 [-- trainer args]
#   MEGATRON_LM=~/Megatron-LM scripts/train_single_node.sh configs/tiny-gdn.json --cp 4 [-- pretrain_gpt args]
# --dry-run prints the torchrun command instead of running it; --help lists the launcher's options.
usage="usage: scripts/train_single_node.sh PRESET.json [launcher options, e.g. --cp 4 --dry-run] [-- trainer args]"
if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "$usage" >&2
  echo "presets: $(cd "$(dirname "$0")/../configs" 2>/dev/null && ls -- *.json 2>/dev/null | tr '\n' ' ')" >&2
  exit 2
fi
preset="$1"
if [ -f "$preset" ]; then preset="$(cd "$(dirname "$preset")" && pwd)/$(basename "$preset")"; fi   # env.sh cd's to the checkout
source "$(dirname "$0")/env.sh"
gpus=$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')
exec python -m megatron_kcp.launch "$preset" --nnodes 1 --nproc-per-node "${NPROC_PER_NODE:-$gpus}" "${@:2}"
