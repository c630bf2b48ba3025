#!/usr/bin/env bash
# Sourced by the entry scripts: makes .venv (Python >= 3.12) with megatron_kcp and its
# dependencies on first use, then activates it. KCP_VENV overrides the location.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KCP_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  py=""
  for c in python3.12 python3.13 "$HOME/.pyenv/versions/3.12.1/bin/python" python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      py="$c"; break
    fi
  done
  [ -n "$py" ] || { echo "megatron_kcp needs Python >= 3.12 (megatron-core 0.19): install one, or set KCP_VENV" >&2; exit 1; }
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -e "$root[test]"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
cd "$root"
