#!/usr/bin/env bash
# Megatron-LM's pretrain_gpt.py with the KCP specs, in one run on a machine with 2 CUDA GPUs:
#   bash scripts/device_megatron_lm.sh
# Needs, importable: fla-core 0.6.0, megatron-core 0.19.x, on Hopper with Triton < 3.7.1 tilelang,
# optionally flash-qla 0.1.3 (e.g. `pip install -e ".[qla]" tilelang` in this checkout); setting
# them up is the user's, the script installs nothing.
# MEGATRON_LM (default .mlm, made by scripts/fetch_megatron_lm.sh) holds pretrain_gpt.py and the repo-level
# modules it imports; megatron.core and megatron.training come from the installed megatron-core wheel.
# The README's pretrain_gpt.py block is run as it stands (its setup lines, then its torchrun lines);
# every run uses both GPUs for 20 steps of a tiny preset (4096 tokens a step):
#   gdn_mlm, kda_mlm        the README's commands: bf16, CP=2, unmodified Megatron-LM, KDA options in the
#                           spec's name (kda_gate_rank=32, kda_norm_eps=1e-6)
#   gdn_train, kda_train    the same arguments and seed through python -m megatron_kcp.train
#   gdn_patched             the README's one-token --spec megatron_kcp, on a patched copy of megatron-core
#   bad_spec                the patched copy with --spec megatron_kcp_missing: must stop with its ImportError
#   gdn_ref, kda_ref        fp32, CP=2, checkpoint at step 10: the reference of the next three
#   *_full                  + --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
#   *_selective             + --recompute-granularity selective --recompute-modules core_attn mlp
#   *_pp2                   PP=2, CP=1: ref's step-10 checkpoint resumed to step 20 (Megatron seeds each
#                           PP rank differently, so a fresh PP=2 run would start from other weights)
# Losses come from Megatron's log lines; scripts/loss_parity.py compares *_train and gdn_patched with *_mlm,
# the recompute and PP runs with *_ref. summary.txt counts each run's "[megatron_kcp] KCP active" lines
# (one expected) and shows KDA's. KCP_MLM_CHAINS lists chains "model:run,run,..." (default: the four below,
# side by side); no run starts or lasts past KCP_MLM_BUDGET (s, default 500), none lasts longer than
# KCP_RUN_TIMEOUT (s, default 240). Correctness runs: fla's autotuning is trimmed (KCP_FAST_AUTOTUNE), tokens/s mean nothing.
set -uo pipefail
export OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore KCP_FAST_AUTOTUNE=1
mlm="${MEGATRON_LM:-.mlm}"
[ -f "$mlm/pretrain_gpt.py" ] || { echo "no pretrain_gpt.py in $mlm: run scripts/fetch_megatron_lm.sh" >&2; exit 1; }
MEGATRON_LM="$(cd "$mlm" && pwd)" && export MEGATRON_LM
source scripts/device_cache.sh
deadline=$((SECONDS + ${KCP_MLM_BUDGET:-500}))     # no run outlives it: the rest of the call packs the evidence
ckpt=/tmp/kcp-mlm-ckpt
rm -rf "$ckpt"

