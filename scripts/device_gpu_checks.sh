#!/usr/bin/env bash
# GPU evidence in one device call (see ../shared/device/README.md): versions, the GPU test suite
# with per-case errors written to $OUT, then the op benchmark. Run from the repo root:
#   source .devbundle/setup.sh && bash scripts/device_gpu_checks.sh [pytest -k expr]
set -uo pipefail
export PYTHONPATH="$PWD:${PYTHONPATH:-}" OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.tcache}"
mkdir -p "$OUT" "$TRITON_CACHE_DIR"
if [ -f .tcache.tar.gz ]; then tar -xzf .tcache.tar.gz -C "$TRITON_CACHE_DIR" 2>/dev/null; fi
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c 'import torch, triton, fla, megatron.core as m; print("torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "megatron-core", m.__version__)'
  python -c 'import tilelang; print("tilelang", tilelang.__version__)' 2>&1 | tail -1
} | tee "$OUT/versions.txt"
export KCP_EVIDENCE_DIR="$OUT"
t0=$SECONDS
timeout "${KCP_TEST_TIMEOUT:-520}" python -m pytest -q -s -rA -p no:cacheprovider ${KCP_PYTEST_ARGS:-} tests/parallel/test_kcp_gpu.py ${1:+-k "$1"} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "gpu tests: $((SECONDS - t0)) s"
[ -n "${KCP_SAVE_TCACHE:-}" ] && tar -czf "$OUT/tcache.tar.gz" -C "$TRITON_CACHE_DIR" . 2>/dev/null; ls -la "$OUT"
