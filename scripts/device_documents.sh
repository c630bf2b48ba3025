#!/usr/bin/env bash
# Documents as Megatron hands them, on one GPU, from the repo root (what tests/ cannot run on the CPU):
#   bash scripts/device_documents.sh [STAGE...]         (default: correctness train bench)
#   correctness  the mixers and the hybrid block on whole-stream-zigzag batches (--dataloader-inter-document-
#                masking), bf16, CP ranks over gloo, with the exchange-off controls  $OUT/layout_gpu.txt
#   train        pretrain_gpt.py (.mlm/ or MEGATRON_LM) and megatron_kcp.train on an indexed dataset the test
#                builds, CP = 1, --dataloader-inter-document-masking: the loss falls    $OUT/train_gpu.txt
#   bench        benchmarks/perdoc.py: 100 documents at 32k and 128k tokens in the whole-stream zigzag, the
#                per-document zigzag and the contiguous layout, op and mixer level, W = 2 predicted from this
#                GPU (full autotuning)                                                $OUT/layouts.csv
# Needs fla-core 0.6.0, megatron-core 0.19.x, tilelang on Hopper, flash-qla 0.1.3 (the device bundle). The
# correctness and train stages trim fla's autotuning (KCP_FAST_AUTOTUNE), the bench stage does not; each stage
# packs its tuning caches into $OUT (scripts/device_cache.sh). KCP_STAGE_LIMIT: seconds a stage (default 500).
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
[ ${#stages[@]} -gt 0 ] || stages=(correctness train bench)
for s in "${stages[@]}"; do
    case "$s" in
      correctness|train)
        (export KCP_FAST_AUTOTUNE=1; source scripts/device_cache.sh
         if [ "$s" = correctness ]; then
           stage layout_gpu python -m pytest -q -p no:cacheprovider -s tests/layers/test_layout.py -k whole_stream_layout_on_gpu
         else
           stage train_gpu python -m pytest -q -p no:cacheprovider -s tests/test_train_data_cuda.py
         fi
         save_cache) ;;
      bench)
        (unset KCP_FAST_AUTOTUNE; source scripts/device_cache.sh
         stage bench python -m benchmarks predict matrix --csv "$OUT/layouts.csv" --shapes qwen3-next kimi-linear \
           --tokens 32768 131072 --docs varlen100 --cp 2 --levels ops mixer --methods noCP noCP-qla kcp \
           --layouts zigzag zigzag_per_doc contiguous
         save_cache) ;;
      *) echo "unknown stage $s: correctness, train or bench" >&2; exit 2 ;;
    esac
done
