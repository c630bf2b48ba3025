#!/usr/bin/env bash
# Training evidence in one device call on 2 GPUs (see docs/gpu_runs.md): the tiny GDN and KDA
# hybrids trained with megatron_kcp.train on Megatron's mock data, bf16, global batch 2 x 4096 tokens:
#   cp1      100 steps, CP=1 (DP=2)
#   cp2      100 steps, CP=2, checkpoint at step 50
#   resume   from cp2's step-50 checkpoint with TP=2, CP=1 to step 100 (RNG state not loaded: it is kept
#            per TP rank, and with dropout off nothing draws from it)
#   crash    CP=2, checkpoints every 20 steps, every process SIGKILLed once step 30 is logged (mid-step 31)
#   restart  the crash command again with --load: resumes at step 20 and runs to 40
# Per-step losses land in $OUT/<model>_<run>.jsonl; scripts/loss_parity.py compares them.
#   source .devbundle/setup.sh && bash scripts/device_train_checks.sh
# Correctness runs: fla's autotuning is trimmed (KCP_FAST_AUTOTUNE), so tokens/s here are not benchmarks.
set -uo pipefail
export OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore KCP_FAST_AUTOTUNE=1 CUDA_DEVICE_MAX_CONNECTIONS=1
source scripts/device_cache.sh
mkdir -p /tmp/kcp-site
# every torchrun worker trims autotuning before fla imports
printf 'import os\nif os.environ.get("KCP_FAST_AUTOTUNE"):\n    from tests.fast_autotune import enable\n    enable()\n' \
  > /tmp/kcp-site/sitecustomize.py
export PYTHONPATH="/tmp/kcp-site:$PWD:${PYTHONPATH:-}"
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

chain() {   # all runs of one model, one after another (each uses both GPUs)
  local m=$1 p=$2 ck="--save $ckpt/$1"
  train "$m" cp1 "$p" --cp 1 -- "${common[@]}" --train-iters 100
  train "$m" cp2 "$p" --cp 2 -- "${common[@]}" --train-iters 100 $ck-cp2 --save-interval 50
  train "$m" resume "$p" --tp 2 --cp 1 -- "${common[@]}" --train-iters 100 --load "$ckpt/$m-cp2" --ckpt-step 50 --no-load-rng \
    $ck-resume
  crash "$m" "$p" --cp 2 -- "${common[@]}" --train-iters 40 $ck-crash --save-interval 20
  train "$m" restart "$p" --cp 2 -- "${common[@]}" --train-iters 40 $ck-crash --save-interval 20 --load "$ckpt/$m-crash"
}

{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c 'import sys, torch, triton, fla, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "megatron-core", m.__version__)'
} | tee "$OUT/versions.txt"
chain gdn 29510 & a=$!
chain kda 29610 & b=$!
# a time limit that leaves room to pack the evidence; the killer must not outlive the script (a
# stray sleep holding the output open keeps the device call waiting)
( trap 'kill $s 2>/dev/null; exit' TERM; sleep $((deadline > SECONDS ? deadline - SECONDS : 0)) & s=$!; wait $s; pkill -9 -f megatron_kcp ) &
killer=$!
wait $a $b
kill $killer 2>/dev/null
for m in gdn kda; do
  python scripts/loss_parity.py "$OUT/${m}_cp1.jsonl" "$OUT/${m}_cp2.jsonl" "$OUT/${m}_resume.jsonl" \
    "$OUT/${m}_crash.jsonl" "$OUT/${m}_restart.jsonl" --reference "$OUT/${m}_cp2.jsonl" --tol 2e-2 \
    > "$OUT/${m}_parity.txt" 2>&1
done
save_cache
(cd "$OUT" && tar -czf evidence.tar.gz --remove-files ./*.log ./*.txt ./*.jsonl)
tar -xzf "$OUT/evidence.tar.gz" -O ./summary.txt ./gdn_parity.txt ./kda_parity.txt
tar -xzf "$OUT/evidence.tar.gz" -O ./gdn_cp2.log | grep -E "\[kcp\]|Error|error" | head -5
