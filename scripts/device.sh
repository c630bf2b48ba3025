#!/usr/bin/env bash
# The GPU test suites on a device machine, from the repo root, with the compile caches around them:
#   bash scripts/device.sh [SUITE ...] [--jobs N] [--timeout S] [--skip-memory]    (--list: the suites)
# seeds Triton's autotune results and tilelang's kernels from .tcache/ or scripts/tuning/
# (scripts/device_cache.sh), runs python -m benchmarks gpu-checks with its arguments (benchmarks/gpu_checks.py:
# the suites, their evidence in $OUT/evidence.tar.gz), then saves the caches into $OUT (tcache.tar.xz,
# tcache-fast.tar.xz: copied to .tcache/, they spare a later run compiling). The suites use the tests' cheap
# autotuning (KCP_FAST_AUTOTUNE=1). Cut short (TERM or INT), the suites' evidence so far is packed and the
# caches saved. Exit status: gpu-checks'.
# Needs, importable: fla-core 0.6.0, megatron-core 0.19.x, on Hopper with Triton < 3.7.1 tilelang, optionally
# flash-qla 0.1.3; the script installs nothing. The benchmarks' commands: BENCHMARKS.md, python -m benchmarks.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export OUT="${OUT:-/tmp/out}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore KCP_FAST_AUTOTUNE=1
source scripts/device_cache.sh
python -m benchmarks gpu-checks "$@" &
pid=$!
trap 'kill -TERM "$pid" 2> /dev/null' TERM INT      # gpu-checks packs what its suites wrote, then exits 124
wait "$pid"
rc=$?
[ "$rc" -gt 128 ] && { wait "$pid"; rc=$?; }    # the trap ended the first wait: the suites' own status
save_cache
exit "$rc"
