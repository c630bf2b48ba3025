#!/usr/bin/env bash
# The main job. With GPUs: the tiny GDN and then KDA hybrid trained with megatron_kcp.train on
# Megatron's mock data, CP = every GPU of this machine, a progress line per step (loss, tokens/s,
# peak memory). Without: the CPU demonstration (a tiny GDN and KDA LM trained with KCP over 2 gloo
# ranks, loss per step beside the CP=1 run). Arguments go to the trainer (GPU) or to
# `python -m megatron_kcp.demo` (CPU). STEPS=N sets the number of training steps of either run
# (GPU: --train-iters, default 20; CPU: the demo's --steps, default 5).
source "$(dirname "$0")/env.sh"
export PYTHONWARNINGS=ignore
gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -gt 0 ]; then
  for model in gdn kda; do
    python -m megatron_kcp.launch "configs/tiny-$model.json" --nproc-per-node "$gpus" --cp "$gpus" -- \
      --train-iters "${STEPS:-20}" --lr-decay-iters "${STEPS:-20}" "$@" 2>&1 | grep --line-buffered -E "\[kcp\]|Error|error:"
  done
else
  python -m megatron_kcp.demo --model gdn --steps "${STEPS:-5}" "$@"
  python -m megatron_kcp.demo --model kda --steps "${STEPS:-5}" "$@"
fi
