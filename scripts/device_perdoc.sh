#!/usr/bin/env bash
# The packed-document and one-sequence tables predicted from one GPU (issues #27, #28), run from the repo root:
#   bash scripts/device_perdoc.sh
# Needs: one CUDA GPU and, importable, fla-core 0.6.0, megatron-core 0.19.x, on Hopper with Triton < 3.7.1
# tilelang, and flash-qla 0.1.3 for the GDN rows on its kernels (e.g. `pip install -e ".[qla]" tilelang`);
# the script installs nothing.
# Stages (KCP_PERDOC_STAGES, default "split single perdoc128k scale kda"), in that order, each under its own
# time limit (KCP_PERDOC_LIMIT seconds, default 540; a stage cut short keeps the rows it wrote):
#   split       host_time.py: one 32k and one 128k sequence, Qwen3-Next GDN (32 heads a rank) at W = 2,
#               flash-qla's segments whole (--max-segment 0) and split into 4096-token parts     split.csv
#   single      perdoc.py, one sequence, op level: Qwen3-Next GDN at TP = 1 and 2, Kimi-Linear KDA, H = 64,
#               32k, 128k and 1M tokens, W = 2, against noCP, flash-qla's call, cp2hp, fla's CP and our
#               step on one head group; then W = 4 to 64 at 128k tokens        single.csv, single-scale.csv
#   perdoc128k  perdoc.py, 1 to 300 documents at 128k tokens, W = 2, op, mixer and block level  perdoc128k.csv
#   scale       perdoc.py, op level, 128k tokens, W = 4, 8, 16 and 64                           scale.csv
#   kda         perdoc.py, Kimi-Linear KDA at 32k tokens, W = 2 (the current cost model)       kda32k.csv
# Env: KCP_PERDOC_EXTRA (more arguments for both scripts; --smoke walks the stages on a CPU in about a
# minute), OUT (default /tmp/out). Timings use fla's full autotuning (KCP_FAST_AUTOTUNE unset); the tuning
# results and tilelang's kernels are packed into $OUT/tcache.tar.gz (copy it to .tcache/ for the next run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore
unset KCP_FAST_AUTOTUNE
source scripts/device_cache.sh
limit="${KCP_PERDOC_LIMIT:-540}"
read -r -a extra <<< "${KCP_PERDOC_EXTRA:-}"
stage() {   # name, script args...
  local name=$1; shift
  local t0=$SECONDS
  timeout "$limit" python "$@" "${extra[@]+"${extra[@]}"}" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
for s in ${KCP_PERDOC_STAGES:-split single perdoc128k scale kda}; do
  case "$s" in
    split)
      stage split-whole benchmarks/host_time.py --shapes qwen3-next --tokens 32768 131072 --max-segment 0 \
        --csv "$OUT/split-whole.csv"
      stage split-4096 benchmarks/host_time.py --shapes qwen3-next --tokens 32768 131072 --max-segment 4096 \
        --csv "$OUT/split-4096.csv" ;;
    single)
      stage single benchmarks/perdoc.py --docs single --levels ops --cp 2 \
        --shapes qwen3-next qwen3-next-tp2 kimi-linear h64-gdn h64-kda --tokens 32768 131072 1048576 \
        --methods noCP noCP-qla cp2hp cp2hp-qla fla-cp kcp-unpipelined kcp --csv "$OUT/single.csv"
      stage single-scale benchmarks/perdoc.py --docs single --levels ops --cp 4 8 16 64 \
        --shapes qwen3-next kimi-linear h64-gdn --tokens 131072 \
        --methods noCP noCP-qla fla-cp kcp-unpipelined kcp --csv "$OUT/single-scale.csv" ;;
    perdoc128k)
      stage perdoc128k benchmarks/perdoc.py --shapes qwen3-next kimi-linear --tokens 131072 --cp 2 \
        --methods noCP noCP-qla cp2hp cp2hp-qla mlm-chunkwise kcp-noconvert kcp --csv "$OUT/perdoc128k.csv" ;;
    scale)
      stage scale benchmarks/perdoc.py --shapes qwen3-next kimi-linear --tokens 131072 --cp 4 8 16 64 --levels ops \
        --methods noCP noCP-qla cp2hp mlm-chunkwise kcp-noconvert kcp --csv "$OUT/scale.csv" ;;
    kda)
      stage kda benchmarks/perdoc.py --shapes kimi-linear --tokens 32768 --cp 2 --csv "$OUT/kda32k.csv" ;;
    *) echo "unknown stage $s (split single perdoc128k scale kda)" >&2; exit 2 ;;
  esac
done
save_cache
