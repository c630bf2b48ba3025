#!/usr/bin/env bash
# The test suite: CPU tests over gloo ranks; tests marked gpu run where CUDA is present and skip elsewhere.
#   scripts/test.sh                the default tier, the correctness core: every CP layout, every exchange
#                                  strategy, GDN and KDA, W = 2 and 4, long-memory inputs with their exchange-off
#                                  negative controls, the mixers against megatron-core, checkpoints, the
#                                  trainer's CP parity, and the unit tests of every module
#   scripts/test.sh --tooling      the launcher, benchmarks, scripts, demo, device scripts, README commands, CI
#                                  and the presets' dry runs (marker tooling)
#   scripts/test.sh --calibration  the fitted constants and picks against the rows they were fitted on
#   scripts/test.sh --slow         the slow tier alone: more parametrisations and sizes of the core
#   scripts/test.sh --all          everything
# Other arguments go to pytest (e.g. -k plan, -x).
source "$(dirname "$0")/env.sh"
tier=(-m "not slow and not tooling and not calibration")
args=()
for a in "$@"; do
  case "$a" in
    --all) tier=() ;;
    --tooling) tier=(-m "tooling") ;;
    --calibration) tier=(-m "calibration") ;;
    --slow) tier=(-m "slow") ;;
    *) args+=("$a") ;;
  esac
done
python -m pytest -q -p no:cacheprovider "${tier[@]+"${tier[@]}"}" tests "${args[@]+"${args[@]}"}"
