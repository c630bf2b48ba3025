# Sourced by the device_*.sh scripts: Triton's and tilelang's caches under /tmp/$name, seeded from
# .tcache/$name.tar.xz when the checkout has one (a cache saved by an earlier run, possibly on
# another machine with the same GPU and packages), else from scripts/tuning/$name-h200.tar.xz (fla's
# full-autotuning winners of the measured packed-document and one-sequence tables in BENCHMARKS.md:
# the Qwen3-Next, Kimi-Linear and H = 64 shapes at 32k tokens, and one sequence at 128k; Triton keys
# them by kernel, arguments and GPU architecture, sm_90 for an H100 too), and save_cache, which packs
# the autotune results
# and tilelang kernels into $OUT/$name.tar.xz for a later run (the kernels are dropped if the
# archive would exceed 15 MB, near what one file of $OUT may hold). xz, not gzip: tilelang's kernels
# repeat their host wrappers, and xz's window finds the repeats that gzip's cannot. With
# KCP_FAST_AUTOTUNE set, every Python process, torchrun's workers included, trims fla's autotuning
# (megatron_kcp/testing/fast_autotune.py) before fla imports, and the cache is another one (name
# tcache-fast, not tcache): trimmed winners must never reach a timed run, since Triton reads autotune
# winners from the disk cache.
name=tcache${KCP_FAST_AUTOTUNE:+-fast}
export TRITON_CACHE_DIR=/tmp/$name/triton TILELANG_CACHE_DIR=/tmp/$name/tilelang
mkdir -p "$OUT" "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR"
# scripts started side by side unpack once (the lock), not over each other
seed=.tcache/$name.tar.xz
[ -f "$seed" ] || seed=scripts/tuning/$name-h200.tar.xz
[ -f "$seed" ] && flock "/tmp/$name.lock" tar --skip-old-files -xJf "$seed" -C "/tmp/$name"
mkdir -p /tmp/kcp-site
printf 'import os\nif os.environ.get("KCP_FAST_AUTOTUNE"):\n    from megatron_kcp.testing.fast_autotune import enable\n    enable()\n' \
  > /tmp/kcp-site/sitecustomize.py
export PYTHONPATH="/tmp/kcp-site:$PWD:${PYTHONPATH:-}"

save_cache() {
  (cd "/tmp/$name" && { find triton -name '*.autotune.json'; echo tilelang; } | tar -cJf "$OUT/$name.tar.xz" -T -)
  if [ "$(stat -c %s "$OUT/$name.tar.xz")" -gt 15000000 ]; then
    echo "save_cache: over 15 MB with tilelang's kernels; $OUT/$name.tar.xz keeps the autotune results only" >&2
    (cd "/tmp/$name" && find triton -name '*.autotune.json' | tar -cJf "$OUT/$name.tar.xz" -T -)
  fi
}
