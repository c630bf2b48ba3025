#!/usr/bin/env bash
# Train a preset on this node's GPUs with Megatron-LM's pretrain_gpt.py and the KCP spec.
#   MEGATRON_LM=~/Megatron-LM scripts/train_single_node.sh configs/tiny-gdn.json --cp 4 [-- pretrain_gpt args]
# Sizes are checked before anything starts; --dry-run prints the torchrun command.
source "$(dirname "$0")/env.sh"
gpus=$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')
exec python -m megatron_kcp.launch "$1" --nproc-per-node "${NPROC_PER_NODE:-$gpus}" "${@:2}"
