#!/usr/bin/env bash
# The test suite: CPU tests over gloo ranks; GPU tests run when CUDA is present and skip otherwise.
source "$(dirname "$0")/env.sh"
python -m pytest -q -p no:cacheprovider tests "$@"
