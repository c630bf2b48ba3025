#!/usr/bin/env bash
# The GPU test suites in one run: versions, the GPU tests (op and mixer level, fla vs reference and
# CP vs one GPU, also with unwritten memory NaN on fla's and flash-qla's cores; the converted layout on THD packs; a rank's step
# replayed from a CUDA graph) and the
# CP=4 peak-memory report, with logs and per-case errors written to $OUT
# (default /tmp/out). Run from the repo root:
#   bash scripts/device_gpu_checks.sh
# Needs: one or more CUDA GPUs (CP ranks get a GPU each over NCCL where there are enough, else share
# GPUs over gloo, so CP = 4 runs on one or two).
# Needs, importable: fla-core 0.6.0, megatron-core 0.19.x, on Hopper with Triton < 3.7.1 tilelang,
# optionally flash-qla 0.1.3 (e.g. `pip install -e ".[qla]" tilelang` in this checkout); setting
# them up is the user's, the script installs nothing.
# Correctness runs use the tests' cheap autotuning (megatron_kcp/testing/fast_autotune.py); the
# suites run side by side, since on a fresh machine their time is Triton compiling on the CPU cores:
# KCP_CHECK_JOBS at a time (default three a GPU; more run one GPU out of memory), longest first.
# KCP_CHECK_SUITES (names, e.g. "ops_w2 graph") runs a part; KCP_TEST_TIMEOUT (s, default 900) limits each.
# The tests read a part of a suite from the environment, which the suites pass on: KCP_GPU_MODELS (gdn,kda),
# KCP_GPU_DTYPES (bfloat16,float32) and KCP_GPU_LAYOUTS cut the op suites, KCP_GPU_DOCS the layout ones.
# Every GPU test is in a suite; the 2-GPU ones (train_*, nccl) skip on one GPU.
# Triton's autotune results (small JSON files) are packed into $OUT/tcache-fast.tar.xz, tilelang's compiled
# kernels into $OUT/tcache.tar.xz: copied to .tcache/ in the checkout, they spare a later run compiling.
# Logs and per-case errors travel as one archive, $OUT/evidence.tar.gz, packed again as each suite ends;
# cut short (TERM or INT, e.g. a time limit's), the script packs what the suites have written so far
# and names the ones it cut in summary.txt, so $OUT never holds more than a few files.
# Exit status: 0 when every suite (and the memory report) exited 0, 1 when one did not, 124 when cut short,
# 2 when the input is refused before anything runs.
set -uo pipefail
SUITES="layout_w4_block_gdn layout_w4_block_kda layout_w4_mixers train_gdn train_kda ops_w2 ops_w4 layout_mixers
  layout_block_gdn layout_block_kda ops_pieces ops_conv ops_poison ops_poison_qla ops_poison_w4 ops_poison_w4_qla
  layers_w4 layers_w2 layers_slow nccl graph ops_w1 whole_stream documents models_convert memory"
for s in ${KCP_CHECK_SUITES:-}; do
  [[ " ${SUITES//$'\n'/ } " == *" $s "* ]] || {
    echo "KCP_CHECK_SUITES has $s: name suites from: $(echo $SUITES), separated by spaces" >&2; exit 2; }
done
if [[ ! "${KCP_CHECK_JOBS:-1}" =~ ^[1-9][0-9]*$ ]]; then
  echo "KCP_CHECK_JOBS=$KCP_CHECK_JOBS: give a number of suites at a time, e.g. 3" >&2
  exit 2
fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "$gpus" -eq 0 ]; then
  echo "device_gpu_checks.sh runs the GPU suites and found no GPU (nvidia-smi -L): on a CPU run scripts/test.sh --all" >&2
  exit 2
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore
EVIDENCE=$(mktemp -d)          # the logs, packed into $OUT/evidence.tar.gz
export KCP_EVIDENCE_DIR="$EVIDENCE" KCP_FAST_AUTOTUNE=1
source scripts/device_cache.sh
pack() {   # suites end side by side: one packs at a time, and the archive is replaced whole (tar's exit 1:
           # a log grew while read, the archive stands)
  (flock 9; tar --warning=no-file-changed -czf "$OUT/evidence.tmp.tar.gz" -C "$EVIDENCE" .
   [ $? -le 1 ] && mv -f "$OUT/evidence.tmp.tar.gz" "$OUT/evidence.tar.gz") 9> "$EVIDENCE.lock"
}
cut_short() {
  trap - TERM INT
  for f in "$EVIDENCE"/*.running; do
    [ -e "$f" ] && echo "$(basename "$f" .running): cut short after $(( $(date +%s) - $(cat "$f") )) s" >> "$EVIDENCE/summary.txt"
  done
  pack
  rm -rf "$EVIDENCE" "$EVIDENCE.lock"
  echo "cut short: the evidence so far is in $OUT/evidence.tar.gz" >&2
  exit 124
}
trap cut_short TERM INT
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c 'import sys, torch, triton, fla, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "megatron-core", m.__version__)'
  python -c 'import tilelang; print("tilelang", tilelang.__version__)' 2>&1 | tail -1
} | tee "$EVIDENCE/versions.txt"
limit="${KCP_TEST_TIMEOUT:-900}"
jobs_max="${KCP_CHECK_JOBS:-$((3 * gpus))}"   # suites at a time: more than three a GPU run it out of memory
logged() {   # name, log file, command...: run under the time limit, its exit status in summary.txt
  local name=$1 log=$2; shift 2
  local t0=$SECONDS
  date +%s > "$EVIDENCE/$name.running"
  timeout "$limit" "$@" > "$EVIDENCE/$log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s" >> "$EVIDENCE/summary.txt"
  rm -f "$EVIDENCE/$name.running"
  pack
}
suite() {   # name, pytest args...
  local name=$1; shift
  logged "$name" "$name.log" python -m pytest -q -s -rA -p no:cacheprovider "$@"
}
memory() {   # peak memory is per process: sharing the GPU does not change it
  logged memory memory.txt python -m benchmarks run ops --memory-only --cp 4 --tokens 32768 --heads 16 \
    --layouts contiguous zigzag --warmup 1
}
pool() {   # name, then suite's pytest args (or nothing: the memory report): started once a slot is free
  [[ -z "${KCP_CHECK_SUITES:-}" || " $KCP_CHECK_SUITES " == *" $1 "* ]] || return 0
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  if [ "$1" = memory ]; then memory & else suite "$@" & fi
}
# longest first: the W = 4 layout tests, then the training steps
pool layout_w4_block_gdn tests/layers/test_layout.py -k "at_4_ranks_on_gpu and block-gdn"
pool layout_w4_block_kda tests/layers/test_layout.py -k "at_4_ranks_on_gpu and block-kda"
pool layout_w4_mixers tests/layers/test_layout.py -k "at_4_ranks_on_gpu and mixer"
pool train_gdn tests/test_train_cuda.py -k gdn     # 2 GPUs (skips on one): the training step over NCCL
pool train_kda tests/test_train_cuda.py -k kda
pool ops_w2 tests/ops/test_kcp_cuda.py -k "single_gpu and 2]"
pool ops_w4 tests/ops/test_kcp_cuda.py -k "single_gpu and 4]"
pool layout_mixers tests/layers/test_layout.py -k "equals_cp1_on_gpu and mixer"
pool layout_block_gdn tests/layers/test_layout.py -k "equals_cp1_on_gpu and block-gdn"
pool layout_block_kda tests/layers/test_layout.py -k "equals_cp1_on_gpu and block-kda"
pool ops_poison tests/ops/test_kcp_cuda.py -k "cp_reads_no_unzeroed and 2]"
KCP_GPU_BACKEND=qla KCP_GPU_MODELS=gdn \
  pool ops_poison_qla tests/ops/test_kcp_cuda.py -k "cp_reads_no_unzeroed and 2]"   # flash-qla's core (Hopper+, bf16)
pool ops_poison_w4 tests/ops/test_kcp_cuda.py -k "cp_reads_no_unzeroed and 4]"
KCP_GPU_BACKEND=qla KCP_GPU_MODELS=gdn \
  pool ops_poison_w4_qla tests/ops/test_kcp_cuda.py -k "cp_reads_no_unzeroed and 4]"
pool ops_pieces tests/ops/test_kcp_cuda.py -k "qla_matches or single_device_call or split_segments or maps_match or head_groups or middle_rank_split"
pool ops_conv tests/ops/test_kcp_cuda.py -k conv_     # the conv's halo on every layout and both kernels: long
pool layers_w4 tests/layers/test_layers_cuda.py -k "4-1-False or 4-2-True"
pool layers_w2 tests/layers/test_layers_cuda.py -k "2-1-False or 2-2-True or fused_gate"
pool layers_slow tests/layers/test_attention.py tests/layers/test_layers_cuda.py -k "varlen or long_pieces"
pool nccl tests/ops/test_kcp_cuda.py -k "no_host_sync or over_nccl"     # 2 GPUs (skips on one)
pool graph tests/ops/test_kcp_cuda.py -k replays
pool ops_w1 tests/ops/test_kcp_cuda.py tests/parallel/test_gather.py -k "fla_matches or scattered or fold_on_the_gpu"
pool whole_stream tests/layers/test_layout.py -k whole_stream_layout_on_gpu   # --dataloader-inter-document-masking cuts
pool documents tests/test_train_data_cuda.py      # pretrain_gpt.py and megatron_kcp.train, tiny presets incl. MoE, MTP
pool models_convert tests/convert/test_convert_cuda.py    # converted HF models against transformers, bf16
[ -z "${KCP_SKIP_MEMORY:-}" ] && pool memory
wait
pack
rm -rf "$EVIDENCE" "$EVIDENCE.lock"
save_cache
summary=$(tar -xzf "$OUT/evidence.tar.gz" -O ./summary.txt)
echo "$summary"
tar -xzf "$OUT/evidence.tar.gz" -O --wildcards './*.log' 2> /dev/null | grep -E "^(PASSED|FAILED|ERROR)|(passed|failed)( |,)"
! grep -qv ": exit 0 after" <<< "$summary"   # the script's exit status: 0 when every suite's was
