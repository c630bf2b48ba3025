#!/usr/bin/env bash
# The test suite: CPU tests over gloo ranks; tests marked gpu run where CUDA is present and skip elsewhere.
#   scripts/test.sh          the default tier (minutes on a 2-core CPU): every CP layout, both exchange
#                            strategies, GDN and KDA, W = 2 and 4, long-memory inputs with their
#                            exchange-off negative controls, and the unit tests of every module
#   scripts/test.sh --all    everything: the slow tier too (about an hour on a 2-core CPU)
# Other arguments go to pytest (e.g. -k plan, -x).
source "$(dirname "$0")/env.sh"
tier=(-m "not slow")
args=()
for a in "$@"; do
  if [ "$a" = --all ]; then tier=(); else args+=("$a"); fi
done
python -m pytest -q -p no:cacheprovider "${tier[@]+"${tier[@]}"}" tests "${args[@]+"${args[@]}"}"