# the README's block: setup lines (exports, NO_TE, TINY) and the three torchrun lines (GDN, KDA, one-token)
block=$(awk '/^```bash$/ {b = ""; inb = 1; next} /^```$/ {if (inb && b ~ /pretrain_gpt.py --spec/) printf "%s", b; inb = 0; next}
             inb {b = b $0 "\n"}' README.md)
setup=$(grep -v '^torchrun' <<<"$block")
mapfile -t readme < <(grep '^torchrun' <<<"$block")
[ ${#readme[@]} -eq 3 ] || { echo "README.md: expected 3 pretrain_gpt.py commands, found ${#readme[@]}" >&2; exit 1; }
declare -A cmd=([gdn]="${readme[0]}" [kda]="${readme[1]}")
prelude='command -v torchrun >/dev/null || torchrun() { python -m torch.distributed.run "$@"; }'
fp32='TINY32=${TINY/--bf16/}'          # for the exact comparisons

# a copy of the installed megatron-core with patches/ applied, first on PYTHONPATH for the patched runs
patched=/tmp/kcp-mcore-patched
rm -rf "$patched" && mkdir -p "$patched"
cp -r "$(python -c 'import importlib.util as u, os; print(os.path.dirname(u.find_spec("megatron.core").submodule_search_locations[0]))')" "$patched/"
diff=$PWD/patches/megatron-core-0.19.2-spec-default.patch
if command -v patch >/dev/null; then patch -s -d "$patched" -p1 < "$diff"; else (cd "$patched" && git apply -p1 "$diff"); fi \
  || echo "patched copy: the patch did not apply (needs patch or git)" >> "$OUT/summary.txt"
with_patch="PYTHONPATH=$patched:\$PYTHONPATH"

run() {   # name command [arguments appended to it]: the README's setup, then the command, logged to name.log
  local name=$1 command=$2 t0=$SECONDS; shift 2
  local limit=$((deadline - SECONDS < ${KCP_RUN_TIMEOUT:-240} ? deadline - SECONDS : ${KCP_RUN_TIMEOUT:-240}))
  if [ "$limit" -lt 30 ]; then echo "$name: not started (time budget)" >> "$OUT/summary.txt"; return; fi
  timeout -k 10 "$limit" bash -c "$prelude"$'\n'"$setup"$'\n'"$fp32"$'\n'"$command"' "$@"' run "$@" \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s, KCP-active lines: $(grep -c '\[megatron_kcp\] KCP active' "$OUT/$name.log")" \
    >> "$OUT/summary.txt"
}

step() {   # model run
  local m=$1 c=${cmd[$1]} n=$2
  local exact=${c/'$TINY'/'$TINY32'}
  case $n in
    mlm) run "${m}_mlm" "$c" ;;
    train) run "${m}_train" "${c/'$MEGATRON_LM/pretrain_gpt.py'/-m megatron_kcp.train}" ;;
    patched) run "${m}_patched" "$with_patch ${readme[2]}" ;;
    bad_spec) run bad_spec "$with_patch ${readme[2]}" --spec megatron_kcp_missing --train-iters 1 ;;
    ref) run "${m}_ref" "$exact" --save "$ckpt/$m" --save-interval 10 ;;
    full) run "${m}_full" "$exact" --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 ;;
    selective) run "${m}_selective" "$exact" --recompute-granularity selective --recompute-modules core_attn mlp ;;
    pp2) run "${m}_pp2" "$exact" --pipeline-model-parallel-size 2 --context-parallel-size 1 --load "$ckpt/$m" \
      --ckpt-step 10 --no-load-rng ;;
    *) echo "$m $n: unknown run" >> "$OUT/summary.txt" ;;
  esac
}

chain() {   # "model:run,run,...": one after another (pp2 needs ref's checkpoint)
  local m=${1%%:*} runs
  IFS=, read -r -a runs <<<"${1#*:}"
  for n in "${runs[@]}"; do step "$m" "$n"; done
}

{ date -u; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c 'import sys, torch, triton, fla, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, "megatron-core", m.__version__)'
  head -2 "$MEGATRON_LM/SOURCE" 2>/dev/null
} | tee "$OUT/versions.txt"
pids=()
for c in ${KCP_MLM_CHAINS:-gdn:mlm,train,patched,bad_spec kda:mlm,train gdn:ref,full,selective,pp2 kda:ref,full,selective,pp2}; do
  chain "$c" & pids+=($!)
done
wait "${pids[@]}"

{ if [ -f "$OUT/bad_spec.log" ]; then
    grep -q "cannot import megatron_kcp_missing" "$OUT/bad_spec.log" && ! grep -q "iteration *1/" "$OUT/bad_spec.log" \
      && echo "bad_spec: stopped with its ImportError (patched): PASS" || echo "bad_spec: FAIL (see bad_spec.log)"
  fi
  grep -h -m1 "KCP active: KCPKimiDeltaAttention" "$OUT"/kda_*.log 2>/dev/null | sort -u
} >> "$OUT/summary.txt"
for m in gdn kda; do
  runs=()
  for n in train patched; do [ -f "$OUT/${m}_$n.log" ] && runs+=("$OUT/${m}_$n.log"); done
  [ ${#runs[@]} -gt 0 ] && python scripts/loss_parity.py "${runs[@]}" --reference "$OUT/${m}_mlm.log" --tol 1e-3 \
    > "$OUT/${m}_parity_mlm.txt" 2>&1
  runs=()
  for n in full selective pp2; do [ -f "$OUT/${m}_$n.log" ] && runs+=("$OUT/${m}_$n.log"); done
  [ ${#runs[@]} -gt 0 ] && python scripts/loss_parity.py "${runs[@]}" --reference "$OUT/${m}_ref.log" --tol 1e-4 \
    > "$OUT/${m}_parity_exact.txt" 2>&1
done
save_cache
(cd "$OUT" && tar -czf evidence.tar.gz --remove-files ./*.log ./*.txt)
tar -xzf "$OUT/evidence.tar.gz" -O ./summary.txt
tar -xzf "$OUT/evidence.tar.gz" -O --wildcards './*parity*.txt' 2>/dev/null | grep -E "PASS|FAIL|within"
