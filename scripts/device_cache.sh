# Sourced by the device_*.sh scripts: Triton's and tilelang's caches under /tmp/kcp-cache, seeded from
# .tcache/tcache.tar.gz (carried into the call), and save_cache, which packs the autotune results
# and tilelang kernels into $OUT/tcache.tar.gz for the next call (kernels dropped if the archive
# would exceed what a call returns: 16 MB a file). With KCP_FAST_AUTOTUNE set, every Python process,
# torchrun's workers included, trims fla's autotuning (tests/fast_autotune.py) before fla imports.
export TRITON_CACHE_DIR=/tmp/kcp-cache/triton TILELANG_CACHE_DIR=/tmp/kcp-cache/tilelang
mkdir -p "$OUT" "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR"
# scripts started side by side unpack once (the lock), not over each other
[ -f .tcache/tcache.tar.gz ] && flock /tmp/kcp-cache.lock tar --skip-old-files -xzf .tcache/tcache.tar.gz -C /tmp/kcp-cache
mkdir -p /tmp/kcp-site
printf 'import os\nif os.environ.get("KCP_FAST_AUTOTUNE"):\n    from tests.fast_autotune import enable\n    enable()\n' \
  > /tmp/kcp-site/sitecustomize.py
export PYTHONPATH="/tmp/kcp-site:$PWD:${PYTHONPATH:-}"

save_cache() {
  (cd /tmp/kcp-cache && { find triton -name '*.autotune.json'; echo tilelang; } | tar -czf "$OUT/tcache.tar.gz" -T -)
  if [ "$(stat -c %s "$OUT/tcache.tar.gz")" -gt 15000000 ]; then
    (cd /tmp/kcp-cache && find triton -name '*.autotune.json' | tar -czf "$OUT/tcache.tar.gz" -T -)
  fi
}
