#!/usr/bin/env bash
# One 1,048,576-token sequence per step through the tiny GDN and KDA hybrids at CP = all GPUs of the
# machine, each with its KCP mixer and with its cp2hp peer in the same hybrid (GDN: megatron-core's own
# GatedDeltaNet; KDA: our mixer with that all-to-all around its kernel, cp2hp_kda_hybrid_layer_spec):
# steps, tokens/s and peak memory from each run's progress lines, or the error a run stops with.
#   bash scripts/device_long_context.sh
# Needs: 2 or more CUDA GPUs with about 30 GiB each at CP = 2 (the GDN hybrid took 28.7 GiB a GPU with
# KCP, 31.0 with cp2hp, on 2 x H200).
# Needs, importable: fla-core 0.6.0, megatron-core 0.19.x, on Hopper with Triton < 3.7.1 tilelang,
# optionally flash-qla 0.1.3 (e.g. `pip install -e ".[qla]" tilelang` in this checkout); setting
# them up is the user's, the script installs nothing.
# MODELS (default "gdn kda"), KCP_LONG_MIXERS (default "kcp cp2hp"), SEQ (default 1048576), STEPS
# (default 4) and VOCAB (default 2048: 32000 would make the logits alone tens of GB per rank at this
# length) can be set. KCP_FAST_AUTOTUNE=1 trims fla's autotuning for all runs alike (first steps then
# compile in seconds, later steps run slightly slower kernel configs). Each run stops after
# KCP_RUN_TIMEOUT seconds (default 240). KCP_LONG_EXTRA adds trainer arguments to every run and
# KCP_LONG_TAG names its files (long_TAG_SPEC.*): KCP_LONG_EXTRA="--linear-attention-freq 5"
# KCP_LONG_TAG=linear leaves out the softmax layer, whose 1M-token attention dominates the hybrid's step.
set -uo pipefail
export OUT="${OUT:-/tmp/out}" PYTHONWARNINGS=ignore CUDA_DEVICE_MAX_CONNECTIONS=1
source scripts/device_cache.sh
W=$(python -c 'import torch; print(torch.cuda.device_count())')
seq=${SEQ:-1048576} steps=${STEPS:-4}
for model in ${MODELS:-gdn kda}; do
  for mixer in ${KCP_LONG_MIXERS:-kcp cp2hp}; do
    spec=$([ "$mixer" = kcp ] && echo "${model}_hybrid_layer_spec" || echo "cp2hp_${model}_hybrid_layer_spec")
    t0=$SECONDS run=${KCP_LONG_TAG:+${KCP_LONG_TAG}_}$spec
    # shellcheck disable=SC2086  # KCP_LONG_EXTRA is split into arguments on purpose
    timeout "${KCP_RUN_TIMEOUT:-240}" python -m megatron_kcp.launch "configs/tiny-$model.json" --nproc-per-node "$W" \
      --cp "$W" -- --spec megatron_kcp.spec "$spec" --seq-length "$seq" --max-position-embeddings "$seq" \
      --vocab-size "${VOCAB:-2048}" --train-iters "$steps" --lr-decay-iters "$steps" \
      ${KCP_LONG_EXTRA:-} --kcp-log "$OUT/long_$run.jsonl" > "$OUT/long_$run.log" 2>&1
    echo "$run CP=$W seq=$seq ${KCP_LONG_EXTRA:-}: exit $? after $((SECONDS - t0)) s" | tee -a "$OUT/long_summary.txt"
    grep -h "\[kcp\]\|KCP active" "$OUT/long_$run.log" | tee -a "$OUT/long_summary.txt"
    grep -h -m3 "Error\|error:" "$OUT/long_$run.log" | tee -a "$OUT/long_summary.txt"
  done
done
save_cache
# logs and losses travel as one archive
(cd "$OUT" && tar -czf long_evidence.tar.gz --remove-files ./long_*.log ./long_*.jsonl ./long_summary.txt)
