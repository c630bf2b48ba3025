#!/usr/bin/env bash
# Training checks in one run on a machine with 2 CUDA GPUs (results: BENCHMARKS.md, "End to end"):
# the tiny GDN and KDA hybrids trained with megatron_kcp.train on Megatron's mock data, global batch
# 2 x 4096 tokens.
# Runs (bf16 unless named fp32):
#   cp1        100 steps, CP=1 (DP=2)
#   dp1        100 steps, CP=1 on one GPU (DP=1, two micro-batches): cp1 with another gradient
#              summation (on 2 x H200 it matched cp1 bit for bit)
#   cp2        100 steps, CP=2, checkpoint at step 50
#   resume     from cp2's step-50 checkpoint with TP=2, CP=1 to step 100 (RNG state not loaded: it is
#              kept per TP rank, and with dropout off nothing draws from it)
#   crash      CP=2, checkpoints every 20 steps, every process SIGKILLed once step 30 is logged (mid-step 31)
#   restart    the crash command again with --load: resumes at step 20 and runs to 40
#   fp32_cp1, fp32_cp2   cp1 and cp2 in fp32 (--fp32)
#   keep, convert, fp32_keep, fp32_convert   cp2 with the linear layers kept in Megatron's layout
#              (KCP_CONVERT=0) and moved to the contiguous one (KCP_CONVERT=1), bf16 and fp32, 100 steps
#              (not in the default chains: KCP_TRAIN_CHAINS="gdn:keep,convert,fp32_keep,fp32_convert kda:...")
#   graph      cp2 with Megatron's per-layer CUDA graphs (--cuda-graph-impl local: one sequence a sample,
#              shapes fixed, so each layer's step, KCP's exchange included, is captured once and replayed),
#              against cp2 (not in the default chains: KCP_TRAIN_CHAINS="gdn:cp2,graph kda:cp2,graph")
# KCP_TRAIN_CHAINS lists chains "model:run,run,..." (default: every run of both models, one chain
# per model); chains run side by side, the runs of a chain one after another (resume after cp2,
# restart after crash). Per-step losses land in $OUT/<model>_<run>.jsonl; scripts/loss_parity.py
# compares the bf16 runs with cp2 and fp32_cp2 with fp32_cp1.
#   bash scripts/device_train_checks.sh
# Needs, importable: fla-core 0.6.0, megatron-core 0.19.x, on Hopper with Triton < 3.7.1 tilelang,
# optionally flash-qla 0.1.3 (e.g. `pip install -e ".[qla]" tilelang` in this checkout); setting
# them up is the user's, the script installs nothing.
# Correctness runs: fla's autotuning is trimmed (KCP_FAST_AUTOTUNE), so tokens/s here are not benchmarks.
set -uo pipefail
export OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore KCP_FAST_AUTOTUNE=1 CUDA_DEVICE_MAX_CONNECTIONS=1
source scripts/device_cache.sh
ckpt=/tmp/kcp-ckpt
rm -rf "$ckpt"
deadline=$((SECONDS + ${KCP_TRAIN_BUDGET:-900}))
common=(--global-batch-size 2 --lr-decay-iters 100 --seed 1234 --save-interval 10000)

train() {   # model run port launcher-args... -- trainer-args...
  local model=$1 run=$2 port=$3; shift 3
  local t0=$SECONDS
  if [ "$SECONDS" -ge "$deadline" ]; then echo "$model $run: not started (time budget)" >> "$OUT/summary.txt"; return; fi
  timeout "${KCP_RUN_TIMEOUT:-240}" python -m megatron_kcp.launch "configs/tiny-$model.json" --nproc-per-node 2 --master-port "$port" "$@" \
    --kcp-log "$OUT/${model}_$run.jsonl" > "$OUT/${model}_$run.log" 2>&1
  echo "$model $run: exit $? after $((SECONDS - t0)) s" >> "$OUT/summary.txt"
}

crash() {   # model port launcher-args...: train, and kill every process of the run once step 30 is logged
  local model=$1 log="$OUT/${1}_crash.jsonl"
  train "$model" crash "${@:2}" &
  local pid=$!
  until grep -q '"step": 30' "$log" 2>/dev/null || ! kill -0 $pid 2>/dev/null; do sleep 0.25; done
  pkill -9 -f -- "--kcp-log $log"
  wait $pid
}

