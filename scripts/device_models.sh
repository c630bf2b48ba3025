#!/usr/bin/env bash
# The released models' features on one GPU, from the repo root (what tests/ cannot run on the CPU):
#   bash scripts/device_models.sh [STAGE...]            (default: train convert layer)
#   train    pretrain_gpt.py (.mlm/ or MEGATRON_LM) and megatron_kcp.train at CP = 1 on an indexed dataset the test
#            builds: the tiny Qwen3-Next and Kimi Linear presets (MoE) and the dense toys; the loss falls
#                                                                                        $OUT/train_gpu.txt
#   convert  tiny Hugging Face models converted by megatron_kcp.convert: logits of the Megatron model against
#            transformers' on the GPU, bf16, within bf16's bounds                         $OUT/convert_gpu.txt
#   layer    benchmarks/mixer_cp1.py --layer: a Qwen3-Next-shaped hybrid layer with 512 experts, ours beside
#            the same layer with megatron-core's GatedDeltaNet, CP = 1 (full autotuning)   $OUT/layer_cp1.csv
# Needs the device bundle (fla-core 0.6.0, megatron-core 0.19.x, tilelang, flash-qla). KCP_STAGE_LIMIT: seconds a
# stage (default 500).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export OUT="${OUT:-/tmp/out}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
limit="${KCP_STAGE_LIMIT:-500}"
mkdir -p "$OUT"
stage() {   # name, command...: the stage under its time limit, its output in $OUT/name.txt
  local name=$1; shift
  (timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt") || echo "$name: exit $?" | tee -a "$OUT/$name.txt"
}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(train convert layer)
for s in "${stages[@]}"; do
    case "$s" in
      train|convert)
        (export KCP_FAST_AUTOTUNE=1; source scripts/device_cache.sh
         if [ "$s" = train ]; then
           stage train_gpu python -m pytest -q -p no:cacheprovider -s tests/test_train_data_cuda.py
         else
           stage convert_gpu python -m pytest -q -p no:cacheprovider -s tests/convert -m gpu
         fi
         save_cache) ;;
      layer)
        (unset KCP_FAST_AUTOTUNE; source scripts/device_cache.sh
         stage layer_cp1 python -m benchmarks run mixer-cp1 --layer --tokens 32768 --heads 32 --experts 512 --topk 10 \
           --moe-ffn 512 --iters 10 --warmup 3 --csv "$OUT/layer_cp1.csv"
         save_cache) ;;
      *) echo "unknown stage $s: train, convert or layer" >&2; exit 2 ;;
    esac
done
