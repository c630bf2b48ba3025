#!/usr/bin/env bash
# The CP benchmarks, op and layer level, on one machine, run from the repo root:
#   bash scripts/device_bench.sh
# Needs: W >= 2 CUDA GPUs, one per CP rank ("predict" runs on the first GPU alone), and, importable,
# fla-core 0.6.0, megatron-core 0.19.x, on Hopper with Triton < 3.7.1 tilelang, and optionally
# flash-qla 0.1.3 (GDN's fused kernels on Hopper/Blackwell; its rows say n/a without it) and
# matplotlib (the PNGs): e.g. `pip install -e ".[qla]" tilelang` in this checkout. Setting them up
# is the user's; the script installs nothing.
# Stages (KCP_BENCH_STAGES, default "large profile ops layers", in that order; "predict" is not in
# the default), each with a soft budget (bench_ops.py --budget: cases left are skipped, the table
# still prints; a share of the time left) and a hard limit (timeout):
#   large    op level at KCP_BENCH_LARGE_HEADS heads and the first token count: every layout, one
#            sequence, 10 and 100 documents, fwd+bwd
#   profile  torch.profiler's kernel table of noCP and kcp there
#   ops      op level at KCP_BENCH_HEADS over the token counts
#   layers   layer level
#   predict  simulate.py: each rank's local work under the plans of W = KCP_PREDICT_W (default
#            "4 8 16 32 64") at KCP_PREDICT_TOKENS (262144) tokens and KCP_BENCH_HEADS heads, for
#            KCP_PREDICT_MODELS ("GDN KDA"), KCP_PREDICT_DOCS ("single varlen") and the cores
#            KCP_PREDICT_BACKENDS ("fla qla"), replayed over the link fitted on 2 x H200 (alpha 60 us,
#            332 GB/s), with plot.py's efficiency-vs-W table and crossover (predict.csv, predict.png)
# Then the exchange model beside the measured exchange.
# Env: KCP_BENCH_W (CP size, default every GPU), KCP_BENCH_BUDGET (seconds for all stages, default
# 480), KCP_BENCH_TOKENS (op level, default "32768 131072 262144"), KCP_BENCH_HEADS (16),
# KCP_BENCH_LAYER_TOKENS (32768), KCP_BENCH_LARGE_HEADS (64; empty skips that stage), KCP_BENCH_EXTRA
# (more bench_ops.py args), OUT (default /tmp/out). The whole script on a CPU machine, in about a
# minute (the sizes are given, so --smoke keeps them: give tiny ones):
#   OUT=/tmp/b KCP_BENCH_W=2 KCP_BENCH_EXTRA=--smoke KCP_BENCH_TOKENS=128 KCP_BENCH_HEADS=2 \
#   KCP_BENCH_LAYER_TOKENS=128 KCP_BENCH_LARGE_HEADS=4 bash scripts/device_bench.sh
# Timings use fla's full autotuning (KCP_FAST_AUTOTUNE unset); every shape is tuned in untimed
# warm-up calls. The tuning results (small JSON files) and tilelang's kernels are packed into
# $OUT/tcache.tar.xz; copied to .tcache/tcache.tar.xz in the checkout, they spare a later run the
# tuning (scripts/device_cache.sh). $OUT gets the CSVs, the PNGs, logs.tar.gz and tcache.tar.xz;
# the tables are printed at the end.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore
unset KCP_FAST_AUTOTUNE
logs="$OUT/logs"
mkdir -p "$logs"
source scripts/device_cache.sh
W="${KCP_BENCH_W:-$(python -c 'import torch; print(torch.cuda.device_count())')}"
budget="${KCP_BENCH_BUDGET:-480}"
tokens="${KCP_BENCH_TOKENS:-32768 131072 262144}"
heads="${KCP_BENCH_HEADS:-16}"
layer_tokens="${KCP_BENCH_LAYER_TOKENS:-32768}"
large_heads="${KCP_BENCH_LARGE_HEADS-64}"
read -r -a extra <<<"${KCP_BENCH_EXTRA:-}"
t_start=$SECONDS
left() { echo $((budget - (SECONDS - t_start))); }
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c 'import sys, torch, triton, fla, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "megatron-core", m.__version__)'
  python -c 'import tilelang; print("tilelang", tilelang.__version__)' 2>&1 | tail -1
  echo "W=$W budget=${budget}s tokens=($tokens) heads=$heads layer_tokens=$layer_tokens large_heads=$large_heads extra=(${extra[*]:-})"
} | tee "$logs/versions.txt"

