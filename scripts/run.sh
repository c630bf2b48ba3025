#!/usr/bin/env bash
# The main job. Today: the CPU demonstration (a tiny GDN and KDA LM trained with KCP over 2 gloo
# ranks, loss per step beside the CP=1 run). Arguments go to `python -m megatron_kcp.demo`.
source "$(dirname "$0")/env.sh"
export PYTHONWARNINGS=ignore
python -m megatron_kcp.demo --model gdn "$@"
python -m megatron_kcp.demo --model kda "$@"
