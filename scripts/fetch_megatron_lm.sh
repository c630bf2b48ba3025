#!/usr/bin/env bash
# Copy Megatron-LM's pretrain_gpt.py, the repo-level modules it imports (at core_r0.19.0:
# gpt_builders.py, model_provider.py) and Megatron-LM's LICENSE into .mlm/, so that pretrain_gpt.py
# runs against the installed megatron-core wheel, which ships megatron.core and megatron.training
# but none of these files. No megatron/ directory is copied: the wheel's stays the one imported.
#   scripts/fetch_megatron_lm.sh SOURCE [REF]        (then: MEGATRON_LM=.mlm ...)
# SOURCE: a Megatron-LM git checkout or mirror (bare or not), read at REF (default core_r0.19.0, or the release's
# tag core_v0.19.0 where a mirror has no such branch; also found as origin/REF); or a directory holding
# pretrain_gpt.py, copied as it is (REF ignored).
# MLM_DIR overrides the destination. .mlm/ holds Megatron's code: keep it out of git (.git/info/exclude).
set -euo pipefail
src=${1:?usage: scripts/fetch_megatron_lm.sh SOURCE [REF]}
ref=${2:-core_r0.19.0}
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${MLM_DIR:-$root/.mlm}"
py=$(command -v python || command -v python3)

commit=""
if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
  refs=("$ref" "origin/$ref")
  [ $# -ge 2 ] || refs+=(core_v0.19.0)      # no REF given: the release's tag
  for r in "${refs[@]}"; do
    commit=$(git -C "$src" rev-parse --verify -q "$r^{commit}") && break
  done
  [ -n "$commit" ] || { echo "fetch_megatron_lm: $ref is not in $src: git -C $src fetch origin $ref, or give another REF" >&2; exit 1; }
  has() { git -C "$src" cat-file -e "$commit:$1" 2>/dev/null; }
  get() { git -C "$src" show "$commit:$1"; }
  from="Megatron-LM $r ($commit) from $src"
elif [ -f "$src/pretrain_gpt.py" ]; then
  has() { [ -f "$src/$1" ]; }
  get() { cat "$src/$1"; }
  from="the files in $src (not a git checkout: REF not applied)"
else
  echo "fetch_megatron_lm: $src is neither a git checkout of Megatron-LM nor a directory with pretrain_gpt.py" >&2
  exit 1
fi
has pretrain_gpt.py || { echo "fetch_megatron_lm: no pretrain_gpt.py in $from" >&2; exit 1; }

rm -rf "$out" && mkdir -p "$out"
# pretrain_gpt.py, then every repo-level module that a copied file imports (top-level names only)
queue=(pretrain_gpt.py) copied=()
while [ ${#queue[@]} -gt 0 ]; do
  f=${queue[0]} queue=("${queue[@]:1}")
  get "$f" > "$out/$f"
  copied+=("$f")
  for m in $("$py" -c 'import ast, sys
tree = ast.parse(open(sys.argv[1]).read())
names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level}
print(*sorted(names))' "$out/$f"); do
    if has "$m.py" && [ ! -f "$out/$m.py" ] && [[ " ${queue[*]} " != *" $m.py "* ]]; then queue+=("$m.py"); fi
  done
done
has LICENSE && get LICENSE > "$out/LICENSE"
printf '%s\nfiles: %s\n' "$from" "${copied[*]}" > "$out/SOURCE"
echo "fetch_megatron_lm: ${copied[*]} -> $out ($from)"

# the rest of what pretrain_gpt.py imports must come from the installed packages
if "$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("megatron.core") is None)' 2>/dev/null; then
  (cd "$out" && "$py" -c 'import pretrain_gpt' >/dev/null 2>"$out/import_check.txt") \
    && echo "fetch_megatron_lm: pretrain_gpt.py imports with the installed megatron-core" \
    || { echo "fetch_megatron_lm: pretrain_gpt.py does not import here (see $out/import_check.txt):" >&2
         tail -3 "$out/import_check.txt" >&2; exit 1; }
  rm -f "$out/import_check.txt"
fi
if [[ "$out" == "$root"/* ]] && ! git -C "$root" check-ignore -q "$out"; then
  echo "fetch_megatron_lm: $out is not ignored by git: add '/${out#"$root"/}/' to .git/info/exclude" >&2
fi