stage() {   # name, soft budget s, hard limit s, bench_ops.py args...
  local name=$1 soft=$2 hard=$3; shift 3
  if [ "$hard" -lt 60 ]; then
    echo "$name: skipped, ${hard}s left" | tee -a "$logs/summary.txt"; return
  fi
  local t0=$SECONDS
  timeout -k 15 "$hard" python -m benchmarks run ops --cp "$W" --budget "$soft" "$@" "${extra[@]}" \
    > "$logs/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s (soft ${soft}s, hard ${hard}s)" | tee -a "$logs/summary.txt"
}
# shellcheck disable=SC2086  # word splitting of the W list is intended
predict() {  # hard limit s: simulate.py writes its CSV row by row, so a stopped run still reports
  local t0=$SECONDS smoke=()
  [[ " ${extra[*]:-} " == *" --smoke "* ]] && smoke=(--smoke --backends fla)  # the CPU check (reference core)
  timeout -k 15 "$1" python -m benchmarks predict strategies --models ${KCP_PREDICT_MODELS:-GDN KDA} \
    --tokens "${KCP_PREDICT_TOKENS:-262144}" --heads "$heads" --docs ${KCP_PREDICT_DOCS:-single varlen} \
    --cp ${KCP_PREDICT_W:-4 8 16 32 64} --backends ${KCP_PREDICT_BACKENDS:-fla qla} --alpha-us 60 --bw-gbs 332 \
    --iters 3 --warmup 1 ${smoke[@]+"${smoke[@]}"} --csv "$OUT/predict.csv" > "$logs/predict.log" 2>&1
  echo "predict: exit $? after $((SECONDS - t0)) s (hard ${1}s)" | tee -a "$logs/summary.txt"
}
# shellcheck disable=SC2086  # word splitting of $tokens is intended
run_stage() {  # name, stages after it: a share of what is left, 45 s kept for each stage after it
  local avail=$(($(left) - 45 * $2 - 15)) soft
  soft=$((2 * avail / ($2 + 1))); [ "$soft" -gt $((avail - 40)) ] && soft=$((avail - 40))
  case $1 in
    large) stage ops_h"$large_heads" "$soft" "$avail" --what ops --tokens "${tokens%% *}" --heads "$large_heads" \
             --passes fwd+bwd --csv "$OUT/ops_h$large_heads.csv" ;;
    profile) stage profile "$soft" "$avail" --what profile --tokens "${tokens%% *}" --docs single \
               --heads "${large_heads:-$heads}" ;;
    ops) stage ops "$soft" "$avail" --what ops --tokens $tokens --heads "$heads" --csv "$OUT/ops.csv" ;;
    layers) stage layers "$soft" "$avail" --what layers --tokens "$layer_tokens" --heads "$heads" \
              --csv "$OUT/layers.csv" ;;
    predict) predict "$avail" ;;
    *) echo "KCP_BENCH_STAGES: unknown stage $1 (large, profile, ops, layers, predict)"; exit 2 ;;
  esac
}
read -r -a stages <<<"${KCP_BENCH_STAGES:-large profile ops layers}"
[ -z "$large_heads" ] && stages=("${stages[@]/large}")
read -r -a stages <<<"${stages[*]}"
for i in "${!stages[@]}"; do run_stage "${stages[$i]}" $((${#stages[@]} - i - 1)); done

save_cache
# the logs travel as one archive
(cd "$OUT" && tar -czf logs.tar.gz logs && rm -rf logs)

tar -xzf "$OUT/logs.tar.gz" -O logs/versions.txt logs/summary.txt
for name in ops_h"$large_heads" ops layers; do
  log=$(tar -xzf "$OUT/logs.tar.gz" -O "logs/$name.log" 2>/dev/null) || continue
  echo; echo "== $name"
  # the final table when the stage finished, else the rows it printed before it was stopped
  if grep -q "all rows:" <<<"$log"; then sed -n '/all rows:/,$p' <<<"$log" | grep -v '^wrote\|^no PNG'
  else grep -E "^(model|GDN|KDA|\[rank)" <<<"$log"; echo "(stopped early; its last lines:)"; tail -5 <<<"$log"; fi
  grep -E "^(wrote|no PNG)" <<<"$log"
done
if log=$(tar -xzf "$OUT/logs.tar.gz" -O logs/predict.log 2>/dev/null); then
  echo; echo "== predict"; grep -E "^(model|GDN|KDA|wrote|no PNG)" <<<"$log"
fi
if log=$(tar -xzf "$OUT/logs.tar.gz" -O logs/profile.log 2>/dev/null); then
  echo; echo "== profile"; grep -v TileLang <<<"$log" | grep -E -v "^(USDT|\[rank|\[W)"
fi
ls -la "$OUT"
