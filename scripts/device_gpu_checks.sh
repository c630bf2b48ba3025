#!/usr/bin/env bash
# GPU evidence in one device call (see ../shared/device/README.md): versions, the GPU tests (op and
# mixer level, fla vs reference and CP vs one GPU) and the CP=4 peak-memory report, with logs and
# per-case errors written to $OUT. Run from the repo root:
#   source .devbundle/setup.sh && bash scripts/device_gpu_checks.sh
# Correctness runs use the tests' cheap autotuning (tests/fast_autotune.py); the three suites run
# side by side, since on a fresh machine their time is Triton compiling on the CPU cores.
# Triton's autotune results (small JSON files) and tilelang's compiled kernels are packed into
# $OUT/tcache.tar.gz: carried back as .tcache/tcache.tar.gz they spare the next machine compiling.
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}" OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore
export KCP_EVIDENCE_DIR="$OUT" KCP_FAST_AUTOTUNE=1
source scripts/device_cache.sh
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c 'import sys, torch, triton, fla, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "megatron-core", m.__version__)'
  python -c 'import tilelang; print("tilelang", tilelang.__version__)' 2>&1 | tail -1
} | tee "$OUT/versions.txt"
limit="${KCP_TEST_TIMEOUT:-400}"
suite() {   # name, pytest args...
  local name=$1; shift
  local t0=$SECONDS
  timeout "$limit" python -m pytest -q -s -rA -p no:cacheprovider "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s" >> "$OUT/summary.txt"
}
suite ops_w1 tests/parallel/test_kcp_gpu.py -k "fla_matches or scattered" &
suite ops_w2 tests/parallel/test_kcp_gpu.py -k "single_gpu and 2]" &
suite ops_w4 tests/parallel/test_kcp_gpu.py -k "single_gpu and 4]" &
suite layers_w2 tests/layers/test_layers_gpu.py -k "2-1-False" &
suite layers_w4 tests/layers/test_layers_gpu.py -k "4-1-False or 4-2-True" &
[ -z "${KCP_SKIP_MEMORY:-}" ] && (   # peak memory is per process: sharing the GPU does not change it
  t0=$SECONDS
  timeout "$limit" python benchmarks/bench_ops.py --memory-only --cp 4 --tokens 32768 --heads 16 \
    --layouts contiguous zigzag --warmup 1 > "$OUT/memory.txt" 2>&1
  echo "memory: exit $? after $((SECONDS - t0)) s" >> "$OUT/summary.txt"
) &
wait
save_cache
# at most 8 files come back from a device call: logs and per-case errors travel as one archive
(cd "$OUT" && tar -czf evidence.tar.gz --remove-files ./*.log ./*.txt)
tar -xzf "$OUT/evidence.tar.gz" -O ./summary.txt
tar -xzf "$OUT/evidence.tar.gz" -O --wildcards './*.log' | grep -E "^(PASSED|FAILED|ERROR)|(passed|failed)( |,)"
