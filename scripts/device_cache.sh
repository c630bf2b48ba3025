# Sourced by scripts/device.sh and the device_*.sh scripts: Triton's autotune cache under $KCP_CACHE_ROOT/$name/triton and
# tilelang's compiled kernels under $KCP_CACHE_ROOT/tcache/tilelang (KCP_CACHE_ROOT: default /tmp),
# seeded from .tcache/$name.tar.xz when the checkout has one (a cache saved by an earlier run,
# possibly on another machine with the same GPU and packages), else from
# scripts/tuning/$name-h200.tar.xz (fla's full-autotuning winners of the measured packed-document
# and one-sequence tables in BENCHMARKS.md: the Qwen3-Next, Kimi-Linear and H = 64 shapes at 32k
# tokens, one sequence at 128k, and the mixer-level table's H = 16 on one 32k sequence; Triton
# keys them by kernel, arguments and GPU architecture, sm_90 for an H100 too; and tilelang
# 0.1.15's sm_90 kernels for flash-qla's GDN and fla's tilelang backward at the tables' shapes, on
# head shards (cp2hp) and on 128k packs too, which a fresh machine would otherwise compile before
# its first Qwen3-Next step); and save_cache, which packs them for a
# later run (see it). xz, not gzip: tilelang's kernels repeat their host wrappers, and xz's window
# finds the repeats that gzip's cannot. With KCP_FAST_AUTOTUNE set, every Python process, torchrun's
# workers included, trims fla's autotuning (megatron_kcp/testing/fast_autotune.py) before fla
# imports, and the autotune cache is another one (name tcache-fast, not tcache): trimmed winners
# must never reach a timed run, since Triton reads autotune winners from the disk cache. tilelang's
# kernels depend on no autotuning, so both share the full cache's (seeded from tcache.tar.xz): tests
# with trimmed tuning do not compile them again.
name=tcache${KCP_FAST_AUTOTUNE:+-fast}
cache_root=${KCP_CACHE_ROOT:-/tmp}
export TRITON_CACHE_DIR=$cache_root/$name/triton TILELANG_CACHE_DIR=$cache_root/tcache/tilelang
mkdir -p "$OUT" "$TRITON_CACHE_DIR" "$TILELANG_CACHE_DIR"
seed_of() {   # name: its saved archive, where the checkout has one
  local seed=.tcache/$1.tar.xz
  [ -f "$seed" ] || seed=scripts/tuning/$1-h200.tar.xz
  [ -f "$seed" ] && echo "$seed"
}
seed_cache() {   # name: unpack its saved archive (scripts started side by side unpack once: the lock)
  local seed
  seed=$(seed_of "$1") && flock "$cache_root/$1.lock" tar --skip-old-files -xJf "$seed" -C "$cache_root/$1"
}
seed_cache "$name"
[ "$name" = tcache ] || { mkdir -p "$cache_root/tcache"; seed_cache tcache; }
cache_since=$(date +%s.%N)   # what this run adds to the caches is newer (unpacked files keep the archive's times)
mkdir -p "$cache_root/kcp-site"
printf 'import os\nif os.environ.get("KCP_FAST_AUTOTUNE"):\n    from megatron_kcp.testing.fast_autotune import enable\n    enable()\n' \
  > "$cache_root/kcp-site/sitecustomize.py"
export PYTHONPATH="$cache_root/kcp-site:$PWD:${PYTHONPATH:-}"

cache_files() {   # find's tests...: the full cache's files that save_cache packs (and pass them), sorted
  (cd "$cache_root/tcache" && { find triton -name '*.autotune.json' "$@"; find tilelang -type f "$@"; } 2> /dev/null |
   sort)
}
publish() {   # archive name: the archive into $OUT under name, whole or not at all (a copy, then a rename in
              # $OUT): a run cut short while packing leaves no truncated archive for the next run to seed from
  cp "$1" "$OUT/$2.part" && mv "$OUT/$2.part" "$OUT/$2" && rm -f "$1"
}
save_cache() {   # $OUT/tcache.tar.xz: the full cache's autotune results and tilelang's kernels; with
                 # KCP_FAST_AUTOTUNE also $OUT/tcache-fast.tar.xz, the trimmed results (packed beside the
                 # caches, then published)
  local seed part=$cache_root/packing.$$.tar.xz      # $$: scripts side by side pack apart
  [ "$name" = tcache ] ||
    { (cd "$cache_root/tcache-fast" && find triton -name '*.autotune.json' | tar -cJf "$part" -T -) &&
      publish "$part" tcache-fast.tar.xz; }
  # the run added nothing to the seed (no file newer, the same files): the seed is the archive, and xz
  # spends no 10-15 s packing tilelang's kernels again
  if seed=$(seed_of tcache) && [ -z "$(cache_files -newermt "@$cache_since")" ] &&
      [ "$(cache_files)" = "$(tar -tJf "$seed" | grep -v '/$' | sort)" ]; then
    cp "$seed" "$part"
  else
    (cd "$cache_root/tcache" && { find triton -name '*.autotune.json' 2>/dev/null; echo tilelang; } | tar -cJf "$part" -T -)
  fi || return
  if [ "$(stat -c %s "$part")" -gt 15000000 ]; then
    echo "save_cache: over 15 MB with tilelang's kernels; $OUT/tcache.tar.xz keeps the autotune results only" >&2
    (cd "$cache_root/tcache" && find triton -name '*.autotune.json' 2>/dev/null | tar -cJf "$part" -T -)
  fi || return
  publish "$part" tcache.tar.xz
}
