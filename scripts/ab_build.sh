#!/usr/bin/env bash
# Build the cubins of several revisions side by side, for timing them in one device call.
# Each REV's kernels go to build/ab/<name>/<arch> (git-ignored; carry "build/ab"); on the device:
#   for d in build/ab/*; do KDA_CUTE_CUBIN_DIR=$d python3 bench/bench.py --no-fla --cases ...; done
# The launcher of the checked-out tree runs every variant, so the revisions must share its kernel
# arguments (kda_cute/abi.py). Usage: bash scripts/ab_build.sh REV [REV ...]   (name: REV with
# '/' as '-')
set -euo pipefail
ARCH=${ARCH:-sm_90a}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
TMP=$(mktemp -d)
trap 'for t in "$TMP"/tree-*; do git -C "$ROOT" worktree remove --force "$t" >/dev/null 2>&1; done; rm -rf "$TMP"' EXIT
for REV in "$@"; do
  name=${REV//\//-}
  tree="$TMP/tree-$name"
  git -C "$ROOT" worktree add -q --detach "$tree" "$REV"
  (cd "$tree" && "$PY" -m kernels.build --arch "$ARCH" --out "$ROOT/build/ab/$name" | tail -1)
  git -C "$ROOT" diff --quiet "$REV" HEAD -- kda_cute/abi.py \
    || echo "warning: $REV's kernel arguments differ from this tree's; its cubins will not launch"
done
