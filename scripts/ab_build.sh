#!/usr/bin/env bash
# Build the cubins of several revisions side by side, for timing them in one device call.
# Each REV's kernels go to build/ab/<name>/<arch> and its launcher, benchmark and tests
# (kda_cute/, bench/, tests/, pyproject.toml) to build/ab/<name>/src (git-ignored; carry
# "build/ab"), so revisions with different kernel arguments compare too. On the device:
#   bash scripts/ab_bench.sh [CASES] [HEAD_DIM]
# and a revision's GPU tests on its own cubins:
#   (cd build/ab/<name>/src && KDA_CUTE_CUBIN_DIR=$PWD/.. python3 -m pytest -q \
#    -p no:cacheprovider -m gpu tests/...)   (src has the revision's pyproject.toml, so pytest
#   imports the revision's kda_cute, not the checkout's)
# Usage: bash scripts/ab_build.sh REV [REV ...]   (name: REV with '/' as '-')
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
  rm -rf "$ROOT/build/ab/$name"
  (cd "$tree" && "$PY" -m kernels.build --arch "$ARCH" --out "$ROOT/build/ab/$name" | tail -1)
  mkdir -p "$ROOT/build/ab/$name/src"
  git -C "$ROOT" archive "$REV" kda_cute bench tests pyproject.toml ":(exclude)bench/results" \
    | tar x -C "$ROOT/build/ab/$name/src"
done
