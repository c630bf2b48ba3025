#!/usr/bin/env bash
# The packed-document and one-sequence tables predicted from one GPU (issues #27, #28), run from the repo root:
#   bash scripts/device_perdoc.sh
#   KCP_PERDOC_STAGES="x2-gdn x2-kda x2-single" bash scripts/device_perdoc.sh     # measured, on two GPUs
# Needs: one CUDA GPU (the x2 stages: two or more) and, importable, fla-core 0.6.0, megatron-core 0.19.x, on
# Hopper with Triton < 3.7.1 tilelang, and flash-qla 0.1.3 for the GDN rows on its kernels (e.g.
# `pip install -e ".[qla]" tilelang`); the script installs nothing.
# Stages (KCP_PERDOC_STAGES, default "split single perdoc128k scale kda"), in that order. Each stage runs one
# process per shape (and per length where lengths differ a lot), each under its own time limit
# (KCP_PERDOC_LIMIT seconds, default 240; none past KCP_PERDOC_UNTIL, epoch seconds, where set: a device
# call's end), and appends its rows to the stage's CSV, a case cut short its rows so far: a shape's first
# case compiles and tunes its kernels for minutes.
#   split       host_time.py: one 32k and one 128k sequence, Qwen3-Next GDN (32 heads a rank) and H = 64 at
#               W = 2, flash-qla's segments whole (--max-segment 0) and split into 4096-token parts  split.csv
#   single      perdoc.py, one sequence, op level: Qwen3-Next GDN at TP = 1 and 2, Kimi-Linear KDA, H = 64,
#               32k, 128k and 1M tokens, W = 2, against noCP, flash-qla's call, cp2hp, fla's CP and our
#               step on one head group; then W = 4 to 64 at 128k tokens        single.csv, single-scale.csv
#   perdoc128k  perdoc.py, 1 to 300 documents at 128k tokens, W = 2, op, mixer and block level  perdoc128k.csv
#   scale       perdoc.py, op level, 128k tokens, W = 4, 8, 16 and 64 (KCP_PERDOC_CP)           scale.csv
#   kda         perdoc.py, Kimi-Linear KDA at 32k tokens, W = 2 (the current cost model)       kda32k.csv
# On a machine of W >= 2 GPUs, the same tables measured (perdoc_measured.py: a rank a GPU, NCCL), not in the
# default, a process per shape and document count:
#   x2-gdn      Qwen3-Next GDN, 1 to 300 documents at 32k tokens (KCP_PERDOC_TOKENS), op, mixer and block
#               level                                                                           perdoc_x2.csv
#   x2-kda      Kimi-Linear KDA, the same                                                      perdoc_x2.csv
#   x2-single   one sequence, op level: Qwen3-Next GDN at TP = 1 and 2, H = 64 GDN, Kimi-Linear KDA,
#               32k and 128k tokens, also our step captured in a CUDA graph (kcp-graph)         single_x2.csv
# A shorter call takes a part of the cases: KCP_PERDOC_DOCS (e.g. "varlen100 varlen300"; perdoc128k, scale, kda
# then run a process per shape and document count, else one per shape for all four; x2-gdn, x2-kda always one
# per count), KCP_PERDOC_CP (scale's CP sizes, default "4 8 16 64"), KCP_PERDOC_TOKENS (x2-gdn, x2-kda: default
# 32768; x2-single: default "32768 131072") and KCP_PERDOC_SHAPES (x2-single). KCP_PERDOC_JOBS=N runs the
# cases in N jobs side by side, each on its share of the machine's GPUs (4 GPUs: N = 2 gives two W = 2 jobs,
# N = 4 four one-GPU jobs for the predicted stages), each job taking the next case, in stage order, when its
# last one ends. Jobs side by side share the host's CPU: the predicted
# steps of few heads or short ranks are partly host-bound, so their rows are noisier than a job run alone.
# Every process's output (whole, once it ends) and a line per process (exit status, seconds) go to log.txt.
# Env: KCP_PERDOC_EXTRA (more arguments for both scripts; --smoke walks the stages on a CPU in a few
# minutes), OUT (default /tmp/out). Timings use fla's full autotuning (KCP_FAST_AUTOTUNE unset); the tuning
# results and tilelang's kernels are packed into $OUT/tcache.tar.xz (copy it to .tcache/ for the next run;
# check its size first: over 15 MB the kernels are left out of it).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD:${PYTHONPATH:-}" OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore
unset KCP_FAST_AUTOTUNE
if [[ -n "${KCP_PERDOC_UNTIL:-}" && ! "$KCP_PERDOC_UNTIL" =~ ^[0-9]+$ ]]; then
  echo "KCP_PERDOC_UNTIL=$KCP_PERDOC_UNTIL: give the call's end in epoch seconds, e.g. \$((\$(date +%s) + 540))" >&2
  exit 2
