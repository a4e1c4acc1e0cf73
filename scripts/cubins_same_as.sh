#!/usr/bin/env bash
# Are this tree's cubins byte-identical to those of commit REV (e.g. the last one verified on the
# GPU)? Builds REV's kernels in a temporary worktree and compares every cubin both trees have.
# Usage: bash scripts/cubins_same_as.sh REV [ARCH]   (exit status 1 if any cubin differs)
set -euo pipefail
REV=$1
ARCH=${2:-sm_90a}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
TMP=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$TMP/tree" >/dev/null 2>&1; rm -rf "$TMP"' EXIT
git -C "$ROOT" worktree add -q "$TMP/tree" "$REV"
(cd "$TMP/tree" && "$PY" -m kernels.build --arch "$ARCH" --out "$TMP/cubins" >/dev/null)
(cd "$ROOT" && "$PY" -m kernels.build --arch "$ARCH" >/dev/null)
rc=0
for f in "$TMP/cubins/$ARCH"/*.cubin; do
  n=$(basename "$f")
  here="$ROOT/kda_cute/_cubins/$ARCH/$n"
  if [ ! -f "$here" ]; then echo "only in $REV: $n"
  elif cmp -s "$f" "$here"; then echo "same     $n"
  else echo "DIFFERS  $n"; rc=1; fi
done
exit $rc