run() {   # model port name
  local m=$1 p=$2 n=$3 ck="--save $ckpt/$1"
  case $n in
    cp1) train "$m" cp1 "$p" --cp 1 -- "${common[@]}" --train-iters 100 ;;
    dp1) train "$m" dp1 "$p" --nproc-per-node 1 --cp 1 -- "${common[@]}" --train-iters 100 ;;
    cp2) train "$m" cp2 "$p" --cp 2 -- "${common[@]}" --train-iters 100 $ck-cp2 --save-interval 50 ;;
    resume) train "$m" resume "$p" --tp 2 --cp 1 -- "${common[@]}" --train-iters 100 --load "$ckpt/$m-cp2" \
      --ckpt-step 50 --no-load-rng $ck-resume ;;
    crash) crash "$m" "$p" --cp 2 -- "${common[@]}" --train-iters 40 $ck-crash --save-interval 20 ;;
    restart) train "$m" restart "$p" --cp 2 -- "${common[@]}" --train-iters 40 $ck-crash --save-interval 20 \
      --load "$ckpt/$m-crash" ;;
    fp32_cp1) train "$m" fp32_cp1 "$p" --fp32 --cp 1 -- "${common[@]}" --train-iters 100 ;;
    fp32_cp2) train "$m" fp32_cp2 "$p" --fp32 --cp 2 -- "${common[@]}" --train-iters 100 ;;
    keep|convert|fp32_keep|fp32_convert)
      local fp32=() on=0
      [[ $n == fp32_* ]] && fp32=(--fp32)
      [[ $n == *convert ]] && on=1
      (export KCP_CONVERT=$on; train "$m" "$n" "$p" "${fp32[@]}" --cp 2 -- "${common[@]}" --train-iters 100) ;;
    graph) train "$m" graph "$p" --cp 2 -- "${common[@]}" --train-iters 100 --cuda-graph-impl local ;;
    *) echo "$m $n: unknown run" >> "$OUT/summary.txt" ;;
  esac
}

chain() {   # "model:run,run,..." port: the runs one after another (each uses both GPUs but dp1)
  local m=${1%%:*} runs
  IFS=, read -r -a runs <<<"${1#*:}"
  for n in "${runs[@]}"; do run "$m" "$2" "$n"; done
}

{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c 'import sys, torch, triton, fla, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "megatron-core", m.__version__)'
} | tee "$OUT/versions.txt"
all=cp1,dp1,cp2,resume,crash,restart,fp32_cp1,fp32_cp2
pids=() port=29510
for c in ${KCP_TRAIN_CHAINS:-gdn:$all kda:$all}; do
  chain "$c" $port & pids+=($!)
  port=$((port + 100))
done
# a time limit that leaves room to pack the evidence; the killer must not outlive the script (a
# stray sleep holding the output open keeps the script's caller waiting)
( trap 'kill $s 2>/dev/null; exit' TERM; sleep $((deadline > SECONDS ? deadline - SECONDS : 0)) & s=$!; wait $s; pkill -9 -f megatron_kcp ) &
killer=$!
wait "${pids[@]}"
kill $killer 2>/dev/null
for m in gdn kda; do
  bf16=()
  for n in cp1 dp1 resume crash restart; do [ -f "$OUT/${m}_$n.jsonl" ] && bf16+=("$OUT/${m}_$n.jsonl"); done
  [ -f "$OUT/${m}_cp2.jsonl" ] && [ ${#bf16[@]} -gt 0 ] && python scripts/loss_parity.py "${bf16[@]}" \
    --reference "$OUT/${m}_cp2.jsonl" --tol 2e-2 > "$OUT/${m}_parity.txt" 2>&1
  [ -f "$OUT/${m}_fp32_cp1.jsonl" ] && python scripts/loss_parity.py "$OUT/${m}_fp32_cp2.jsonl" \
    --reference "$OUT/${m}_fp32_cp1.jsonl" --tol 1e-3 > "$OUT/${m}_parity_fp32.txt" 2>&1
  # the layout conversion: the converted run against the one kept in Megatron's layout
  [ -f "$OUT/${m}_keep.jsonl" ] && python scripts/loss_parity.py "$OUT/${m}_convert.jsonl" \
    --reference "$OUT/${m}_keep.jsonl" --tol 2e-2 > "$OUT/${m}_parity_convert.txt" 2>&1
  [ -f "$OUT/${m}_fp32_keep.jsonl" ] && python scripts/loss_parity.py "$OUT/${m}_fp32_convert.jsonl" \
    --reference "$OUT/${m}_fp32_keep.jsonl" --tol 1e-3 > "$OUT/${m}_parity_convert_fp32.txt" 2>&1
  # the captured steps against the eager ones
  [ -f "$OUT/${m}_graph.jsonl" ] && [ -f "$OUT/${m}_cp2.jsonl" ] && python scripts/loss_parity.py \
    "$OUT/${m}_graph.jsonl" --reference "$OUT/${m}_cp2.jsonl" --tol 2e-2 > "$OUT/${m}_parity_graph.txt" 2>&1
done
save_cache
(cd "$OUT" && tar -czf evidence.tar.gz --remove-files ./*.log ./*.txt ./*.jsonl)
tar -xzf "$OUT/evidence.tar.gz" -O ./summary.txt
tar -xzf "$OUT/evidence.tar.gz" -O --wildcards './*parity*.txt' 2>/dev/null