fi
if [[ ! "${KCP_PERDOC_JOBS:-1}" =~ ^[1-9][0-9]*$ ]]; then
  echo "KCP_PERDOC_JOBS=$KCP_PERDOC_JOBS: give a number of jobs, e.g. 2 on a machine of 4 GPUs" >&2
  exit 2
fi
if [[ ! "${KCP_PERDOC_CP:-4}" =~ ^[[:space:]]*[1-9][0-9]*([[:space:]]+[1-9][0-9]*)*[[:space:]]*$ ]]; then
  echo "KCP_PERDOC_CP=$KCP_PERDOC_CP: give CP sizes separated by spaces, e.g. \"32 64\"" >&2
  exit 2
fi
for d in ${KCP_PERDOC_DOCS:-}; do
  case "$d" in single|varlen|varlen100|varlen300) ;;
    *) echo "KCP_PERDOC_DOCS has $d: use single, varlen, varlen100 or varlen300, separated by spaces" >&2; exit 2 ;;
  esac
done
source scripts/device_cache.sh
limit="${KCP_PERDOC_LIMIT:-240}"
read -r -a extra <<< "${KCP_PERDOC_EXTRA:-}"
one() {     # stage's CSV name, what the line names, script args...: one process, its rows appended
  local name=$1 what=$2; shift 2
  local t0=$SECONDS part log
  local t=$limit
  if [ -n "${KCP_PERDOC_UNTIL:-}" ]; then        # the call's end (epoch seconds): the last case is cut there
    t=$((KCP_PERDOC_UNTIL - $(date +%s)))
    [ "$t" -gt "$limit" ] && t=$limit
    if [ "$t" -le 0 ]; then echo "$name $what: not started (KCP_PERDOC_UNTIL)" | tee -a "$OUT/log.txt"; return; fi
  fi
  part="$(mktemp)" log="$(mktemp)"
  timeout "$t" python "$@" --csv "$part" "${extra[@]+"${extra[@]}"}" > "$log" 2>&1
  local rc=$?
  {   # jobs side by side append one at a time
    flock 9
    if [ -s "$part" ]; then
      if [ -s "$OUT/$name.csv" ]; then tail -n +2 "$part" >> "$OUT/$name.csv"; else cat "$part" > "$OUT/$name.csv"; fi
    fi
    cat "$log" >> "$OUT/log.txt"
    echo "$name $what: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/log.txt"
  } 9> "$OUT/.lock"
  rm -f "$part" "$log"
}
queue=()    # every stage's cases, in stage order, run by run_queue
enqueue() { queue+=("$(printf '%q ' "$@")"); }
run_queue() {   # the queued cases over KCP_PERDOC_JOBS jobs, each on its share of the GPUs
  local n=${KCP_PERDOC_JOBS:-1} next="$OUT/.next" gpus=() j
  [ ${#queue[@]} -eq 0 ] && return
  [ "$n" -gt 1 ] && mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)
  echo 0 > "$next"
  for ((j = 0; j < n; j++)); do
    (
      w=$(( ${#gpus[@]} / n ))
      if [ "$w" -ge 1 ]; then export CUDA_VISIBLE_DEVICES; CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:j*w:w}"); fi
      while i=$(flock "$next" bash -c 'i=$(cat "$1"); echo $((i + 1)) > "$1"; echo "$i"' _ "$next") \
          && [ "$i" -lt ${#queue[@]} ]; do
        eval "one ${queue[i]}"
      done
    ) &
  done
  wait
  rm -f "$next"
}
GDN="qwen3-next qwen3-next-tp2 h64-gdn"
KDA="kimi-linear h64-kda"
by_docs() {   # stage name, shape, perdoc.py args...: a case per KCP_PERDOC_DOCS count, else one for all counts
  local name=$1 sh=$2 d; shift 2
  if [ -z "${KCP_PERDOC_DOCS:-}" ]; then enqueue "$name" "$sh" benchmarks/perdoc.py --shapes "$sh" "$@"; return; fi
  for d in $KCP_PERDOC_DOCS; do enqueue "$name" "$sh $d" benchmarks/perdoc.py --shapes "$sh" --docs "$d" "$@"; done
}
for s in ${KCP_PERDOC_STAGES:-split single perdoc128k scale kda}; do
  case "$s" in
    split)
      for ms in 0 4096; do
        for sh in qwen3-next h64-gdn; do
          enqueue split "$sh max-segment $ms" benchmarks/host_time.py --shapes "$sh" --tokens 32768 131072 \
            --max-segment "$ms"
        done
      done ;;
    single)
      for T in 32768 131072 1048576; do
        for sh in $GDN $KDA; do
          enqueue single "$sh $T" benchmarks/perdoc.py --docs single --levels ops --cp 2 --shapes "$sh" --tokens "$T" \
            --methods noCP noCP-qla cp2hp cp2hp-qla fla-cp kcp-unpipelined kcp
        done
      done
      for sh in qwen3-next kimi-linear h64-gdn; do
        enqueue single-scale "$sh" benchmarks/perdoc.py --docs single --levels ops --cp 4 8 16 64 --shapes "$sh" \
          --tokens 131072 --methods noCP noCP-qla fla-cp kcp-unpipelined kcp
      done ;;
    perdoc128k)
      for sh in qwen3-next kimi-linear; do
        by_docs perdoc128k "$sh" --tokens 131072 --cp 2 \
          --methods noCP noCP-qla cp2hp cp2hp-qla mlm-chunkwise kcp-noconvert kcp
      done ;;
    scale)
      read -r -a sizes <<< "${KCP_PERDOC_CP:-4 8 16 64}"
      for sh in qwen3-next kimi-linear; do
        by_docs scale "$sh" --tokens 131072 --cp "${sizes[@]}" --levels ops \
          --methods noCP noCP-qla cp2hp mlm-chunkwise kcp-noconvert kcp
      done ;;
    kda)
      by_docs kda32k kimi-linear --tokens 32768 --cp 2 ;;
    x2-gdn|x2-kda)
      sh=$([ "$s" = x2-gdn ] && echo qwen3-next || echo kimi-linear)
      for T in ${KCP_PERDOC_TOKENS:-32768}; do
        for d in ${KCP_PERDOC_DOCS:-single varlen varlen100 varlen300}; do
          enqueue perdoc_x2 "$sh $T $d" benchmarks/perdoc_measured.py --shapes "$sh" --tokens "$T" --docs "$d"
        done
      done ;;
    x2-single)
      for T in ${KCP_PERDOC_TOKENS:-32768 131072}; do
        for sh in ${KCP_PERDOC_SHAPES:-qwen3-next qwen3-next-tp2 h64-gdn kimi-linear}; do
          enqueue single_x2 "$sh $T" benchmarks/perdoc_measured.py --docs single --levels ops --shapes "$sh" --tokens "$T" \
            --methods noCP noCP-qla cp2hp cp2hp-qla fla-cp kcp-unpipelined kcp kcp-graph
        done
      done ;;
    *) echo "unknown stage $s (split single perdoc128k scale kda x2-gdn x2-kda x2-single)" >&2; exit 2 ;;
  esac
done
run_queue
rm -f "$OUT/.lock"
save_cache
